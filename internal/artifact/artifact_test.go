package artifact_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/fault"
)

type testBundle struct {
	store  *artifact.Store
	faults *fault.Set
}

// setup opens a store on a fresh temp dir. arm, when not nil, arms the
// store's fault set before the store is used.
func setup(t *testing.T, arm func(s *fault.Set)) *testBundle {
	t.Helper()
	var faults *fault.Set
	if arm != nil {
		faults = &fault.Set{}
		arm(faults)
	}
	st, err := artifact.Open(t.TempDir(), faults)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return &testBundle{store: st, faults: faults}
}

func sha(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func mustArm(t *testing.T, s *fault.Set, name string, a fault.Action, nth int) {
	t.Helper()
	if err := s.Arm(name, a, nth); err != nil {
		t.Fatalf("Arm %s: %v", name, err)
	}
}

// dirNames lists the entry names of one of the store's folders, sorted.
func dirNames(t *testing.T, st *artifact.Store, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(st.Root(), dir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func readAll(t *testing.T, r io.Reader) []byte {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// mustPutMany is PutManyUnsynced of items that all must succeed; it returns
// their Metas.
// firstAttempt is the item of attempt 1 of task, under its token.
func firstAttempt(task string, data []byte) artifact.Item {
	return artifact.Item{Token: artifact.Token(task, 1), TaskID: task, Attempt: 1, Data: data}
}

func mustPutMany(tb testing.TB, st *artifact.Store, items []artifact.Item) []artifact.Meta {
	tb.Helper()
	metas, errs := st.PutManyUnsynced(items)
	if err := errors.Join(errs...); err != nil {
		tb.Fatal(err)
	}
	return metas
}

// wantUnreadable writes content as objects/tok.obj and checks that every
// reader reports an error other than ErrNotFound (no panic) and that a Put
// of tok fails.
func wantUnreadable(t *testing.T, b *testBundle, content []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(b.store.Root(), "objects", "tok.obj"), content, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Head("tok"); err == nil || errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Head: err = %v, want a non-NotFound error", err)
	}
	if r, _, err := b.store.Open("tok"); err == nil || errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Open: err = %v, want a non-NotFound error", err)
		if r != nil {
			r.Close()
		}
	}
	if _, err := b.store.Observe("tok"); err == nil || errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Observe: err = %v, want a non-NotFound error", err)
	}
	if _, err := b.store.Put("tok", "t", 1, []byte("abc")); err == nil {
		t.Error("Put over a corrupt object succeeded")
	}
}

// runItems returns a run of 64 items of data, with tokens tok-<n+1> to
// tok-<n+64>, and advances n.
func runItems(n *int, data []byte) []artifact.Item {
	items := make([]artifact.Item, 64)
	for i := range items {
		*n++
		items[i] = artifact.Item{Token: fmt.Sprintf("tok-%d", *n), TaskID: "task", Attempt: 1, Data: data}
	}
	return items
}

func TestOpenCreatesLayout(t *testing.T) {
	t.Parallel()
	root := filepath.Join(t.TempDir(), "a", "b")
	st, err := artifact.Open(root, nil)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if st.Root() != root {
		t.Errorf("Root() = %q, want %q", st.Root(), root)
	}
	for _, d := range []string{"objects", "hidden", "tmp"} {
		if fi, err := os.Stat(filepath.Join(root, d)); err != nil || !fi.IsDir() {
			t.Errorf("%s: not a directory (%v)", d, err)
		}
	}
	// Opening again is fine.
	if _, err := artifact.Open(root, nil); err != nil {
		t.Errorf("reopen: %v", err)
	}

	// A root that is a regular file cannot hold a store.
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := artifact.Open(file, nil); err == nil {
		t.Error("Open on a regular file: want error")
	}
}

func TestPutRoundTrip(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		data []byte
	}{
		{"json", []byte(`{"a":1,"b":[true,null]}`)},
		{"empty", []byte{}},
		{"binary", bytes.Repeat([]byte{0, 1, 2, 0xff}, 4096)},
		{"newlines", []byte("\n\n{\n}\n")},
		{"large", bytes.Repeat([]byte("0123456789abcdef\n"), 20000)}, // past the one-write size
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			token := artifact.Token("task-"+tt.name, 2)
			before := time.Now().UTC().Add(-time.Second)
			m, err := b.store.Put(token, "task-"+tt.name, 2, tt.data)
			if err != nil {
				t.Fatalf("Put: %v", err)
			}
			after := time.Now().UTC().Add(time.Second)
			if m.Token != token || m.TaskID != "task-"+tt.name || m.Attempt != 2 {
				t.Errorf("Meta identity = %+v", m)
			}
			if m.Size != int64(len(tt.data)) || m.SHA256 != sha(tt.data) {
				t.Errorf("Meta size/sha = %d/%s, want %d/%s", m.Size, m.SHA256, len(tt.data), sha(tt.data))
			}
			if m.CreatedAt.Before(before) || m.CreatedAt.After(after) || m.CreatedAt.Location() != time.UTC {
				t.Errorf("CreatedAt = %v, want UTC now", m.CreatedAt)
			}

			h, err := b.store.Head(token)
			if err != nil {
				t.Fatalf("Head: %v", err)
			}
			if !h.CreatedAt.Equal(m.CreatedAt) {
				t.Errorf("Head CreatedAt = %v, want %v", h.CreatedAt, m.CreatedAt)
			}
			h.CreatedAt = m.CreatedAt
			if h != m {
				t.Errorf("Head = %+v, want %+v", h, m)
			}

			r, om, err := b.store.Open(token)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			got := readAll(t, r)
			if err := r.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if !bytes.Equal(got, tt.data) {
				t.Errorf("Open bytes differ: %d bytes, want %d", len(got), len(tt.data))
			}
			if om.SHA256 != m.SHA256 || om.Size != m.Size {
				t.Errorf("Open meta = %+v", om)
			}

			obs, err := b.store.Observe(token)
			if err != nil {
				t.Fatalf("Observe: %v", err)
			}
			if obs.Size != m.Size || obs.SHA256 != m.SHA256 || obs.Meta.SHA256 != m.SHA256 {
				t.Errorf("Observe = %+v, want size %d sha %s", obs, m.Size, m.SHA256)
			}
		})
	}
}

func TestOpenIsSeekable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if _, err := b.store.Put("tok-seek", "t", 1, []byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	r, _, err := b.store.Open("tok-seek")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.Seek(5, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	if got := string(readAll(t, r)); got != "56789" {
		t.Errorf("after Seek(5): %q", got)
	}
}

func TestPutIdempotent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := []byte(`{"x":"y"}`)
	first, err := b.store.Put("tok-idem", "task-1", 1, data)
	if err != nil {
		t.Fatalf("first Put: %v", err)
	}
	objPath := filepath.Join(b.store.Root(), "objects", "tok-idem.obj")
	o0, err := os.Stat(objPath)
	if err != nil {
		t.Fatal(err)
	}

	for i := range 3 {
		again, err := b.store.Put("tok-idem", "task-1", 1, data)
		if err != nil {
			t.Fatalf("Put #%d: %v", i+2, err)
		}
		if !again.CreatedAt.Equal(first.CreatedAt) {
			t.Errorf("Put #%d CreatedAt = %v, want the first %v", i+2, again.CreatedAt, first.CreatedAt)
		}
		again.CreatedAt = first.CreatedAt
		if again != first {
			t.Errorf("Put #%d = %+v, want %+v", i+2, again, first)
		}
	}
	// Nothing was rewritten: same file (a rename would make a new inode),
	// same modification time.
	o1, err := os.Stat(objPath)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(o0, o1) || !o0.ModTime().Equal(o1.ModTime()) {
		t.Error("object file was rewritten by an idempotent Put")
	}
	if got := dirNames(t, b.store, "objects"); !slices.Equal(got, []string{"tok-idem.obj"}) {
		t.Errorf("objects = %v, want only tok-idem.obj", got)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp not empty: %v", got)
	}
}

func TestPutTokenConflict(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		taskID  string
		attempt int
		data    string
	}{
		{"different content", "task-1", 1, "other"},
		{"different task", "task-2", 1, "original"},
		{"different attempt", "task-1", 2, "original"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			orig, err := b.store.Put("tok-c", "task-1", 1, []byte("original"))
			if err != nil {
				t.Fatal(err)
			}
			got, err := b.store.Put("tok-c", tt.taskID, tt.attempt, []byte(tt.data))
			if !errors.Is(err, artifact.ErrTokenConflict) {
				t.Fatalf("Put: err = %v, want ErrTokenConflict", err)
			}
			if got.SHA256 != orig.SHA256 || got.TaskID != orig.TaskID {
				t.Errorf("conflict returned %+v, want the existing %+v", got, orig)
			}
			obs, err := b.store.Observe("tok-c")
			if err != nil {
				t.Fatal(err)
			}
			if obs.SHA256 != sha([]byte("original")) {
				t.Error("the committed object was changed by a conflicting Put")
			}
		})
	}
}

func TestInvalidToken(t *testing.T) {
	t.Parallel()
	tokens := []string{
		"",
		"../x",
		"a/b",
		"a b",
		" a",
		"a ",
		".hidden",
		"-flag",
		"a\x00b",
		"a\\b",
		"é",
		strings.Repeat("a", 181),
	}
	b := setup(t, nil)
	for _, tok := range tokens {
		if _, err := b.store.Put(tok, "t", 1, []byte("x")); !errors.Is(err, artifact.ErrInvalidToken) {
			t.Errorf("Put(%.20q): err = %v, want ErrInvalidToken", tok, err)
		}
		if _, err := b.store.Head(tok); !errors.Is(err, artifact.ErrInvalidToken) {
			t.Errorf("Head(%.20q): err = %v, want ErrInvalidToken", tok, err)
		}
		if err := b.store.Hide(tok); !errors.Is(err, artifact.ErrInvalidToken) {
			t.Errorf("Hide(%.20q): err = %v, want ErrInvalidToken", tok, err)
		}
		if _, _, err := b.store.Open(tok); !errors.Is(err, artifact.ErrInvalidToken) {
			t.Errorf("Open(%.20q): err = %v, want ErrInvalidToken", tok, err)
		}
		if _, err := b.store.Observe(tok); !errors.Is(err, artifact.ErrInvalidToken) {
			t.Errorf("Observe(%.20q): err = %v, want ErrInvalidToken", tok, err)
		}
	}
	// Nothing escaped the store or was written to it.
	for _, d := range []string{"objects", "hidden", "tmp"} {
		if got := dirNames(t, b.store, d); len(got) != 0 {
			t.Errorf("%s: %v", d, got)
		}
	}
	if _, err := os.Stat(filepath.Join(b.store.Root(), "x.data")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("../x escaped the objects folder: %v", err)
	}

	// The longest and the most varied valid tokens work.
	for _, tok := range []string{strings.Repeat("a", 180), "A9._:-z", "0"} {
		if _, err := b.store.Put(tok, "t", 1, []byte("x")); err != nil {
			t.Errorf("Put(%.20q): %v", tok, err)
		}
	}
}

func TestHeadAbsent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if _, err := b.store.Head("nope"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Head: err = %v, want ErrNotFound", err)
	}
	if _, _, err := b.store.Open("nope"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Open: err = %v, want ErrNotFound", err)
	}
	if _, err := b.store.Observe("nope"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Observe: err = %v, want ErrNotFound", err)
	}
}

func TestHide(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if _, err := b.store.Put("tok-h", "t", 1, []byte("payload")); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Put("tok-keep", "t", 1, []byte("kept")); err != nil {
		t.Fatal(err)
	}
	if err := b.store.Hide("tok-h"); err != nil {
		t.Fatalf("Hide: %v", err)
	}
	if _, err := b.store.Head("tok-h"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Head after Hide: err = %v, want ErrNotFound", err)
	}
	if _, _, err := b.store.Open("tok-h"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Open after Hide: err = %v, want ErrNotFound", err)
	}
	if _, err := b.store.Head("tok-keep"); err != nil {
		t.Errorf("Hide removed another object: %v", err)
	}
	// The hidden object is kept, not deleted.
	if got, want := dirNames(t, b.store, "hidden"), []string{"tok-h.obj"}; !slices.Equal(got, want) {
		t.Errorf("hidden = %v, want %v", got, want)
	}
	hidden, err := os.ReadFile(filepath.Join(b.store.Root(), "hidden", "tok-h.obj"))
	if err != nil || !bytes.HasSuffix(hidden, []byte("}\npayload")) {
		t.Errorf("hidden object = %q, %v", hidden, err)
	}

	// Idempotent: hide again, hide something that never existed.
	if err := b.store.Hide("tok-h"); err != nil {
		t.Errorf("second Hide: %v", err)
	}
	if err := b.store.Hide("never-existed"); err != nil {
		t.Errorf("Hide of absent: %v", err)
	}
	if got, want := dirNames(t, b.store, "objects"), []string{"tok-keep.obj"}; !slices.Equal(got, want) {
		t.Errorf("objects = %v, want %v", got, want)
	}
}

func TestFaultCorruptAfterWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, func(s *fault.Set) {
		mustArm(t, s, fault.ArtifactCorruptAfterWrite, fault.ActionCorrupt, 0)
	})
	for i, data := range [][]byte{[]byte(`{"doc":true}`), bytes.Repeat([]byte(`{"doc":true}`), 10000)} {
		tok := fmt.Sprintf("tok-corrupt-%d", i)
		m, err := b.store.Put(tok, "t", 1, data)
		if err != nil {
			t.Fatalf("Put: %v", err)
		}
		// Meta describes what the caller asked to store, and so does the
		// stored header...
		if m.SHA256 != sha(data) || m.Size != int64(len(data)) {
			t.Errorf("Meta = %+v, want the sha/size of the input", m)
		}
		if h, err := b.store.Head(tok); err != nil || h.SHA256 != sha(data) || h.Size != int64(len(data)) {
			t.Errorf("Head = %+v, %v; want the sha/size of the input", h, err)
		}
		// ...but reading back shows something else.
		obs, err := b.store.Observe(tok)
		if err != nil {
			t.Fatalf("Observe: %v", err)
		}
		if obs.SHA256 == obs.Meta.SHA256 || obs.Size == obs.Meta.Size {
			t.Errorf("Observe = %+v: the corruption is not visible", obs)
		}
		r, _, err := b.store.Open(tok)
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, r); !bytes.HasPrefix(got, data) || len(got) == len(data) {
			t.Errorf("Open read %d bytes, want the %d bytes written plus the corruption", len(got), len(data))
		}
		r.Close()
	}
	if got := b.faults.Fired(fault.ArtifactCorruptAfterWrite); got != 2 {
		t.Errorf("Fired = %d, want 2", got)
	}
}

func TestFaultCorruptNeedsCorruptAction(t *testing.T) {
	t.Parallel()
	// "error" on the corrupt point is not a corruption.
	b := setup(t, func(s *fault.Set) {
		mustArm(t, s, fault.ArtifactCorruptAfterWrite, fault.ActionError, 0)
	})
	if _, err := b.store.Put("tok", "t", 1, []byte("x")); err != nil {
		t.Fatal(err)
	}
	obs, err := b.store.Observe("tok")
	if err != nil {
		t.Fatal(err)
	}
	if obs.SHA256 != obs.Meta.SHA256 {
		t.Errorf("stored bytes altered by a non-corrupt action: %+v", obs)
	}
}

func TestFaultPutTimeoutAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, func(s *fault.Set) {
		mustArm(t, s, fault.ArtifactPutTimeoutAfterCommit, fault.ActionError, 1)
	})
	data := []byte("committed anyway")
	_, err := b.store.Put("tok-to", "task-9", 3, data)
	if !errors.Is(err, artifact.ErrTimeout) {
		t.Fatalf("Put: err = %v, want ErrTimeout", err)
	}
	// The outcome is observable: the object was committed.
	h, err := b.store.Head("tok-to")
	if err != nil {
		t.Fatalf("Head after timeout: %v", err)
	}
	if h.SHA256 != sha(data) || h.TaskID != "task-9" || h.Attempt != 3 {
		t.Errorf("Head = %+v", h)
	}
	// A retry with the same token is the idempotent path: the existing
	// object, no error (and the fault point is not passed again).
	again, err := b.store.Put("tok-to", "task-9", 3, data)
	if err != nil {
		t.Fatalf("retried Put: %v", err)
	}
	if !again.CreatedAt.Equal(h.CreatedAt) {
		t.Errorf("retried Put returned a new CreatedAt")
	}
	if got := b.faults.Fired(fault.ArtifactPutTimeoutAfterCommit); got != 1 {
		t.Errorf("Fired = %d, want 1", got)
	}
}

func TestDataWithoutMetaDoesNotExist(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// A crash of the previous version between the data link and the meta
	// link leaves this.
	orphan := filepath.Join(b.store.Root(), "objects", dataName("tok-crash", []byte("an earlier attempt")))
	if err := os.WriteFile(orphan, []byte("half-written attempt"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Head("tok-crash"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Head: err = %v, want ErrNotFound", err)
	}
	if _, _, err := b.store.Open("tok-crash"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Open: err = %v, want ErrNotFound", err)
	}
	data := []byte("the real artifact")
	m, err := b.store.Put("tok-crash", "t", 1, data)
	if err != nil {
		t.Fatalf("Put after crash: %v", err)
	}
	obs, err := b.store.Observe("tok-crash")
	if err != nil {
		t.Fatal(err)
	}
	if obs.SHA256 != m.SHA256 || obs.SHA256 != sha(data) {
		t.Errorf("Observe = %+v, want the new bytes", obs)
	}
}

func TestNoTempFilesLeft(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i := range 10 {
		tok := artifact.Token("task", i)
		if _, err := b.store.Put(tok, "task", i, bytes.Repeat([]byte{byte(i)}, 100*i)); err != nil {
			t.Fatal(err)
		}
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp has leftovers: %v", got)
	}
	if got := len(dirNames(t, b.store, "objects")); got != 10 {
		t.Errorf("objects has %d files, want 10", got)
	}
}

func TestConcurrentPutSameToken(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := bytes.Repeat([]byte(`{"k":"v"}`), 1000)
	const n = 8
	metas := make([]artifact.Meta, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			metas[i], errs[i] = b.store.Put("tok-race", "task", 1, data)
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Errorf("Put %d: %v", i, errs[i])
			continue
		}
		if metas[i].SHA256 != sha(data) || metas[i].Size != int64(len(data)) {
			t.Errorf("Put %d: Meta = %+v", i, metas[i])
		}
	}
	if got, want := dirNames(t, b.store, "objects"), []string{"tok-race.obj"}; !slices.Equal(got, want) {
		t.Errorf("objects = %v, want %v", got, want)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp has leftovers: %v", got)
	}
	obs, err := b.store.Observe("tok-race")
	if err != nil {
		t.Fatal(err)
	}
	if obs.SHA256 != sha(data) || obs.Meta.SHA256 != sha(data) {
		t.Errorf("Observe = %+v", obs)
	}
}

func TestToken(t *testing.T) {
	t.Parallel()
	tests := []struct {
		taskID  string
		attempt int
		want    string
	}{
		{"0b7c6f1e-2a3d-4e5f-8a9b-0c1d2e3f4a5b", 1, "0b7c6f1e-2a3d-4e5f-8a9b-0c1d2e3f4a5b.attempt-1"},
		{"task", 0, "task.attempt-0"},
		{"task", 12, "task.attempt-12"},
	}
	b := setup(t, nil)
	for _, tt := range tests {
		got := artifact.Token(tt.taskID, tt.attempt)
		if got != tt.want {
			t.Errorf("Token(%q, %d) = %q, want %q", tt.taskID, tt.attempt, got, tt.want)
		}
		if artifact.Token(tt.taskID, tt.attempt) != got {
			t.Errorf("Token(%q, %d) is not stable", tt.taskID, tt.attempt)
		}
		// Every token of a valid task id is a valid store token.
		if _, err := b.store.Head(got); !errors.Is(err, artifact.ErrNotFound) {
			t.Errorf("Head(%q): err = %v, want ErrNotFound", got, err)
		}
	}
	if artifact.Token("t", 1) == artifact.Token("t", 2) {
		t.Error("attempts share a token")
	}
}

// dataName is the file name of an object's bytes in the two-file layout:
// token, intended SHA-256.
func dataName(token string, data []byte) string {
	return token + "." + sha(data) + ".data"
}

// TestConcurrentPutDifferentContent: of two concurrent Puts of one token with
// different bytes exactly one commits; the other gets ErrTokenConflict, and
// the committed object's bytes match its meta.
func TestConcurrentPutDifferentContent(t *testing.T) {
	t.Parallel()
	for round := range 50 {
		b := setup(t, nil)
		tok := fmt.Sprintf("tok-diff-%d", round)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = b.store.Put(tok, "t", 1, []byte(fmt.Sprintf("content-%d", i)))
			}()
		}
		wg.Wait()
		ok := 0
		for _, err := range errs {
			if err == nil {
				ok++
			} else if !errors.Is(err, artifact.ErrTokenConflict) {
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if ok != 1 {
			t.Fatalf("round %d: %d Puts committed, want 1 (%v)", round, ok, errs)
		}
		obs, err := b.store.Observe(tok)
		if err != nil || obs.SHA256 != obs.Meta.SHA256 || obs.Size != obs.Meta.Size {
			t.Fatalf("round %d: stored bytes do not match meta: %+v %v", round, obs, err)
		}
		if got := dirNames(t, b.store, "objects"); !slices.Equal(got, []string{tok + ".obj"}) {
			t.Fatalf("round %d: objects = %v, want one object", round, got)
		}
		if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
			t.Fatalf("round %d: tmp has leftovers: %v", round, got)
		}
	}
}

// TestPutOneFile: a Put leaves exactly one name, objects/<token>.obj, of a
// pack file of one record: the magic line, the record's header (the stored
// length, then the Meta) as one JSON line, then the bytes.
func TestPutOneFile(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := []byte("{\"a\":\"line\\nbreak\"}\n")
	m, err := b.store.Put("tok-one", "task\nwith a newline", 4, data)
	if err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, b.store, "objects"); !slices.Equal(got, []string{"tok-one.obj"}) {
		t.Errorf("objects = %v, want only tok-one.obj", got)
	}
	for _, d := range []string{"tmp", "hidden"} {
		if got := dirNames(t, b.store, d); len(got) != 0 {
			t.Errorf("%s = %v, want empty", d, got)
		}
	}
	raw, err := os.ReadFile(filepath.Join(b.store.Root(), "objects", "tok-one.obj"))
	if err != nil {
		t.Fatal(err)
	}
	rest, ok := bytes.CutPrefix(raw, []byte("CVPACK1\n"))
	if !ok {
		t.Fatalf("no pack magic line in %q", raw)
	}
	line, rest, ok := bytes.Cut(rest, []byte("\n"))
	if !ok {
		t.Fatalf("no header line in %q", raw)
	}
	var hm struct {
		Stored int64 `json:"stored"`
		artifact.Meta
	}
	if err := json.Unmarshal(line, &hm); err != nil {
		t.Fatalf("header %q: %v", line, err)
	}
	if !bytes.HasPrefix(line, []byte(`{"stored":20,"token":"tok-one",`)) {
		t.Errorf("header %q does not start with the stored length and the token", line)
	}
	if !hm.CreatedAt.Equal(m.CreatedAt) {
		t.Errorf("header CreatedAt = %v, want %v", hm.CreatedAt, m.CreatedAt)
	}
	hm.CreatedAt = m.CreatedAt
	if hm.Meta != m || hm.Stored != int64(len(data)) {
		t.Errorf("header = %+v, want %+v and stored %d", hm, m, len(data))
	}
	if !bytes.Equal(rest, data) {
		t.Errorf("bytes after the header = %q, want %q", rest, data)
	}
	if h, err := b.store.Head("tok-one"); err != nil || h.TaskID != "task\nwith a newline" {
		t.Errorf("Head = %+v, %v", h, err)
	}
}

// TestPutManyWritesPacks: the objects of one PutManyUnsynced share pack
// files of at most 64 objects (one inode each, linked once per object);
// every object reads back whole, whatever its place in its pack and its
// size; deleting objects leaves the others of their pack readable, and the
// pack's inode goes with its last name.
func TestPutManyWritesPacks(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	items := make([]artifact.Item, 70)
	for i := range items {
		data := bytes.Repeat([]byte{byte('a' + i%26)}, 1+i*37)
		if i == 3 || i == 66 {
			data = bytes.Repeat([]byte{'L'}, 200<<10) // beyond one window and one write
		}
		items[i] = artifact.Item{Token: fmt.Sprintf("tok-%02d", i), TaskID: fmt.Sprintf("task-%d", i), Attempt: 1 + i%3, Data: data}
	}
	metas := mustPutMany(t, b.store, items)
	if err := b.store.SyncObjects(); err != nil {
		t.Fatal(err)
	}
	infos := make([]os.FileInfo, len(items))
	for i, it := range items {
		fi, err := os.Stat(filepath.Join(b.store.Root(), "objects", it.Token+".obj"))
		if err != nil {
			t.Fatal(err)
		}
		infos[i] = fi
		wantPack, wantLinks := 0, uint64(64)
		if i >= 64 {
			wantPack, wantLinks = 64, 6
		}
		if !os.SameFile(fi, infos[wantPack]) {
			t.Errorf("%s is not in the pack of %s", it.Token, items[wantPack].Token)
		}
		if n := fi.Sys().(*syscall.Stat_t).Nlink; n != wantLinks {
			t.Errorf("%s: pack has %d links, want %d", it.Token, n, wantLinks)
		}
		obs, err := b.store.Observe(it.Token)
		if err != nil || obs.Size != int64(len(it.Data)) || obs.SHA256 != sha(it.Data) || obs.Meta != metas[i] {
			t.Errorf("%s: Observe = %+v, %v; want %d bytes, Meta %+v", it.Token, obs, err, len(it.Data), metas[i])
		}
		if h, err := b.store.Head(it.Token); err != nil || h != metas[i] {
			t.Errorf("%s: Head = %+v, %v", it.Token, h, err)
		}
		r, m, err := b.store.Open(it.Token)
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, r); !bytes.Equal(got, it.Data) || m != metas[i] {
			t.Errorf("%s: Open read %d bytes, want %d", it.Token, len(got), len(it.Data))
		}
		r.Close()
	}
	if os.SameFile(infos[0], infos[64]) {
		t.Error("70 objects in one pack, want 64 and 6")
	}
	// Delete all but one object of the second pack; the last keeps it.
	for _, it := range items[64:69] {
		if err := b.store.Delete(it.Token); err != nil {
			t.Fatal(err)
		}
	}
	if obs, err := b.store.Observe(items[69].Token); err != nil || obs.SHA256 != sha(items[69].Data) {
		t.Errorf("the last object of a pack: %+v, %v", obs, err)
	}
	fi, err := os.Stat(filepath.Join(b.store.Root(), "objects", items[69].Token+".obj"))
	if err != nil || fi.Sys().(*syscall.Stat_t).Nlink != 1 {
		t.Fatalf("the last name of a pack: %v, %v", fi, err)
	}
	if err := b.store.Hide(items[69].Token); err != nil {
		t.Fatal(err)
	}
	if err := b.store.Delete(items[69].Token); err != nil {
		t.Fatal(err)
	}
	if gone, err := b.store.Gone(items[69].Token); !gone || err != nil {
		t.Errorf("Gone = %v, %v", gone, err)
	}
}

// TestFaultCorruptInPack: the corrupted object of a pack fails its read-back
// verification (its stored bytes differ from its Meta) and its neighbours,
// written with it, read back whole.
func TestFaultCorruptInPack(t *testing.T) {
	t.Parallel()
	b := setup(t, func(s *fault.Set) { mustArm(t, s, fault.ArtifactCorruptAfterWrite, fault.ActionCorrupt, 2) })
	items := []artifact.Item{
		{Token: "tok-a", TaskID: "a", Attempt: 1, Data: []byte("first")},
		{Token: "tok-b", TaskID: "b", Attempt: 1, Data: []byte("second")},
		{Token: "tok-c", TaskID: "c", Attempt: 1, Data: []byte("third")},
	}
	mustPutMany(t, b.store, items)
	for i, it := range items {
		obs, err := b.store.Observe(it.Token)
		if err != nil {
			t.Fatal(err)
		}
		if ok := obs.SHA256 == obs.Meta.SHA256 && obs.Size == obs.Meta.Size; ok != (i != 1) || obs.Meta.SHA256 != sha(it.Data) {
			t.Errorf("%s: observed %+v; want the corruption on tok-b only", it.Token, obs)
		}
	}
}

// TestReadsObjectsOfEarlierReleases: an object an earlier release wrote,
// one file of the Meta's JSON line then the bytes, reads as before, and a
// Put of its token with the same content finds it.
func TestReadsObjectsOfEarlierReleases(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := []byte(`{"old":true}`)
	m := artifact.Meta{Token: "tok-old", TaskID: "task-old", Attempt: 2, Size: int64(len(data)), SHA256: sha(data), CreatedAt: time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)}
	hdr, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b.store.Root(), "objects", "tok-old.obj"), slices.Concat(hdr, []byte("\n"), data), 0o644); err != nil {
		t.Fatal(err)
	}
	if h, err := b.store.Head("tok-old"); err != nil || h != m {
		t.Errorf("Head = %+v, %v; want %+v", h, err, m)
	}
	if obs, err := b.store.Observe("tok-old"); err != nil || obs.SHA256 != m.SHA256 || obs.Size != m.Size {
		t.Errorf("Observe = %+v, %v", obs, err)
	}
	r, _, err := b.store.Open("tok-old")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r); !bytes.Equal(got, data) {
		t.Errorf("Open read %q", got)
	}
	r.Close()
	if got, err := b.store.Put("tok-old", "task-old", 2, data); err != nil || got != m {
		t.Errorf("Put of the same content = %+v, %v; want the old Meta", got, err)
	}
}

// TestCorruptPack: a pack file that cannot be read is an error for every
// reader (not ErrNotFound, not a panic): a damaged header, a name that
// links a pack without its record, a header without its newline. A pack
// whose stored bytes are cut short reads back fewer bytes, which
// verification detects.
func TestCorruptPack(t *testing.T) {
	t.Parallel()
	rec := func(stored int, token, rest string) string {
		return fmt.Sprintf(`{"stored":%d,"token":%q,"task_id":"t","attempt":1,"size":%d,"sha256":"x","created_at":"2026-12-07T00:00:00Z"}`, stored, token, stored) + "\n" + rest
	}
	tests := []struct {
		name    string
		content string
	}{
		{"magic only", "CVPACK1\n"},
		{"another token only", "CVPACK1\n" + rec(3, "tok-other", "abc")},
		{"skip past the end", "CVPACK1\n" + rec(1000, "tok-other", "abc") + rec(3, "tok", "abc")},
		{"not a record header", "CVPACK1\n{\"token\":\"tok\",\"stored\":3}\nabc"},
		{"header without a newline", "CVPACK1\n" + `{"stored":3,"token":"tok"`},
		{"header not JSON", "CVPACK1\n" + `{"stored":3,"token":"tok" oops` + "\nabc"},
		{"stored differs from the prefix", "CVPACK1\n" + `{"stored":3,"token":"tok","stored":4}` + "\nabc"},
		{"no newline within the bound", "CVPACK1\n" + `{"stored":3,"token":"tok` + strings.Repeat("a", 100<<10)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			wantUnreadable(t, setup(t, nil), []byte(tt.content))
		})
	}
	t.Run("stored bytes cut short", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		if err := os.WriteFile(filepath.Join(b.store.Root(), "objects", "tok.obj"), []byte("CVPACK1\n"+rec(10, "tok", "abc")), 0o644); err != nil {
			t.Fatal(err)
		}
		if obs, err := b.store.Observe("tok"); err != nil || obs.Size != 3 || obs.Meta.Size != 10 {
			t.Errorf("Observe = %+v, %v; want 3 bytes observed against 10", obs, err)
		}
	})
}

// TestCorruptHeader: an object whose header cannot be read is an error for
// every reader (not ErrNotFound, not a panic), and Put does not replace it.
func TestCorruptHeader(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		content []byte
	}{
		{"empty", nil},
		{"no newline", []byte(`{"token":"tok","task_id":"t","attempt":1,"size":1,"sha256":"x"}`)},
		{"bad json", []byte("{not json\npayload")},
		{"empty header", []byte("\npayload")},
		{"trailing garbage", []byte("{} {}\npayload")},
		{"no newline within the bound", bytes.Repeat([]byte("a"), 100<<10)},
		{"newline past the bound", append(bytes.Repeat([]byte(" "), 64<<10), "{}\npayload"...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			wantUnreadable(t, b, tt.content)
			if got, err := os.ReadFile(filepath.Join(b.store.Root(), "objects", "tok.obj")); err != nil || !bytes.Equal(got, tt.content) {
				t.Errorf("the corrupt object was changed (%v)", err)
			}
		})
	}
}

// TestLongHeader: a header longer than the first read is read in full; one
// that could not be read back is refused by Put.
func TestLongHeader(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, n := range []int{1000, 40 << 10} {
		taskID := strings.Repeat("t", n)
		data := []byte(`{"long":"task id"}`)
		if _, err := b.store.Put(fmt.Sprintf("tok-%d", n), taskID, 1, data); err != nil {
			t.Fatalf("Put with a %d-byte task id: %v", n, err)
		}
		h, err := b.store.Head(fmt.Sprintf("tok-%d", n))
		if err != nil || h.TaskID != taskID {
			t.Errorf("Head with a %d-byte task id: %v", n, err)
		}
		obs, err := b.store.Observe(fmt.Sprintf("tok-%d", n))
		if err != nil || obs.SHA256 != sha(data) || obs.Size != int64(len(data)) {
			t.Errorf("Observe with a %d-byte task id = %+v, %v", n, obs, err)
		}
	}
	if _, err := b.store.Put("tok-huge", strings.Repeat("t", 64<<10), 1, []byte("x")); err == nil {
		t.Error("Put with a 64 KiB task id: want error")
	}
	if _, err := b.store.Head("tok-huge"); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("Head after the refused Put: err = %v, want ErrNotFound", err)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp has leftovers: %v", got)
	}
}

// TestOpenDataOnly: the reader of Open covers the artifact bytes only, for
// Read, ReadAt and Seek, and http.ServeContent serves ranges of them.
func TestOpenDataOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := []byte("0123456789")
	if _, err := b.store.Put("tok-data", "t", 1, data); err != nil {
		t.Fatal(err)
	}
	r, m, err := b.store.Open("tok-data")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if m.Size != int64(len(data)) {
		t.Errorf("Meta.Size = %d", m.Size)
	}
	if got := string(readAll(t, r)); got != string(data) {
		t.Errorf("Read: %q", got)
	}
	if end, err := r.Seek(0, io.SeekEnd); err != nil || end != int64(len(data)) {
		t.Errorf("Seek(0, End) = %d, %v; want %d", end, err, len(data))
	}
	if pos, err := r.Seek(-3, io.SeekEnd); err != nil || pos != 7 {
		t.Errorf("Seek(-3, End) = %d, %v; want 7", pos, err)
	}
	if got := string(readAll(t, r)); got != "789" {
		t.Errorf("after Seek(-3, End): %q", got)
	}
	if pos, err := r.Seek(-8, io.SeekCurrent); err != nil || pos != 2 {
		t.Errorf("Seek(-8, Current) = %d, %v; want 2", pos, err)
	}
	buf := make([]byte, 3)
	if _, err := io.ReadFull(r, buf); err != nil || string(buf) != "234" {
		t.Errorf("after Seek(-8, Current): %q, %v", buf, err)
	}
	if _, err := r.Seek(-1, io.SeekStart); err == nil {
		t.Error("Seek(-1, Start): want error (before the data)")
	}
	ra, ok := r.(io.ReaderAt)
	if !ok {
		t.Fatalf("%T is not an io.ReaderAt", r)
	}
	if n, err := ra.ReadAt(buf, 8); n != 2 || err != io.EOF || string(buf[:n]) != "89" {
		t.Errorf("ReadAt(8) = %d %q, %v; want 2 \"89\", EOF", n, buf[:n], err)
	}

	if _, err := r.Seek(0, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodGet, "/artifact", nil)
	req.Header.Set("Range", "bytes=3-5")
	rec := httptest.NewRecorder()
	http.ServeContent(rec, req, "", time.Time{}, r)
	if rec.Code != http.StatusPartialContent || rec.Body.String() != "345" || rec.Header().Get("Content-Range") != "bytes 3-5/10" {
		t.Errorf("ServeContent range: %d %q %v", rec.Code, rec.Body.String(), rec.Header())
	}
}

// TestConcurrentPutManyContents: of many concurrent Puts of one token, some
// with the same content, exactly one content commits; every Put of it
// succeeds with the committed Meta and every other one conflicts.
func TestConcurrentPutManyContents(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		b := setup(t, nil)
		const n = 8
		metas := make([]artifact.Meta, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				metas[i], errs[i] = b.store.Put("tok", "t", 1, bytes.Repeat([]byte{byte('a' + i%2)}, 1000*(1+i%2)))
			})
		}
		close(start)
		wg.Wait()
		h, err := b.store.Head("tok")
		if err != nil {
			t.Fatal(err)
		}
		for i := range n {
			wins := sha(bytes.Repeat([]byte{byte('a' + i%2)}, 1000*(1+i%2))) == h.SHA256
			switch {
			case wins && errs[i] != nil:
				t.Errorf("round %d: Put %d of the committed content: %v", round, i, errs[i])
			case !wins && !errors.Is(errs[i], artifact.ErrTokenConflict):
				t.Errorf("round %d: Put %d of the other content: err = %v, want ErrTokenConflict", round, i, errs[i])
			case !metas[i].CreatedAt.Equal(h.CreatedAt) || metas[i].SHA256 != h.SHA256:
				t.Errorf("round %d: Put %d returned %+v, want the committed %+v", round, i, metas[i], h)
			}
		}
		if got := dirNames(t, b.store, "objects"); !slices.Equal(got, []string{"tok.obj"}) {
			t.Errorf("round %d: objects = %v", round, got)
		}
		if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
			t.Errorf("round %d: tmp has leftovers: %v", round, got)
		}
		if obs, err := b.store.Observe("tok"); err != nil || obs.SHA256 != h.SHA256 || obs.Size != h.Size {
			t.Errorf("round %d: Observe = %+v, %v; want the committed bytes", round, obs, err)
		}
	}
}

// BenchmarkPut measures one Put of a new token (Head, write, fsync, link,
// directory fsync) for a small and a large artifact.
func BenchmarkPut(b *testing.B) {
	for _, bc := range []struct {
		name string
		size int
	}{
		{"1KiB", 1 << 10},
		{"1MiB", 1 << 20},
	} {
		b.Run(bc.name, func(b *testing.B) {
			st, err := artifact.Open(b.TempDir(), nil)
			if err != nil {
				b.Fatal(err)
			}
			data := bytes.Repeat([]byte(`{"k":"v"}`), bc.size/9+1)[:bc.size]
			b.SetBytes(int64(bc.size))
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				if _, err := st.Put(artifact.Token("bench", i), "bench", i, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// PutUnsynced writes and links like Put (same object, same answers to Head
// and Observe, the same idempotency); only the directory fsync is left to
// SyncObjects.
func TestPutUnsyncedThenSyncObjects(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := []byte(`{"a":1}`)
	m, err := b.store.PutUnsynced("tok-unsynced", "task-1", 1, data)
	if err != nil {
		t.Fatalf("PutUnsynced: %v", err)
	}
	if m.SHA256 != sha(data) || m.Size != int64(len(data)) {
		t.Errorf("meta = %+v", m)
	}
	if h, err := b.store.Head("tok-unsynced"); err != nil || h.SHA256 != m.SHA256 {
		t.Fatalf("Head = %+v, %v", h, err)
	}
	if err := b.store.SyncObjects(); err != nil {
		t.Fatalf("SyncObjects: %v", err)
	}
	if again, err := b.store.Put("tok-unsynced", "task-1", 1, data); err != nil || again.SHA256 != m.SHA256 {
		t.Errorf("Put after PutUnsynced = %+v, %v", again, err)
	}
	if _, err := b.store.PutUnsynced("tok-unsynced", "task-1", 1, []byte(`{"a":2}`)); !errors.Is(err, artifact.ErrTokenConflict) {
		t.Errorf("PutUnsynced of other bytes: %v, want ErrTokenConflict", err)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp not empty: %v", got)
	}
}

// Temporary files of crashed Puts older than the bound are removed; a
// recent one (a Put in progress, maybe in another process) and other
// files are left (issue 13).
func TestRemoveLeftovers(t *testing.T) {
	t.Parallel()
	s, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(s.Root(), "tmp")
	old := time.Now().Add(-2 * time.Hour)
	for _, name := range []string{"put-crashed-1", "put-crashed-2", "put-in-progress", "other-file"} {
		if err := os.WriteFile(filepath.Join(tmp, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		if name != "put-in-progress" {
			if err := os.Chtimes(filepath.Join(tmp, name), old, old); err != nil {
				t.Fatal(err)
			}
		}
	}
	n, err := s.RemoveLeftovers(artifact.LeftoverAge)
	if err != nil || n != 2 {
		t.Fatalf("RemoveLeftovers = %d, %v; want 2", n, err)
	}
	left, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range left {
		names = append(names, e.Name())
	}
	if len(names) != 2 || names[0] != "other-file" || names[1] != "put-in-progress" {
		t.Fatalf("left in tmp: %v", names)
	}
}

// Delete removes a readable and a hidden object for good, touches no other
// token (not even one its token is a prefix of), and is idempotent; Gone
// reports the removal.
func TestDelete(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tok := range []string{"task-a.attempt-1", "task-a.attempt-2", "task-a.attempt-10", "task-b.attempt-1"} {
		if _, err := b.store.Put(tok, "t", 1, []byte("payload of "+tok)); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.store.Hide("task-a.attempt-2"); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"task-a.attempt-1", "task-a.attempt-2"} {
		if gone, err := b.store.Gone(tok); err != nil || gone {
			t.Fatalf("Gone(%s) before Delete = %v, %v; want false", tok, gone, err)
		}
		if err := b.store.Delete(tok); err != nil {
			t.Fatalf("Delete(%s): %v", tok, err)
		}
		if gone, err := b.store.Gone(tok); err != nil || !gone {
			t.Fatalf("Gone(%s) after Delete = %v, %v; want true", tok, gone, err)
		}
		if err := b.store.Delete(tok); err != nil {
			t.Fatalf("second Delete(%s): %v", tok, err)
		}
	}
	if err := b.store.Delete("never-existed"); err != nil {
		t.Errorf("Delete of absent: %v", err)
	}
	if got, want := dirNames(t, b.store, "objects"), []string{"task-a.attempt-10.obj", "task-b.attempt-1.obj"}; !slices.Equal(got, want) {
		t.Errorf("objects = %v, want %v", got, want)
	}
	if got := dirNames(t, b.store, "hidden"); len(got) != 0 {
		t.Errorf("hidden = %v, want none", got)
	}
	if err := b.store.Delete("../escape"); !errors.Is(err, artifact.ErrInvalidToken) {
		t.Errorf("Delete(../escape) = %v, want ErrInvalidToken", err)
	}
	if _, err := b.store.Gone("../escape"); !errors.Is(err, artifact.ErrInvalidToken) {
		t.Errorf("Gone(../escape) = %v, want ErrInvalidToken", err)
	}
}

// PutManyUnsynced answers each item as Put would: new objects committed and
// readable, a token committed with the same content kept (its Meta), with
// other content ErrTokenConflict, an invalid token ErrInvalidToken, the
// second of two items with one token decided by the first; the timeout
// fault hit once per object written, in order; no temporary file left.
func TestPutManyUnsyncedAnswersEachItemAsPut(t *testing.T) {
	t.Parallel()
	b := setup(t, func(s *fault.Set) {
		// The 4th object written: tok-kept's Put, then tok-m0, tok-m1, tok-m2.
		mustArm(t, s, fault.ArtifactPutTimeoutAfterCommit, fault.ActionError, 4)
	})
	kept, err := b.store.Put("tok-kept", "task-k", 1, []byte("kept"))
	if err != nil {
		t.Fatal(err)
	}
	items := []artifact.Item{
		{Token: "tok-m0", TaskID: "task-0", Attempt: 1, Data: []byte("zero")},
		{Token: "tok-kept", TaskID: "task-k", Attempt: 1, Data: []byte("kept")},
		{Token: "tok-m1", TaskID: "task-1", Attempt: 1, Data: bytes.Repeat([]byte("1"), 100<<10)},
		{Token: "tok-kept", TaskID: "task-k", Attempt: 1, Data: []byte("other")},
		{Token: "bad/token", TaskID: "task-b", Attempt: 1, Data: []byte("bad")},
		{Token: "tok-m2", TaskID: "task-2", Attempt: 2, Data: []byte("two")},
		{Token: "tok-m2", TaskID: "task-2", Attempt: 2, Data: []byte("two")},
		{Token: "tok-m3", TaskID: "task-3", Attempt: 1, Data: []byte("three")},
	}
	metas, errs := b.store.PutManyUnsynced(items)
	if len(metas) != len(items) || len(errs) != len(items) {
		t.Fatalf("%d metas, %d errors for %d items", len(metas), len(errs), len(items))
	}
	want := []error{nil, nil, nil, artifact.ErrTokenConflict, artifact.ErrInvalidToken, artifact.ErrTimeout, nil, nil}
	for i, w := range want {
		if w == nil && errs[i] != nil || w != nil && !errors.Is(errs[i], w) {
			t.Errorf("item %d (%s): err = %v, want %v", i, items[i].Token, errs[i], w)
		}
	}
	if !metas[1].CreatedAt.Equal(kept.CreatedAt) {
		t.Errorf("item 1: %+v, want the kept object's Meta %+v", metas[1], kept)
	}
	for _, i := range []int{0, 2, 5, 7} {
		obs, err := b.store.Observe(items[i].Token)
		if err != nil || obs.SHA256 != sha(items[i].Data) {
			t.Errorf("item %d: observed %+v, %v; want its bytes", i, obs, err)
		}
		if i != 5 && (metas[i].SHA256 != sha(items[i].Data) || metas[i].TaskID != items[i].TaskID) {
			t.Errorf("item %d: Meta %+v", i, metas[i])
		}
	}
	if got := b.faults.Fired(fault.ArtifactPutTimeoutAfterCommit); got != 1 {
		t.Errorf("timeout fault fired %d times, want 1 (the fourth object written)", got)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp has leftovers: %v", got)
	}
}

// BenchmarkPutRun: a worker run's 64 artifacts of 1 KiB, put one by one
// (PutUnsynced, as before 2026-12-06: 64 packs of one) or together
// (PutManyUnsynced: one pack), then the directory synced once;
// "together-named" is "together" with named temporary files (the fallback
// where O_TMPFILE is not supported; the only way before 2026-12-06, fifth
// session); "together-one-object-files" is "together" writing one file per
// object (WriteOneObjectFiles: before migration 00021, and until an
// upgrade is finalized). Reports ns per run of 64 and the
// process's CPU (user + system, getrusage) per run in cpu-ns/op: the time
// is mostly waiting for the disk, the CPU is what a run costs the machine.
//
//	go test -run '^$' -bench PutRun -benchtime 100x ./internal/artifact
func BenchmarkPutRun(b *testing.B) {
	data := bytes.Repeat([]byte("x"), 1024)
	for _, mode := range []string{"one-by-one", "together", "together-named", "together-one-object-files"} {
		b.Run(mode, func(b *testing.B) {
			st, err := artifact.Open(b.TempDir(), nil)
			if err != nil {
				b.Fatal(err)
			}
			switch mode {
			case "together-named":
				artifact.NamedTemporaryFiles(st)
			case "together-one-object-files":
				st.WriteOneObjectFiles()
			}
			n := 0
			cpu0 := processCPU(b)
			for b.Loop() {
				items := runItems(&n, data)
				if mode != "one-by-one" {
					mustPutMany(b, st, items)
				} else {
					for _, it := range items {
						if _, err := st.PutUnsynced(it.Token, it.TaskID, it.Attempt, it.Data); err != nil {
							b.Fatal(err)
						}
					}
				}
				if err := st.SyncObjects(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU(b)-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// BenchmarkRunReadBack: a worker run as the worker does it: 64 artifacts
// of 1 KiB put together, the directory synced, then each read back in full
// (Observe), in pack files or one file per object (WriteOneObjectFiles).
// Reports ns and process CPU (cpu-ns/op) per run of 64.
//
//	go test -run '^$' -bench RunReadBack -benchtime 100x ./internal/artifact
func BenchmarkRunReadBack(b *testing.B) {
	data := bytes.Repeat([]byte("x"), 1024)
	for _, mode := range []string{"packs", "one-object-files"} {
		b.Run(mode, func(b *testing.B) {
			st, err := artifact.Open(b.TempDir(), nil)
			if err != nil {
				b.Fatal(err)
			}
			if mode == "one-object-files" {
				st.WriteOneObjectFiles()
			}
			n := 0
			cpu0 := processCPU(b)
			for b.Loop() {
				items := runItems(&n, data)
				mustPutMany(b, st, items)
				if err := st.SyncObjects(); err != nil {
					b.Fatal(err)
				}
				for _, it := range items {
					if obs, err := st.Observe(it.Token); err != nil || obs.Size != int64(len(data)) {
						b.Fatal(obs, err)
					}
				}
			}
			b.ReportMetric(float64(processCPU(b)-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// processCPU is the process's user + system CPU time so far, in ns.
func processCPU(b *testing.B) int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// On Linux the store writes unnamed temporary files (O_TMPFILE) where the
// filesystem supports them, as ext4, xfs, btrfs and tmpfs do; elsewhere
// it falls back to named ones (TestNamedTemporaryFiles).
func TestPutUsesUnnamedTemporaryFiles(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if !artifact.UnnamedTemporaryFiles(b.store) {
		if runtime.GOOS == "linux" {
			t.Skipf("the filesystem of %s does not support O_TMPFILE: Puts use named temporary files", b.store.Root())
		}
		t.Skip("O_TMPFILE is Linux only: Puts use named temporary files")
	}
	// The probe of Open left nothing either.
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp after Open = %v, want empty", got)
	}
	putManyWithConflictsLeavesNothing(t, b.store)
}

// The fallback with named temporary files (tmp/put-*) has the same answers
// and leaves no file behind either.
func TestNamedTemporaryFiles(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	artifact.NamedTemporaryFiles(b.store)
	putManyWithConflictsLeavesNothing(t, b.store)
}

// putManyWithConflictsLeavesNothing puts new objects, an object again, a
// conflicting one and concurrent Puts of one token, then checks the
// answers, the objects' contents and that tmp/ is empty.
func putManyWithConflictsLeavesNothing(t *testing.T, st *artifact.Store) {
	t.Helper()
	data := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i%26)}, 100+i) }
	items := make([]artifact.Item, 8)
	for i := range items {
		items[i] = artifact.Item{Token: fmt.Sprintf("tok-%d", i), TaskID: "task", Attempt: 1, Data: data(i)}
	}
	mustPutMany(t, st, items)
	// Again, then with other content: found and conflicting.
	again := append(slices.Clone(items[:2]), artifact.Item{Token: "tok-2", TaskID: "task", Attempt: 1, Data: []byte("other")})
	_, errs := st.PutManyUnsynced(again)
	if errs[0] != nil || errs[1] != nil || !errors.Is(errs[2], artifact.ErrTokenConflict) {
		t.Errorf("second PutManyUnsynced errors = %v, want nil, nil, ErrTokenConflict", errs)
	}
	var wg sync.WaitGroup
	start := make(chan struct{})
	putErrs := make([]error, 8)
	for i := range putErrs {
		wg.Go(func() {
			<-start
			_, putErrs[i] = st.Put("tok-race", "task", 1, data(i%2))
		})
	}
	close(start)
	wg.Wait()
	h, err := st.Head("tok-race")
	if err != nil {
		t.Fatal(err)
	}
	for i, err := range putErrs {
		if wins := sha(data(i%2)) == h.SHA256; wins != (err == nil) || (!wins && !errors.Is(err, artifact.ErrTokenConflict)) {
			t.Errorf("concurrent Put %d: err = %v (committed content is its own: %v)", i, err, wins)
		}
	}
	if err := st.SyncObjects(); err != nil {
		t.Fatal(err)
	}
	for i, it := range items {
		if obs, err := st.Observe(it.Token); err != nil || obs.SHA256 != sha(data(i)) {
			t.Errorf("Observe(%s) = %+v, %v; want the bytes put", it.Token, obs, err)
		}
	}
	if got := dirNames(t, st, "tmp"); len(got) != 0 {
		t.Errorf("tmp has leftovers: %v", got)
	}
	if got := len(dirNames(t, st, "objects")); got != len(items)+1 {
		t.Errorf("objects has %d files, want %d", got, len(items)+1)
	}
}

// crashChildEnv names the store root of TestCrashedPutsLeaveNothingBehind's
// child process, which puts objects until it is killed.
const crashChildEnv = "CONVERGE_ARTIFACT_CRASH_ROOT"

// crashObjectSize is the size of the child's objects.
const crashObjectSize = 64 << 10

// A process killed with SIGKILL in the middle of its Puts leaves no
// temporary file behind (the files are unnamed) and only complete
// objects: the child process puts runs of 16 objects of 64 KiB in a loop
// and is killed three times while it does. (With named temporary files
// the test fails in most runs: a kill between a file's creation and its
// removal leaves it.)
func TestCrashedPutsLeaveNothingBehind(t *testing.T) {
	if root := os.Getenv(crashChildEnv); root != "" {
		st, err := artifact.Open(root, nil)
		if err != nil {
			t.Fatal(err)
		}
		// Bounded, in case the parent is gone without killing it: 2,048
		// objects of 64 KiB at most, and none once the parent has exited.
		data := bytes.Repeat([]byte("z"), crashObjectSize)
		parent := os.Getppid()
		for n := 0; n < 2048 && os.Getppid() == parent; n += 16 {
			items := make([]artifact.Item, 16)
			for i := range items {
				items[i] = artifact.Item{Token: fmt.Sprintf("crash-%d-%d", os.Getpid(), n+i), TaskID: "task", Attempt: 1, Data: data}
			}
			st.PutManyUnsynced(items)
		}
		return
	}
	t.Parallel()
	b := setup(t, nil)
	if !artifact.UnnamedTemporaryFiles(b.store) {
		t.Skip("unnamed temporary files are not supported here: a crashed Put leaves its tmp/put-* file to RemoveLeftovers")
	}
	for round := range 3 {
		before := len(dirNames(t, b.store, "objects"))
		cmd := exec.Command(os.Args[0], "-test.run=^TestCrashedPutsLeaveNothingBehind$")
		cmd.Env = append(os.Environ(), crashChildEnv+"="+b.store.Root())
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Killed below; this only matters when the test stops before.
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		deadline := time.Now().Add(30 * time.Second)
		for len(dirNames(t, b.store, "objects")) < before+40 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
			t.Errorf("round %d: tmp after SIGKILL = %v, want empty", round, got)
		}
		objects := dirNames(t, b.store, "objects")
		if len(objects) < before+40 {
			t.Fatalf("round %d: the child put %d objects in 30 s", round, len(objects)-before)
		}
		for _, name := range objects {
			token := strings.TrimSuffix(name, ".obj")
			if obs, err := b.store.Observe(token); err != nil || obs.SHA256 != obs.Meta.SHA256 || obs.Size != crashObjectSize {
				t.Errorf("round %d: object %s after SIGKILL: %+v, %v; want complete", round, token, obs, err)
			}
		}
	}
}

// A process killed inside Open's probe leaves its probe name in tmp/; the
// next Open removes it.
func TestOpenRemovesCrashedProbeNames(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if !artifact.UnnamedTemporaryFiles(b.store) {
		t.Skip("unnamed temporary files are not supported here: Open does not probe")
	}
	left := filepath.Join(b.store.Root(), "tmp", "put-probe-12345-abc")
	if err := os.WriteFile(left, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := artifact.Open(b.store.Root(), nil); err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, b.store, "tmp"); len(got) != 0 {
		t.Errorf("tmp after Open = %v, want empty", got)
	}
}

// TestOneObjectFiles: after WriteOneObjectFiles, PutManyUnsynced writes one
// file per object in the format of the releases before packs (the Meta's
// JSON line, then the bytes: what they read), and the store reads them.
func TestOneObjectFiles(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.store.WriteOneObjectFiles()
	if b.store.WritesPacks() {
		t.Fatal("WritesPacks after WriteOneObjectFiles")
	}
	items := []artifact.Item{
		{Token: "tok-a", TaskID: "a", Attempt: 1, Data: []byte("first")},
		{Token: "tok-b", TaskID: "b", Attempt: 2, Data: bytes.Repeat([]byte("b"), 100<<10)},
	}
	metas := mustPutMany(t, b.store, items)
	var infos []os.FileInfo
	for i, it := range items {
		p := filepath.Join(b.store.Root(), "objects", it.Token+".obj")
		raw, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		line, rest, _ := bytes.Cut(raw, []byte("\n"))
		var m artifact.Meta
		if err := json.Unmarshal(line, &m); err != nil || !m.CreatedAt.Equal(metas[i].CreatedAt) || !bytes.Equal(rest, it.Data) {
			t.Errorf("%s: header %q (%v), %d bytes after it; want the Meta and the object's bytes", it.Token, line, err, len(rest))
		}
		if bytes.Contains(line, []byte(`"stored"`)) {
			t.Errorf("%s: header %q has a record's stored length", it.Token, line)
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		infos = append(infos, fi)
		if obs, err := b.store.Observe(it.Token); err != nil || obs.SHA256 != sha(it.Data) {
			t.Errorf("%s: Observe = %+v, %v", it.Token, obs, err)
		}
	}
	if os.SameFile(infos[0], infos[1]) {
		t.Error("two objects in one file")
	}
	if !setup(t, nil).store.WritesPacks() {
		t.Error("a store writes packs unless told otherwise")
	}
}

// TestPutManyWritesOneRecordPerToken: items of one call that repeat a token
// are answered as concurrent Puts of it (the same content: the first's
// Meta; other content: ErrTokenConflict) and add no record to the pack, so
// the record a reader finds under a name is always the one committed.
func TestPutManyWritesOneRecordPerToken(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	items := []artifact.Item{
		{Token: "tok-d", TaskID: "d", Attempt: 1, Data: []byte("first")},
		{Token: "tok-e", TaskID: "e", Attempt: 1, Data: []byte("other")},
		{Token: "tok-d", TaskID: "d", Attempt: 1, Data: []byte("first")},
		{Token: "tok-d", TaskID: "d", Attempt: 1, Data: []byte("changed")},
	}
	metas, errs := b.store.PutManyUnsynced(items)
	if errs[0] != nil || errs[1] != nil || errs[2] != nil || !errors.Is(errs[3], artifact.ErrTokenConflict) {
		t.Fatalf("errors %v; want nil, nil, nil, ErrTokenConflict", errs)
	}
	if metas[2] != metas[0] || metas[3] != metas[0] {
		t.Errorf("repeated token answered %+v, %+v; want the first's %+v", metas[2], metas[3], metas[0])
	}
	raw, err := os.ReadFile(filepath.Join(b.store.Root(), "objects", "tok-d.obj"))
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(raw, []byte(`"token":"tok-d"`)); n != 1 {
		t.Errorf("%d records of tok-d in the pack, want 1", n)
	}
	if obs, err := b.store.Observe("tok-d"); err != nil || obs.SHA256 != sha([]byte("first")) {
		t.Errorf("Observe = %+v, %v", obs, err)
	}
}

// TestDeleteErasesItsRecord: deleting an object of a pack whose other
// objects are kept overwrites its record, so neither its bytes nor its
// Meta nor its token (which names the task) stay on disk with them; the
// others still read back. A name whose record was erased but not yet
// removed (a crash inside Delete) reads as a mismatch, never as the old
// bytes, and Delete again finishes.
func TestDeleteErasesItsRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	items := []artifact.Item{
		firstAttempt("task-keep-a", []byte("kept bytes of a")),
		firstAttempt("task-secret-b", bytes.Repeat([]byte("secret-b "), 10000)),
		firstAttempt("task-secret-c", []byte("secret bytes of c")),
		firstAttempt("task-keep-d", []byte("kept bytes of d")),
	}
	mustPutMany(t, b.store, items)
	pack := filepath.Join(b.store.Root(), "objects", items[0].Token+".obj")
	before, err := os.Stat(pack)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.store.Hide(items[1].Token); err != nil {
		t.Fatal(err)
	}
	if err := b.store.Delete(items[1].Token); err != nil {
		t.Fatal(err)
	}
	if err := artifact.Erase(b.store, items[2].Token); err != nil {
		t.Fatal(err)
	}
	if obs, err := b.store.Observe(items[2].Token); err == nil && (obs.SHA256 == sha(items[2].Data) || obs.Meta.SHA256 != "") {
		t.Errorf("an erased record reads as %+v; want no Meta and other bytes", obs)
	}
	if err := b.store.Delete(items[2].Token); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(pack)
	if err != nil {
		t.Fatal(err)
	}
	if i := bytes.Index(raw, []byte("secret")); i >= 0 {
		t.Errorf("the pack still holds %q after its objects were deleted", raw[max(0, i-30):min(len(raw), i+30)])
	}
	if int64(len(raw)) != before.Size() {
		t.Errorf("pack size %d, want %d (records erased in place)", len(raw), before.Size())
	}
	for _, it := range []artifact.Item{items[0], items[3]} {
		if obs, err := b.store.Observe(it.Token); err != nil || obs.SHA256 != sha(it.Data) || obs.Meta.TaskID != it.TaskID {
			t.Errorf("%s after its neighbours' deletion: %+v, %v", it.Token, obs, err)
		}
	}
	for _, it := range items[1:3] {
		if gone, err := b.store.Gone(it.Token); !gone || err != nil {
			t.Errorf("Gone(%s) = %v, %v", it.Token, gone, err)
		}
	}
}

// TestDeleteOfADamagedPackFails: when the record cannot be found in the
// pack its name links (an earlier record's length damaged), Delete fails,
// every time, and keeps the name: a deletion it reports never left the
// bytes behind.
func TestDeleteOfADamagedPackFails(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	items := []artifact.Item{
		{Token: "tok-first", TaskID: "a", Attempt: 1, Data: []byte("first")},
		{Token: "tok-second", TaskID: "b", Attempt: 1, Data: []byte("second")},
	}
	mustPutMany(t, b.store, items)
	p := filepath.Join(b.store.Root(), "objects", "tok-second.obj")
	raw, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	raw = bytes.Replace(raw, []byte(`{"stored":5,`), []byte(`{"stored":9,`), 1)
	if err := os.WriteFile(p, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := b.store.Delete("tok-second"); err == nil {
			t.Fatal("Delete of an object whose record cannot be found succeeded")
		}
	}
	if gone, err := b.store.Gone("tok-second"); gone || err != nil {
		t.Errorf("Gone = %v, %v; want the name kept", gone, err)
	}
}

// TestUnlinkedRecordsAreErased: when another Put of a token commits between
// this Put's check and its link, this Put's record of the token stays in a
// pack that lives on under its neighbours' names; it is erased at once, so
// that deleting the token later (which reaches only the winner's record)
// leaves nothing of it.
func TestUnlinkedRecordsAreErased(t *testing.T) {
	t.Parallel()
	for _, named := range []bool{false, true} {
		t.Run(fmt.Sprint("named=", named), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			if named {
				artifact.NamedTemporaryFiles(b.store)
			}
			x := artifact.Item{Token: artifact.Token("task-secret-x", 1), TaskID: "task-secret-x", Attempt: 1, Data: []byte("secret bytes of x")}
			n := artifact.Item{Token: artifact.Token("task-keep-n", 1), TaskID: "task-keep-n", Attempt: 1, Data: []byte("kept bytes of n")}
			artifact.BeforeWrite(b.store, func() {
				artifact.BeforeWrite(b.store, nil)
				if _, err := b.store.Put(x.Token, x.TaskID, x.Attempt, x.Data); err != nil {
					t.Error(err)
				}
			})
			metas, errs := b.store.PutManyUnsynced([]artifact.Item{x, n})
			if errs[0] != nil || errs[1] != nil || metas[0].SHA256 != sha(x.Data) {
				t.Fatalf("PutManyUnsynced: %v, %+v", errs, metas)
			}
			if err := b.store.Delete(x.Token); err != nil {
				t.Fatal(err)
			}
			raw, err := os.ReadFile(filepath.Join(b.store.Root(), "objects", n.Token+".obj"))
			if err != nil {
				t.Fatal(err)
			}
			if i := bytes.Index(raw, []byte("secret")); i >= 0 {
				t.Errorf("the neighbour's pack holds %q", raw[max(0, i-30):min(len(raw), i+30)])
			}
			if obs, err := b.store.Observe(n.Token); err != nil || obs.SHA256 != sha(n.Data) {
				t.Errorf("neighbour: %+v, %v", obs, err)
			}
		})
	}
}

// TestConcurrentDeleteOfOneToken: a Delete that opened the name before a
// concurrent Delete of the token removed it (and then its token) finds
// nothing to erase and reports no damage.
func TestConcurrentDeleteOfOneToken(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	items := []artifact.Item{
		{Token: "tok-del", TaskID: "a", Attempt: 1, Data: []byte("deleted")},
		{Token: "tok-kept", TaskID: "b", Attempt: 1, Data: []byte("kept")},
	}
	mustPutMany(t, b.store, items)
	f, err := os.OpenFile(filepath.Join(b.store.Root(), "objects", "tok-del.obj"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := b.store.Delete("tok-del"); err != nil {
		t.Fatal(err)
	}
	if err := artifact.EraseOpened(b.store, f, "tok-del"); err != nil {
		t.Errorf("the second Delete's erasure: %v, want nothing to do", err)
	}
}

// DeleteMany deletes each of its tokens as Delete does, with the fsyncs
// shared: records in one pack (one readable, one hidden) and in another,
// an absent token (done already) and an invalid one (its own error, the
// others go on). The deleted records' bytes and tokens are gone from the
// packs, their neighbours read as before.
func TestDeleteManyDeletesEachAsDeleteDoes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	first := []artifact.Item{
		firstAttempt("task-keep-a", []byte("kept bytes of a")),
		firstAttempt("task-secret-b", []byte("secret bytes of b")),
		firstAttempt("task-secret-c", []byte("secret bytes of c")),
	}
	second := []artifact.Item{
		firstAttempt("task-secret-d", []byte("secret bytes of d")),
		firstAttempt("task-keep-e", []byte("kept bytes of e")),
	}
	mustPutMany(t, b.store, first)
	mustPutMany(t, b.store, second)
	if err := b.store.Hide(first[2].Token); err != nil {
		t.Fatal(err)
	}
	tokens := []string{first[1].Token, "not a token", first[2].Token, second[0].Token, artifact.Token("task-never-put", 1)}
	errs := b.store.DeleteMany(tokens)
	for i, err := range errs {
		if want := tokens[i] == "not a token"; (err != nil) != want || (want && !errors.Is(err, artifact.ErrInvalidToken)) {
			t.Errorf("DeleteMany %q: %v", tokens[i], err)
		}
	}
	for _, it := range []artifact.Item{first[1], first[2], second[0]} {
		if gone, err := b.store.Gone(it.Token); !gone || err != nil {
			t.Errorf("Gone(%s) = %v, %v", it.Token, gone, err)
		}
	}
	for _, it := range []artifact.Item{first[0], second[1]} {
		if obs, err := b.store.Observe(it.Token); err != nil || obs.SHA256 != sha(it.Data) || obs.Meta.TaskID != it.TaskID {
			t.Errorf("%s after its neighbours' deletion: %+v, %v", it.Token, obs, err)
		}
		raw, err := os.ReadFile(filepath.Join(b.store.Root(), "objects", it.Token+".obj"))
		if err != nil {
			t.Fatal(err)
		}
		if i := bytes.Index(raw, []byte("secret")); i >= 0 {
			t.Errorf("the pack of %s still holds %q", it.Token, raw[max(0, i-30):min(len(raw), i+30)])
		}
		if bytes.Contains(raw, []byte("task-secret")) {
			t.Errorf("the pack of %s still holds a deleted record's token", it.Token)
		}
	}
	if errs := b.store.DeleteMany(tokens[2:]); errs[0] != nil || errs[1] != nil || errs[2] != nil {
		t.Errorf("DeleteMany again: %v, want nothing left to do", errs)
	}
}
