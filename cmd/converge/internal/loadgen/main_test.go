package loadgen

import (
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

// TestMain stops the harness's processes and fails on leaked goroutines.
func TestMain(m *testing.M) { testenv.Main(m) }
