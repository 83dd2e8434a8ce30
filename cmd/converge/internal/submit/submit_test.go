package submit_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/internal/taskevent"
)

// apiKeyRE is the API's Idempotency-Key rule (services/api/request.go).
var apiKeyRE = regexp.MustCompile(`^[A-Za-z0-9_.:-]{6,255}$`)

func TestKeyFor(t *testing.T) {
	t.Parallel()
	docs := [][]byte{
		nil,
		[]byte(`{}`),
		[]byte(`{"a":1}`),
		[]byte(`{"a": 1}`), // same value, different bytes: a different key
		[]byte(`{"a":2}`),
		bytes.Repeat([]byte("x"), 1<<20),
	}
	seen := map[string]int{}
	for i, d := range docs {
		k := submit.KeyFor(d)
		if !apiKeyRE.MatchString(k) {
			t.Errorf("KeyFor(doc %d) = %q does not match the API's key rule", i, k)
		}
		if k2 := submit.KeyFor(bytes.Clone(d)); k2 != k {
			t.Errorf("KeyFor(doc %d) unstable: %q then %q", i, k, k2)
		}
		sum := sha256.Sum256(d)
		if want := "doc-" + hex.EncodeToString(sum[:])[:48]; k != want {
			t.Errorf("KeyFor(doc %d) = %q, want %q", i, k, want)
		}
		if j, dup := seen[k]; dup {
			t.Errorf("docs %d and %d share key %q", j, i, k)
		}
		seen[k] = i
	}
	// A pinned value: the key must never change across releases, or
	// resubmitting the same files would create new tasks.
	if got, want := submit.KeyFor([]byte(`{}`)), "doc-44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e83"; got != want {
		t.Errorf("KeyFor({}) = %q, want %q", got, want)
	}
}

// writeTree creates files (relative path → content) under a new temp dir and
// returns the dir.
func writeTree(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for rel, content := range files {
		p := filepath.Join(root, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestFiles(t *testing.T) {
	t.Parallel()
	root := writeTree(t, map[string]string{
		"b.json":                "{}",
		"a.json":                "{}",
		"notes.txt":             "x",
		"upper.JSON":            "{}",
		"json":                  "{}",
		"sub/c.json":            "{}",
		"sub/deeper/d.json":     "{}",
		"sub/deeper/e.json.bak": "{}",
		"dir.json/f.txt":        "x", // a directory named *.json is walked, not taken
		"dir.json/g.json":       "{}",
		"empty/.keep":           "",
	})
	other := writeTree(t, map[string]string{"doc.txt": "{}", "z.json": "{}"})
	j := func(parts ...string) string { return filepath.Join(append([]string{root}, parts...)...) }

	tests := []struct {
		name  string
		paths []string
		want  []string
	}{
		{"directory: recursive, sorted, *.json only", []string{root},
			[]string{j("a.json"), j("b.json"), j("dir.json", "g.json"), j("sub", "c.json"), j("sub", "deeper", "d.json")}},
		{"explicit files of any extension", []string{j("notes.txt"), filepath.Join(other, "doc.txt"), j("upper.JSON")},
			slices.Sorted(slices.Values([]string{j("notes.txt"), filepath.Join(other, "doc.txt"), j("upper.JSON")}))},
		{"duplicates removed", []string{j("sub"), j("sub", "c.json"), j("sub"), j("notes.txt"), j("notes.txt")},
			[]string{j("notes.txt"), j("sub", "c.json"), j("sub", "deeper", "d.json")}},
		{"same file spelled differently", []string{j("sub"), root + "/sub/./c.json", j("sub") + "/"},
			[]string{j("sub", "c.json"), j("sub", "deeper", "d.json")}},
		{"several roots", []string{other, j("sub", "deeper")},
			slices.Sorted(slices.Values([]string{filepath.Join(other, "z.json"), j("sub", "deeper", "d.json")}))},
		{"directory without json", []string{j("empty")}, nil},
		{"nothing", nil, nil},
	}
	for _, tt := range tests {
		got, err := submit.Files(tt.paths)
		if err != nil {
			t.Errorf("%s: Files: %v", tt.name, err)
			continue
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: Files(%v)\n = %v\nwant %v", tt.name, tt.paths, got, tt.want)
		}
	}

	if _, err := submit.Files([]string{root, j("missing.json")}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing path: err = %v, want fs.ErrNotExist", err)
	}
	if _, err := submit.Files([]string{""}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("empty path: err = %v, want fs.ErrNotExist (not the current directory)", err)
	}
}

func TestLine(t *testing.T) {
	t.Parallel()
	sha := strings.Repeat("a1", 32)
	id := "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	tests := []struct {
		name string
		r    submit.Result
		want string
	}{
		{"completed",
			submit.Result{Path: "docs/a.json", TaskID: id, Status: "completed", ArtifactSHA256: sha, Latency: 1234567 * time.Microsecond},
			"completed " + id + " " + sha + "   1.235s  docs/a.json"},
		{"failed",
			submit.Result{Path: "b.json", TaskID: "t-1", Status: "failed", ErrorCode: "NUMBER_PRECISION_LOSS", Latency: 42 * time.Millisecond},
			fmt.Sprintf("%-9s %-36s %-64s %8s  %s", "failed", "t-1", "NUMBER_PRECISION_LOSS", "42ms", "b.json")},
		{"rejected",
			submit.Result{Path: "c.json", Status: "rejected", ErrorCode: "DUPLICATE_MEMBER_NAME", HTTPStatus: 422},
			fmt.Sprintf("%-9s %-36s %-64s %8s  %s", "rejected", "-", "DUPLICATE_MEMBER_NAME", "-", "c.json")},
		{"error",
			submit.Result{Path: "d.json", Status: "error", Err: errors.New("connection refused")},
			fmt.Sprintf("%-9s %-36s %-64s %8s  %s", "error", "-", "connection refused", "-", "d.json")},
		{"error code wins over error",
			submit.Result{Path: "e.json", Status: "timeout", TaskID: "t-2", ErrorCode: "X", Err: errors.New("deadline")},
			fmt.Sprintf("%-9s %-36s %-64s %8s  %s", "timeout", "t-2", "X", "-", "e.json")},
		{"sub-millisecond latency rounds",
			submit.Result{Path: "f.json", TaskID: "t-3", Status: "completed", ArtifactSHA256: sha, Latency: 400 * time.Microsecond},
			fmt.Sprintf("%-9s %-36s %-64s %8s  %s", "completed", "t-3", sha, "0s", "f.json")},
	}
	for _, tt := range tests {
		if got := submit.Line(tt.r); got != tt.want {
			t.Errorf("%s:\n got %q\nwant %q", tt.name, got, tt.want)
		}
		if strings.Contains(submit.Line(tt.r), "\n") {
			t.Errorf("%s: line has a newline", tt.name)
		}
	}
}

// fakeAPI imitates the parts of converge's API that the client uses:
//
//   - POST /v1/tasks: 202 {"task_id","status":"queued"} for a new key, the
//     same response with Idempotent-Replayed: true for a known key, 422
//     problem+json for a document {"reject": "<CODE>"}, 400 for a missing or
//     malformed Idempotency-Key;
//   - GET /v1/tasks/{id}: queued for the first pollsBefore reads, then the
//     terminal status (failed for a document {"fail": "<CODE>"}).
type fakeAPI struct {
	t           *testing.T
	pollsBefore int // GETs answered "queued" before the task is terminal
	stuck       bool

	mu      sync.Mutex
	byKey   map[string][]byte // key → stored 202 body
	tasks   map[string]*fakeTask
	creates int
	gets    int
}

type fakeTask struct {
	id       string
	failCode string
	gets     int
	created  time.Time
}

func newFakeAPI(t *testing.T) (*fakeAPI, *submit.Client) {
	t.Helper()
	f := &fakeAPI{t: t, pollsBefore: 1, byKey: map[string][]byte{}, tasks: map[string]*fakeTask{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/tasks", f.create)
	mux.HandleFunc("GET /v1/tasks/{id}", f.get)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return f, &submit.Client{BaseURL: srv.URL, HTTP: srv.Client(), PollInterval: time.Millisecond}
}

func problem(w http.ResponseWriter, status int, code string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"type":"https://converge.dev/problems/x","title":"t","status":%d,"detail":"d","code":%q}`, status, code)
}

func (f *fakeAPI) create(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if !apiKeyRE.MatchString(key) || r.Header.Get("Content-Type") != "application/json" {
		problem(w, http.StatusBadRequest, "INVALID_IDEMPOTENCY_KEY")
		return
	}
	var body struct {
		OutputFormat string          `json:"output_format"`
		Document     json.RawMessage `json:"document"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.OutputFormat != "jcs" {
		problem(w, http.StatusBadRequest, "MALFORMED_JSON")
		return
	}
	var doc struct {
		Reject string `json:"reject"`
		Fail   string `json:"fail"`
	}
	_ = json.Unmarshal(body.Document, &doc)
	if doc.Reject != "" {
		problem(w, http.StatusUnprocessableEntity, doc.Reject)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.creates++
	w.Header().Set("Content-Type", "application/json")
	if stored, ok := f.byKey[key]; ok {
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(http.StatusAccepted)
		w.Write(stored)
		return
	}
	id := fmt.Sprintf("task-%03d", len(f.tasks)+1)
	f.tasks[id] = &fakeTask{id: id, failCode: doc.Fail, created: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	resp := fmt.Appendf(nil, `{"status":"queued","task_id":%q}`, id)
	f.byKey[key] = resp
	w.WriteHeader(http.StatusAccepted)
	w.Write(resp)
}

func (f *fakeAPI) get(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.gets++
	task := f.tasks[r.PathValue("id")]
	var out taskevent.Task
	if task != nil {
		task.gets++
		out = taskevent.Task{TaskID: task.id, Status: taskevent.StatusQueued, OutputFormat: "jcs", CreatedAt: task.created, UpdatedAt: task.created}
		if !f.stuck && task.gets > f.pollsBefore {
			done := task.created.Add(1500 * time.Millisecond)
			out.Version, out.UpdatedAt, out.CompletedAt = 2, done, &done
			if task.failCode != "" {
				out.Status, out.TerminalErrorCode = taskevent.StatusFailed, &task.failCode
			} else {
				sum := strings.Repeat("c0", 32)
				out.Status, out.ArtifactSHA256 = taskevent.StatusCompleted, &sum
			}
		}
	}
	f.mu.Unlock()
	if task == nil {
		problem(w, http.StatusNotFound, "TASK_NOT_FOUND")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

func TestCreate(t *testing.T) {
	t.Parallel()
	f, c := newFakeAPI(t)
	ctx := t.Context()
	doc := []byte(`{"hello":"world"}`)
	key := submit.KeyFor(doc)

	first, err := c.Create(ctx, key, doc)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	want := submit.Result{Key: key, HTTPStatus: http.StatusAccepted, TaskID: "task-001", Status: "queued"}
	if first != want {
		t.Errorf("Create = %+v, want %+v", first, want)
	}

	again, err := c.Create(ctx, key, doc)
	if err != nil {
		t.Fatalf("replayed Create: %v", err)
	}
	want.Replayed = true
	if again != want {
		t.Errorf("replayed Create = %+v, want %+v", again, want)
	}
	if len(f.tasks) != 1 {
		t.Errorf("%d tasks created, want 1", len(f.tasks))
	}
}

func TestCreateRejected(t *testing.T) {
	t.Parallel()
	_, c := newFakeAPI(t)
	doc := []byte(`{"reject":"DUPLICATE_MEMBER_NAME"}`)
	r, err := c.Create(t.Context(), submit.KeyFor(doc), doc)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if r.Status != "rejected" || r.ErrorCode != "DUPLICATE_MEMBER_NAME" || r.HTTPStatus != 422 || r.TaskID != "" {
		t.Errorf("Create = %+v", r)
	}
	// The client's keys pass the API's rule; a bad key is the API's 400.
	r, err = c.Create(t.Context(), "short", doc)
	if err != nil || r.Status != "rejected" || r.ErrorCode != "INVALID_IDEMPOTENCY_KEY" || r.HTTPStatus != 400 {
		t.Errorf("Create with a bad key = %+v, %v", r, err)
	}
}

// stubClient is a Client for a server that answers every request with h.
func stubClient(t *testing.T, h http.HandlerFunc) *submit.Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &submit.Client{BaseURL: srv.URL, HTTP: srv.Client(), PollInterval: time.Millisecond}
}

func TestCreateOddResponses(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		status   int
		body     string
		wantErr  bool
		wantCode string
	}{
		{"5xx without problem", http.StatusServiceUnavailable, "upstream down", false, "HTTP_503"},
		{"problem without code", http.StatusConflict, `{"title":"x"}`, false, "HTTP_409"},
		{"redirect", http.StatusNotModified, "", false, "HTTP_304"},
		{"202 without task id", http.StatusAccepted, `{"status":"queued"}`, true, ""},
		{"202 not JSON", http.StatusAccepted, `<html>`, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := stubClient(t, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(tt.status)
				io.WriteString(w, tt.body)
			})
			r, err := c.Create(t.Context(), "doc-123456", []byte(`{}`))
			if (err != nil) != tt.wantErr {
				t.Fatalf("Create: err = %v, wantErr %v", err, tt.wantErr)
			}
			if r.HTTPStatus != tt.status {
				t.Errorf("HTTPStatus = %d, want %d", r.HTTPStatus, tt.status)
			}
			if !tt.wantErr && (r.Status != "rejected" || r.ErrorCode != tt.wantCode) {
				t.Errorf("Create = %+v, want rejected %s", r, tt.wantCode)
			}
		})
	}
}

func TestCreateSendsDocument(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var gotBody []byte
	var gotHeader http.Header
	c := stubClient(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		gotBody, gotHeader = b, r.Header.Clone()
		mu.Unlock()
		if r.Method != http.MethodPost || r.URL.Path != "/v1/tasks" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, `{"task_id":"t","status":"queued"}`)
	})
	doc := []byte(" {\"b\": [1, 2],\n \"a\": \"\u00e9\"}\n")
	if _, err := c.Create(t.Context(), "doc-abcdef", doc); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	var env struct {
		OutputFormat string          `json:"output_format"`
		Document     json.RawMessage `json:"document"`
	}
	if err := json.Unmarshal(gotBody, &env); err != nil {
		t.Fatalf("body %q is not JSON: %v", gotBody, err)
	}
	if env.OutputFormat != "jcs" || !bytes.Equal(bytes.TrimSpace(env.Document), bytes.TrimSpace(doc)) {
		t.Errorf("body = %s", gotBody)
	}
	if gotHeader.Get("Idempotency-Key") != "doc-abcdef" || gotHeader.Get("Content-Type") != "application/json" {
		t.Errorf("headers = %v", gotHeader)
	}
}

func TestCreateTransportError(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	c := &submit.Client{BaseURL: srv.URL}
	if _, err := c.Create(t.Context(), "doc-123456", []byte(`{}`)); err == nil {
		t.Error("Create against a closed server: want error")
	}
}

func TestGet(t *testing.T) {
	t.Parallel()
	_, c := newFakeAPI(t)
	doc := []byte(`{"x":1}`)
	r, err := c.Create(t.Context(), submit.KeyFor(doc), doc)
	if err != nil {
		t.Fatal(err)
	}
	task, err := c.Get(t.Context(), r.TaskID)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if task.TaskID != r.TaskID || task.Status != taskevent.StatusQueued {
		t.Errorf("Get = %+v", task)
	}
	_, err = c.Get(t.Context(), "task-999")
	if err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("Get of unknown task: err = %v, want a 404 error", err)
	}
}

func TestWait(t *testing.T) {
	t.Parallel()
	f, c := newFakeAPI(t)
	f.pollsBefore = 3
	doc := []byte(`{"x":1}`)
	r, err := c.Create(t.Context(), submit.KeyFor(doc), doc)
	if err != nil {
		t.Fatal(err)
	}
	task, err := c.Wait(t.Context(), r.TaskID)
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if task.Status != taskevent.StatusCompleted || task.ArtifactSHA256 == nil {
		t.Errorf("Wait = %+v", task)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gets != 4 {
		t.Errorf("%d GETs, want 4 (3 queued + 1 completed)", f.gets)
	}
}

// cancelAfter is a RoundTripper that cancels a context once the nth
// response has been fully read, so that Wait sees its context end between
// two polls, deterministically.
type cancelAfter struct {
	base   http.RoundTripper
	n      int
	cancel context.CancelFunc

	mu    sync.Mutex
	count int
}

func (c *cancelAfter) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(b))
	c.mu.Lock()
	c.count++
	if c.count == c.n {
		c.cancel()
	}
	c.mu.Unlock()
	return resp, nil
}

func TestWaitEndsWithContext(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		taskID func(ctx context.Context, c *submit.Client) string
		want   string
	}{
		{"task stays queued", func(ctx context.Context, c *submit.Client) string {
			doc := []byte(`{"x":1}`)
			r, err := c.Create(ctx, submit.KeyFor(doc), doc)
			if err != nil {
				t.Error(err)
			}
			return r.TaskID
		}, "still queued"},
		{"task never found", func(context.Context, *submit.Client) string { return "task-404" }, "404"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f, c := newFakeAPI(t)
			f.stuck = true
			id := tt.taskID(t.Context(), c)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			c.HTTP = &http.Client{Transport: &cancelAfter{base: c.HTTP.Transport, n: 3, cancel: cancel}}
			_, err := c.Wait(ctx, id)
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Wait: err = %v, want context.Canceled", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not say %q", err, tt.want)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.gets != 3 {
				t.Errorf("%d GETs, want 3", f.gets)
			}
		})
	}
}

func TestDocument(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{
		"ok.json":     `{"ok":true}`,
		"fail.json":   `{"fail":"NESTING_TOO_DEEP"}`,
		"reject.json": `{"reject":"LONE_SURROGATE"}`,
	})
	_, c := newFakeAPI(t)
	ctx := t.Context()

	r := c.Document(ctx, filepath.Join(dir, "ok.json"), time.Minute)
	if r.Status != taskevent.StatusCompleted || r.ArtifactSHA256 != strings.Repeat("c0", 32) ||
		r.Latency != 1500*time.Millisecond || r.Path != filepath.Join(dir, "ok.json") ||
		r.Key != submit.KeyFor([]byte(`{"ok":true}`)) || r.Err != nil {
		t.Errorf("completed: %+v", r)
	}
	r = c.Document(ctx, filepath.Join(dir, "fail.json"), time.Minute)
	if r.Status != taskevent.StatusFailed || r.ErrorCode != "NESTING_TOO_DEEP" || r.ArtifactSHA256 != "" {
		t.Errorf("failed: %+v", r)
	}
	r = c.Document(ctx, filepath.Join(dir, "reject.json"), time.Minute)
	if r.Status != "rejected" || r.ErrorCode != "LONE_SURROGATE" || r.TaskID != "" {
		t.Errorf("rejected: %+v", r)
	}
	r = c.Document(ctx, filepath.Join(dir, "missing.json"), time.Minute)
	if r.Status != "error" || !errors.Is(r.Err, fs.ErrNotExist) {
		t.Errorf("missing file: %+v", r)
	}
}

func TestDocumentTimeout(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{"slow.json": `{"slow":true}`})
	f, c := newFakeAPI(t)
	f.stuck = true
	r := c.Document(t.Context(), filepath.Join(dir, "slow.json"), 20*time.Millisecond)
	if r.Status != "timeout" || !errors.Is(r.Err, context.DeadlineExceeded) || r.TaskID == "" {
		t.Errorf("Document = %+v, want a timeout with the task id", r)
	}
}

func TestRun(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{
		"a.json":     `{"n":1}`,
		"b.json":     `{"n":2}`,
		"c.json":     `{"fail":"NUMBER_OUT_OF_RANGE"}`,
		"d.json":     `{"reject":"DUPLICATE_MEMBER_NAME"}`,
		"sub/e.json": `{"n":5}`,
		"skip.txt":   `{"n":6}`,
	})
	f, c := newFakeAPI(t)
	f.pollsBefore = 2

	run := func() (submit.Summary, []string) {
		var out bytes.Buffer
		s, err := submit.Run(t.Context(), &out, c, []string{dir}, 2, time.Minute)
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
		return s, strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	}

	s, lines := run()
	want := submit.Summary{Documents: 5, Completed: 3, Failed: 1, Rejected: 1}
	if s != want {
		t.Errorf("Summary = %+v, want %+v", s, want)
	}
	if s.OK() {
		t.Error("OK() with a failed and a rejected document")
	}
	if len(lines) != 6 {
		t.Fatalf("%d lines, want 5 documents + summary:\n%s", len(lines), strings.Join(lines, "\n"))
	}
	order := []string{"a.json", "b.json", "c.json", "d.json", filepath.Join("sub", "e.json")}
	status := []string{"completed", "completed", "failed", "rejected", "completed"}
	for i, l := range lines[:5] {
		if !strings.HasSuffix(l, "  "+filepath.Join(dir, order[i])) || !strings.HasPrefix(l, status[i]+" ") {
			t.Errorf("line %d = %q, want %s of %s", i, l, status[i], order[i])
		}
	}
	wantSummary := "5 documents: 3 completed, 1 failed, 1 rejected, 0 errors; already submitted: 0 (replayed, no new task)"
	if lines[5] != wantSummary {
		t.Errorf("summary line = %q, want %q", lines[5], wantSummary)
	}

	// Same files again: no new task, every accepted document is a replay,
	// and the task ids are the same.
	s2, lines2 := run()
	want.Replayed = 4
	if s2 != want {
		t.Errorf("second Summary = %+v, want %+v", s2, want)
	}
	if len(lines2) != 6 {
		t.Fatalf("second run: %d lines", len(lines2))
	}
	for i := range 5 {
		if strings.Fields(lines2[i])[1] != strings.Fields(lines[i])[1] {
			t.Errorf("line %d: task id changed between runs:\n%s\n%s", i, lines[i], lines2[i])
		}
	}
	f.mu.Lock()
	if len(f.tasks) != 4 {
		t.Errorf("%d tasks, want 4", len(f.tasks))
	}
	f.mu.Unlock()
}

func TestRunAllCompleted(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{"x.json": `[1]`, "y.json": `[2]`, "z.json": `[3]`})
	_, c := newFakeAPI(t)
	var out bytes.Buffer
	s, err := submit.Run(t.Context(), &out, c, []string{dir, filepath.Join(dir, "x.json")}, 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if !s.OK() || s.Documents != 3 || s.Completed != 3 {
		t.Errorf("Summary = %+v", s)
	}
	if n := strings.Count(out.String(), "\n"); n != 4 {
		t.Errorf("%d lines, want 4:\n%s", n, out.String())
	}
}

func TestRunErrors(t *testing.T) {
	t.Parallel()
	_, c := newFakeAPI(t)
	empty := t.TempDir()
	var out bytes.Buffer
	if _, err := submit.Run(t.Context(), &out, c, []string{empty}, 1, time.Minute); err == nil || !strings.Contains(err.Error(), "no JSON files") {
		t.Errorf("Run on an empty dir: err = %v", err)
	}
	if _, err := submit.Run(t.Context(), &out, c, []string{filepath.Join(empty, "nope")}, 1, time.Minute); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Run on a missing path: err = %v", err)
	}
	if out.Len() != 0 {
		t.Errorf("output on error: %q", out.String())
	}

	// An unreachable API: every document is an error, counted as such.
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	dir := writeTree(t, map[string]string{"a.json": `{}`, "b.json": `{}`})
	s, err := submit.Run(t.Context(), &out, &submit.Client{BaseURL: srv.URL}, []string{dir}, 4, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if s != (submit.Summary{Documents: 2, Errors: 2}) || s.OK() {
		t.Errorf("Summary = %+v", s)
	}
}

func TestSummaryOK(t *testing.T) {
	t.Parallel()
	tests := []struct {
		s    submit.Summary
		want bool
	}{
		{submit.Summary{Documents: 2, Completed: 2}, true},
		{submit.Summary{Documents: 2, Completed: 2, Replayed: 2}, true},
		{submit.Summary{Documents: 2, Completed: 1, Failed: 1}, false},
		{submit.Summary{Documents: 1, Rejected: 1}, false},
		{submit.Summary{Documents: 1, Errors: 1}, false},
	}
	for _, tt := range tests {
		if got := tt.s.OK(); got != tt.want {
			t.Errorf("%+v.OK() = %v, want %v", tt.s, got, tt.want)
		}
	}
}
