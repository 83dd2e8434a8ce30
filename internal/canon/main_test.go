package canon_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when they leak goroutines.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
