package docgen

import (
	"encoding/json"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestDocumentSize(t *testing.T) {
	t.Parallel()
	for _, size := range []int{64, 1024, 100_000} {
		d := Document(7, size)
		if !json.Valid(d) {
			t.Fatalf("size %d: invalid JSON %s", size, d)
		}
		if len(d) < size-2 || len(d) > size+200 {
			t.Errorf("size %d: got %d bytes", size, len(d))
		}
	}
}
