package ledger_test

import (
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }
