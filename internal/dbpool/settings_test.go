package dbpool_test

import (
	"context"
	"testing"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/testenv"
)

// Every pool's sessions end a transaction left idle for
// IdleInTransactionTimeout (a frozen process releases its locks), and
// price sequential scans out; a URL's own setting wins.
func TestSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	show := func(url, name string) string {
		t.Helper()
		p, err := dbpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		var v string
		if err := p.QueryRow(ctx, "SHOW "+name).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if got := show(db.URL, "idle_in_transaction_session_timeout"); got != "1min" {
		t.Errorf("idle_in_transaction_session_timeout = %q, want 1min", got)
	}
	if got := show(db.URL, "enable_seqscan"); got != "off" {
		t.Errorf("enable_seqscan = %q, want off", got)
	}
	if got := show(db.URL+"&idle_in_transaction_session_timeout=5s", "idle_in_transaction_session_timeout"); got != "5s" {
		t.Errorf("with the URL's own setting: %q, want 5s", got)
	}
}

// TestMain stops the test PostgreSQL and checks for leaked goroutines.
func TestMain(m *testing.M) { testenv.Main(m) }
