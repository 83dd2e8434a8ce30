// Package artifact is converge's artifact store: a local directory in which
// every object is addressed by the idempotency token of the effect that
// writes it (seed section 7), with durable, atomic writes.
//
// Layout under the root directory:
//
//	objects/<token>.<sha256>.data  the artifact bytes, named by the SHA-256
//	                               the writer intended
//	objects/<token>.meta           JSON Meta: task id, attempt, size, sha256, time
//	hidden/<token>.*               objects hidden by a compensation (seed section 8)
//
// Put writes the data file, then the meta file, each as temp file + fsync and
// then a hard link to its final name that fails when the name exists (so
// nothing is ever overwritten), then fsyncs the directory. Linking the meta
// file is the commit point: an object without meta does not exist, and of two
// concurrent Puts of one token exactly one commits. Put with a token that is
// already committed with the same content returns the existing Meta and
// writes nothing (the store honours the idempotency token); with different
// content it returns ErrTokenConflict.
//
// Head and Get observe an object by token (the "HEAD artifact/effect-42" of
// seed section 7), which is how unknown outcomes are resolved.
package artifact

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"github.com/converge-run/converge/internal/fault"
)

// Meta is what the store records next to each object.
type Meta struct {
	Token     string    `json:"token"`
	TaskID    string    `json:"task_id"`
	Attempt   int       `json:"attempt"`
	Size      int64     `json:"size"`
	SHA256    string    `json:"sha256"`
	CreatedAt time.Time `json:"created_at"`
}

var (
	// ErrNotFound: no committed object has this token.
	ErrNotFound = errors.New("artifact not found")
	// ErrTokenConflict: the token is committed with different content.
	ErrTokenConflict = errors.New("artifact token already holds different content")
	// ErrTimeout: the store did not confirm the write in time; the outcome is
	// unknown and must be observed with Head (never assumed).
	ErrTimeout = errors.New("artifact store timeout: outcome unknown")
	// ErrInvalidToken: the token has characters a file name cannot hold.
	ErrInvalidToken = errors.New("invalid artifact token")
)

var tokenRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,179}$`)

// Store is a directory-backed artifact store. Its zero value is not usable;
// use Open.
type Store struct {
	root   string
	faults *fault.Set
}

// Open prepares root (creating it when missing) and returns a Store. faults
// may be nil.
func Open(root string, faults *fault.Set) (*Store, error) {
	for _, d := range []string{"objects", "hidden", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, fmt.Errorf("artifact store %s: %w", root, err)
		}
	}
	return &Store{root: root, faults: faults}, nil
}

// Root returns the store's directory.
func (s *Store) Root() string { return s.root }

func (s *Store) path(dir, token, ext string) string {
	return filepath.Join(s.root, dir, token+ext)
}

// Put stores data under token with the given task id and attempt, durably,
// and returns the committed Meta. See the package doc for idempotency.
// Fault points: artifact.corrupt-after-write (stored bytes altered),
// artifact.put-timeout-after-commit (ErrTimeout after the commit).
func (s *Store) Put(token, taskID string, attempt int, data []byte) (Meta, error) {
	if !tokenRE.MatchString(token) {
		return Meta{}, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	sum := sha256.Sum256(data)
	m := Meta{Token: token, TaskID: taskID, Attempt: attempt, Size: int64(len(data)), SHA256: hex.EncodeToString(sum[:]), CreatedAt: time.Now().UTC()}
	if old, err := s.Head(token); err == nil {
		if old.SHA256 == m.SHA256 && old.TaskID == taskID && old.Attempt == attempt {
			return old, nil
		}
		return old, fmt.Errorf("%w: %s", ErrTokenConflict, token)
	} else if !errors.Is(err, ErrNotFound) {
		return Meta{}, err
	}
	stored := data
	if s.faults.Hit(fault.ArtifactCorruptAfterWrite) == fault.ActionCorrupt {
		stored = append(append([]byte(nil), data...), "corrupted"...)
	}
	dataPath := s.dataPath(token, m.SHA256)
	if err := s.writeNew(dataPath, stored); err != nil && !errors.Is(err, os.ErrExist) {
		return Meta{}, err
	}
	mb, err := json.Marshal(m)
	if err != nil {
		return Meta{}, err
	}
	if err := s.writeNew(s.path("objects", token, ".meta"), mb); errors.Is(err, os.ErrExist) {
		// A concurrent Put committed first: its Meta decides.
		old, herr := s.Head(token)
		if herr != nil {
			return Meta{}, herr
		}
		if old.SHA256 == m.SHA256 && old.TaskID == taskID && old.Attempt == attempt {
			return old, nil
		}
		return old, fmt.Errorf("%w: %s", ErrTokenConflict, token)
	} else if err != nil {
		return Meta{}, err
	}
	if err := syncDir(filepath.Join(s.root, "objects")); err != nil {
		return Meta{}, err
	}
	if s.faults.Hit(fault.ArtifactPutTimeoutAfterCommit) != fault.ActionNone {
		return Meta{}, ErrTimeout
	}
	return m, nil
}

func (s *Store) dataPath(token, sha string) string {
	return filepath.Join(s.root, "objects", token+"."+sha+".data")
}

// writeNew writes data to a temp file, fsyncs it and links it to dst; the
// error wraps os.ErrExist when dst already exists (it is never replaced).
func (s *Store) writeNew(dst string, data []byte) error {
	f, err := os.CreateTemp(filepath.Join(s.root, "tmp"), "put-*")
	if err != nil {
		return fmt.Errorf("artifact temp file: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, werr := f.Write(data)
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Link(tmp, dst)
	}
	if werr != nil {
		return fmt.Errorf("artifact write %s: %w", filepath.Base(dst), werr)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// Head returns the committed Meta of token, or ErrNotFound.
func (s *Store) Head(token string) (Meta, error) {
	if !tokenRE.MatchString(token) {
		return Meta{}, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	b, err := os.ReadFile(s.path("objects", token, ".meta"))
	if errors.Is(err, os.ErrNotExist) {
		return Meta{}, ErrNotFound
	}
	if err != nil {
		return Meta{}, fmt.Errorf("artifact head %s: %w", token, err)
	}
	var m Meta
	if err := json.Unmarshal(b, &m); err != nil {
		return Meta{}, fmt.Errorf("artifact head %s: corrupt meta: %w", token, err)
	}
	return m, nil
}

// Open returns the committed object's bytes as a stream and its Meta. The
// caller closes the reader.
func (s *Store) Open(token string) (io.ReadSeekCloser, Meta, error) {
	m, err := s.Head(token)
	if err != nil {
		return nil, Meta{}, err
	}
	f, err := os.Open(s.dataPath(token, m.SHA256))
	if errors.Is(err, os.ErrNotExist) {
		return nil, Meta{}, ErrNotFound
	}
	if err != nil {
		return nil, Meta{}, fmt.Errorf("artifact open %s: %w", token, err)
	}
	return f, m, nil
}

// Observation is what reading an object back shows.
type Observation struct {
	Meta   Meta
	Size   int64  // bytes actually stored
	SHA256 string // hex SHA-256 of the bytes actually stored
}

// Observe reads the object back in full and hashes what is stored, for
// read-back verification (seed section 7.1).
func (s *Store) Observe(token string) (Observation, error) {
	r, m, err := s.Open(token)
	if err != nil {
		return Observation{}, err
	}
	defer r.Close()
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return Observation{}, fmt.Errorf("artifact read back %s: %w", token, err)
	}
	return Observation{Meta: m, Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// Hide moves a committed object out of the readable set (a compensation,
// seed section 8). Hiding an object that is already hidden or absent is not
// an error: the call is idempotent.
func (s *Store) Hide(token string) error {
	if !tokenRE.MatchString(token) {
		return fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	// meta first: once it is gone the object no longer exists for readers.
	names := []string{token + ".meta"}
	datas, _ := filepath.Glob(filepath.Join(s.root, "objects", token+".*.data"))
	for _, d := range datas {
		names = append(names, filepath.Base(d))
	}
	for _, n := range names {
		err := os.Rename(filepath.Join(s.root, "objects", n), filepath.Join(s.root, "hidden", n))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("artifact hide %s: %w", token, err)
		}
	}
	if err := syncDir(filepath.Join(s.root, "hidden")); err != nil {
		return err
	}
	if err := syncDir(filepath.Join(s.root, "objects")); err != nil {
		return err
	}
	if s.faults.Hit(fault.ArtifactHideTimeoutAfterCommit) != fault.ActionNone {
		return ErrTimeout // hidden, but the caller does not know (seed 14)
	}
	return nil
}

// Token returns the idempotency token of the artifact-writing effect of a
// task attempt: "<task_id>.attempt-<n>". The same task and attempt always give
// the same token, so a retried write lands on the same object.
func Token(taskID string, attempt int) string {
	return fmt.Sprintf("%s.attempt-%d", taskID, attempt)
}
