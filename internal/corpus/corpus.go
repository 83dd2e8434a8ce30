// Package corpus locates the shared test corpus (../shared/corpus relative to
// the project root, see its MANIFEST.md) for tests and benchmarks. The files
// are referenced in place, never copied into the repository.
package corpus

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
)

// Dir returns the absolute path of the corpus folder, honouring
// CONVERGE_CORPUS_DIR when it is set.
func Dir() (string, error) {
	if d := os.Getenv("CONVERGE_CORPUS_DIR"); d != "" {
		return filepath.Abs(d)
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("corpus: cannot locate source file")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..") // internal/corpus -> project root
	dir := filepath.Join(root, "..", "shared", "corpus")
	if _, err := os.Stat(dir); err != nil {
		return "", err
	}
	return filepath.Abs(dir)
}

// Glob returns the corpus files matching pattern (relative to Dir).
func Glob(pattern string) ([]string, error) {
	d, err := Dir()
	if err != nil {
		return nil, err
	}
	return filepath.Glob(filepath.Join(d, pattern))
}

// NotIJSON lists the JSONTestSuite y_ cases that are valid JSON but not
// I-JSON (RFC 7493), which converge rejects with a 4xx problem, with the code
// it gives each.
var NotIJSON = map[string]string{
	"y_object_duplicated_key.json":           "DUPLICATE_MEMBER_NAME",
	"y_object_duplicated_key_and_value.json": "DUPLICATE_MEMBER_NAME",
}
