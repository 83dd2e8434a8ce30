// Package dbpool holds what every PostgreSQL user of converge shares: the
// rule for its pool (use the pool the caller gives, or open one from a URL
// and own it) and Querier, the interface the aggregate stores run their
// statements on.
package dbpool

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// New opens a pool on url like pgxpool.New, with enable_seqscan=off,
// jit=off and application_name app (what pg_stat_activity and
// pg_stat_statements' users show: "converge-api", "converge-worker", ...) on
// every connection, each unless url sets it itself.
//
// Why: converge's statements are point lookups and bounded index scans, and
// pgx prepares them; after five executions PostgreSQL may cache a generic
// plan for good. A generic plan chosen while a table is empty and analyzed
// (reltuples 0: a new deployment analyzed before traffic) is a sequential
// scan — cost 0 on 0 pages — which then runs for every statement as the
// table grows, until an ANALYZE invalidates it (issue 11: 40,047 sequential
// scans of task for 20,000 tasks). With sequential scans priced out, the
// cached plan uses the index the statement was written for; a statement
// with no usable index still scans (enable_seqscan only adds cost).
// TestNoSequentialScansAfterAnalyzingEmptyTables measures it.
//
// jit=off because that added cost (10^10 per disabled scan) is far above
// jit_above_cost (100,000 by default): every statement whose plan keeps a
// sequential scan — the reconciler's periodic scans, a count of a small
// table — was compiled by LLVM with inlining and optimization, 40 to
// 250 ms of CPU per execution for a statement that runs in under 10 ms
// (issue 11: a quarter of PostgreSQL's time in the peer benchmark went to
// the reconciler's passes, nearly all of it JIT). converge's statements
// are short OLTP statements, for which JIT never pays off.
// TestNoJITForPricedOutScans measures it.
func New(ctx context.Context, url, app string) (*pgxpool.Pool, error) {
	cfg, err := ParseConfig(url, app)
	if err != nil {
		return nil, err
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// IdleInTransactionTimeout is New's idle_in_transaction_session_timeout:
// PostgreSQL ends a session that has kept a transaction open without a
// statement for this long, releasing its locks. A process frozen inside a
// transaction (SIGSTOP, a VM pause, a GC stall, a hung disk write between
// two statements) otherwise holds its row locks for as long as it stays
// frozen, and every other member of its consumer group that takes over its
// records blocks behind them until its own attempts run out (found by a
// crash test: a frozen worker's intake held 64 inbox rows for over 7
// minutes; a healthy task was dead-lettered RETRIES_EXHAUSTED). converge's
// transactions never wait between statements for longer than an attempt
// (30s) — the longest is the dead-letter service's replay, which waits for
// the broker's acknowledgement (ProduceTimeout, 30s) — so 60s ends only
// the stuck ones; the frozen process's next statement then fails and it
// starts over from durable state.
const IdleInTransactionTimeout = "60s"

// ParseConfig is pgxpool.ParseConfig with New's enable_seqscan=off, jit=off,
// idle_in_transaction_session_timeout (IdleInTransactionTimeout) and
// application_name app (none when app is empty), each unless url sets it
// itself.
func ParseConfig(url, app string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	SetApplicationName(cfg.ConnConfig.RuntimeParams, app)
	for _, kv := range sessionSettings {
		if _, set := cfg.ConnConfig.RuntimeParams[kv[0]]; !set {
			cfg.ConnConfig.RuntimeParams[kv[0]] = kv[1]
		}
	}
	return cfg, nil
}

// sessionSettings are the settings ParseConfig gives every session (name,
// value), in this order.
var sessionSettings = [][2]string{
	{"enable_seqscan", "off"},
	{"jit", "off"},
	{"idle_in_transaction_session_timeout", IdleInTransactionTimeout},
}

// PGOptions returns New's session settings as libpq's PGOPTIONS value
// ("-c enable_seqscan=off -c jit=off ..."): a libpq client such as pgbench
// run with it plans converge's statements as converge's own sessions do.
func PGOptions() string {
	opts := make([]string, 0, len(sessionSettings))
	for _, kv := range sessionSettings {
		opts = append(opts, "-c "+kv[0]+"="+kv[1])
	}
	return strings.Join(opts, " ")
}

// SetApplicationName sets application_name in params (a connection's
// RuntimeParams) to app unless params has one (from the URL) or app is
// empty: what pg_stat_activity, pg_stat_replication and
// pg_stat_statements' users show of a session.
func SetApplicationName(params map[string]string, app string) {
	if _, set := params["application_name"]; !set && app != "" {
		params["application_name"] = app
	}
}

// Use returns pool and owned=false when pool is not nil: the caller keeps
// owning it. Otherwise it opens a pool on url (New: pgxpool defaults, or the
// pool_* parameters of the URL; application_name "converge-" + who) and
// returns owned=true: the component must close it when it stops. The error
// wraps pgxpool's, prefixed with who.
func Use(pool *pgxpool.Pool, url, who string) (p *pgxpool.Pool, owned bool, err error) {
	if pool != nil {
		return pool, false, nil
	}
	if p, err = New(context.Background(), url, "converge-"+who); err != nil {
		return nil, false, fmt.Errorf("%s: open database pool: %w", who, err)
	}
	return p, true, nil
}

// Querier is what the aggregate stores (task, outbox, inbox, ledger) need
// from a pgx.Tx, a *pgx.Conn or a *pgxpool.Pool: a statement runs in the
// caller's transaction when the caller passes one.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ Querier = pgx.Tx(nil)
	_ Querier = (*pgx.Conn)(nil)
	_ Querier = (*pgxpool.Pool)(nil)
)
