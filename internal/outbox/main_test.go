package outbox_test

import (
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

// TestMain starts PostgreSQL on demand and fails the package's tests when
// they leak goroutines.
func TestMain(m *testing.M) { testenv.Main(m) }
