package dbpool_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/testenv"
)

// Every pool's sessions end a transaction left idle for
// IdleInTransactionTimeout (a frozen process releases its locks), price
// sequential scans out and do not JIT-compile; a URL's own setting wins.
func TestSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	show := func(url, name string) string {
		t.Helper()
		p, err := dbpool.New(ctx, url, "")
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
	if got := show(db.URL, "jit"); got != "off" {
		t.Errorf("jit = %q, want off", got)
	}
	if got := show(db.URL+"&jit=on", "jit"); got != "on" {
		t.Errorf("jit with the URL's jit=on: %q, want on", got)
	}
	if got := show(db.URL+"&idle_in_transaction_session_timeout=5s", "idle_in_transaction_session_timeout"); got != "5s" {
		t.Errorf("with the URL's own setting: %q, want 5s", got)
	}
}

// TestNoJITForPricedOutScans: a statement whose plan keeps a sequential
// scan (here a count of dead letters by a column no index covers, as the
// reconciler's pass runs it) costs more than jit_above_cost once
// enable_seqscan=off prices the scan out; a pool's session runs it without
// JIT, while a session with PostgreSQL's default (jit=on, when the server
// has LLVM) compiles it.
func TestNoJITForPricedOutScans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	const stmt = `EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM dead_letter WHERE error_message = ''`
	jitted := func(url string) bool {
		t.Helper()
		p, err := dbpool.New(ctx, url, "")
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		var plan []map[string]any
		if err := p.QueryRow(ctx, stmt).Scan(&plan); err != nil {
			t.Fatal(err)
		}
		_, ok := plan[0]["JIT"]
		return ok
	}
	if jitted(db.URL) {
		t.Fatal("a pool's session JIT-compiled a priced-out sequential scan")
	}
	var available bool
	if err := db.Pool.QueryRow(ctx, "SELECT pg_jit_available()").Scan(&available); err != nil {
		t.Fatal(err)
	}
	if !available {
		t.Log("this server has no JIT provider: the control with jit=on is skipped")
		return
	}
	if !jitted(db.URL + "&jit=on") {
		t.Fatal("control: with jit=on the statement was not JIT-compiled; the test no longer shows what jit=off avoids")
	}
}

// TestMain stops the test PostgreSQL and checks for leaked goroutines.
func TestMain(m *testing.M) { testenv.Main(m) }

// PGOptions gives a libpq client (pgbench in make bench) the sessions
// settings of New: a plain connection carrying it as its options shows
// each of them.
func TestPGOptionsCarryTheSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = dbpool.PGOptions()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for name, want := range map[string]string{"enable_seqscan": "off", "jit": "off", "idle_in_transaction_session_timeout": "1min"} {
		var got string
		if err := conn.QueryRow(ctx, "SHOW "+name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %q with PGOPTIONS %q, want %q", name, got, dbpool.PGOptions(), want)
		}
	}
}
