// Package corpus locates the shared test corpus (../shared/corpus relative to
// the project root, see its MANIFEST.md; CONVERGE_CORPUS_DIR overrides it)
// for tests and benchmarks. The files are referenced in place, never copied
// into the repository.
//
// The corpus is not part of the repository: a clone elsewhere has none.
// Tests that need it call Files, which skips them when the corpus is not
// found — saying once per test binary where it looked — unless
// CONVERGE_REQUIRE_CORPUS=1 (set by .ci/run, where the corpus is always
// present), which makes a missing corpus fail them. Tests that only add
// corpus cases to the project's own call Optional.
package corpus

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

// Dir returns the absolute path of the corpus folder: CONVERGE_CORPUS_DIR
// when it is set, else ../shared/corpus relative to the project root. The
// error says where it looked when the folder does not exist.
func Dir() (string, error) {
	dir := os.Getenv("CONVERGE_CORPUS_DIR")
	if dir == "" {
		_, file, _, ok := runtime.Caller(0)
		if !ok {
			return "", errors.New("corpus: cannot locate source file")
		}
		root := filepath.Join(filepath.Dir(file), "..", "..") // internal/corpus -> project root
		dir = filepath.Join(root, "..", "shared", "corpus")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(abs); err != nil {
		return "", fmt.Errorf("corpus not found at %s (set CONVERGE_CORPUS_DIR): %w", abs, err)
	}
	return abs, nil
}

// Glob returns the corpus files matching pattern (relative to Dir).
func Glob(pattern string) ([]string, error) {
	d, err := Dir()
	if err != nil {
		return nil, err
	}
	return filepath.Glob(filepath.Join(d, pattern))
}

// Required reports whether a missing corpus fails the tests
// (CONVERGE_REQUIRE_CORPUS=1).
func Required() bool { return os.Getenv("CONVERGE_REQUIRE_CORPUS") == "1" }

var skipOnce sync.Once

// Files returns the corpus files matching pattern, at least min of them.
// When the corpus is not found it skips t, or fails t when Required; it
// fails t when fewer than min files match (a corpus that is there but
// incomplete).
func Files(t testing.TB, pattern string, min int) []string {
	t.Helper()
	d, err := Dir()
	if err != nil {
		if Required() {
			t.Fatalf("CONVERGE_REQUIRE_CORPUS=1: %v", err)
		}
		skipOnce.Do(func() {
			fmt.Fprintf(os.Stderr, "corpus tests SKIPPED: %v; they run when the corpus is there (CONVERGE_REQUIRE_CORPUS=1 makes its absence fail)\n", err)
		})
		t.Skipf("corpus not found: %v", err)
	}
	files, err := filepath.Glob(filepath.Join(d, pattern))
	if err != nil || len(files) < min {
		t.Fatalf("corpus %s: %d files, want at least %d (%v)", pattern, len(files), min, err)
	}
	return files
}

// Optional returns the corpus files matching pattern when the corpus is
// found (at least min of them, or t fails), and nil otherwise — failing t
// instead when Required. For tests that run on the project's own cases and
// add the corpus's when it is there.
func Optional(t testing.TB, pattern string, min int) []string {
	t.Helper()
	if _, err := Dir(); err != nil {
		if Required() {
			t.Fatalf("CONVERGE_REQUIRE_CORPUS=1: %v", err)
		}
		skipOnce.Do(func() {
			fmt.Fprintf(os.Stderr, "corpus cases SKIPPED: %v; the tests run on the project's own cases only\n", err)
		})
		return nil
	}
	return Files(t, pattern, min)
}

// NotIJSON lists the JSONTestSuite y_ cases that are valid JSON but not
// I-JSON (RFC 7493), which converge rejects with a 4xx problem, with the code
// it gives each.
var NotIJSON = map[string]string{
	"y_object_duplicated_key.json":           "DUPLICATE_MEMBER_NAME",
	"y_object_duplicated_key_and_value.json": "DUPLICATE_MEMBER_NAME",
}
