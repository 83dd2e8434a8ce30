package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/services/api/idempotency"
)

// TestNoSequentialScansAfterAnalyzingEmptyTables: a new deployment analyzed
// before traffic (VACUUM ANALYZE of the empty, freshly migrated tables)
// must not run its statements as sequential scans as the tables grow.
// pgx prepares statements and PostgreSQL caches a generic plan after five
// executions; chosen on empty statistics it is a sequential scan, kept until
// the next ANALYZE (issue 11). dbpool.New prices sequential scans out, so
// the cached plans use the indexes (internal/dbpool).
func TestNoSequentialScansAfterAnalyzingEmptyTables(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		t.Fatal(err)
	}
	b := setupOn(t, db, nil)
	const n = 150
	ids := make([]string, 0, n)
	for i := range n {
		resp, body := b.post(t, fmt.Sprintf("plans-%03d", i), []byte(fmt.Sprintf(`{"document":{"n":%d}}`, i)))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("create %d: %d %s", i, resp.StatusCode, body)
		}
		ids = append(ids, taskID(t, body))
	}
	testenv.Eventually(t, 60*time.Second, "every task completed", func() bool {
		var done int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM task WHERE status = 'completed' AND task_id = ANY($1)`, ids).Scan(&done)
		return err == nil && done == n
	})
	// Statistics reach pg_stat_user_tables when the sessions go idle.
	var scans map[string]int64
	testenv.Eventually(t, 20*time.Second, "statistics flushed", func() bool {
		scans = map[string]int64{}
		rows, err := db.Pool.Query(ctx, `SELECT relname, seq_scan, idx_scan FROM pg_stat_user_tables
WHERE relname IN ('task', 'idempotency_record', 'outbox_event', 'outbox_published_transaction', 'inbox_message', 'effect_ledger', 'task_input')`)
		if err != nil {
			return false
		}
		defer rows.Close()
		var idx int64
		for rows.Next() {
			var name string
			var seq, ix *int64
			if rows.Scan(&name, &seq, &ix) != nil {
				return false
			}
			if seq != nil {
				scans[name] = *seq
			}
			if ix != nil {
				idx += *ix
			}
		}
		return idx >= 3*n // the statements of the n tasks are counted
	})
	for table, seq := range scans {
		// The reconciler's scans are bounded and periodic; the hot path's
		// statements are one or more per task per table.
		if seq > n/5 {
			t.Errorf("%s: %d sequential scans for %d tasks (cached generic plans chosen on empty statistics?)", table, seq, n)
		}
	}
	t.Logf("sequential scans: %v", scans)
}

func taskID(t *testing.T, body []byte) string {
	t.Helper()
	var out struct {
		TaskID string `json:"task_id"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.TaskID == "" {
		t.Fatalf("no task_id in %s (%v)", body, err)
	}
	return out.TaskID
}

// TestKeyedTransitionsReadOneEntry: every compare-and-set the hot path and
// the reconciler run on one row by key, with a guard on an open state
// (`task_id = $1 AND status = 'queued'`), reads one index entry per call
// — also when the statistics and the partial index of that open state were
// taken while almost nothing was open, and the open rows became thousands
// after the connection cached its plans (pgx prepares statements; after
// five executions PostgreSQL may keep a generic plan). On a full scan of
// the partial index the guard allows, every call would read the whole
// backlog: the worker's task CAS in the peer benchmark read
// task_nonterminal_idx 153 million times for 20,000 tasks (migration
// 00014, BENCHMARKS.md).
func TestKeyedTransitionsReadOneEntry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	// The rows are written by sessions of their own, which end before the
	// calls are measured: what they read (their foreign-key checks read
	// task_pkey once per row) is then counted before the baseline, never
	// in the calls' share (it was, when one of db.Pool's sessions happened
	// to report its statistics late).
	fillCfg, err := dbpool.ParseConfig(db.URL+"&application_name=keyed-fill", "")
	if err != nil {
		t.Fatal(err)
	}
	fillPool, err := pgxpool.NewWithConfig(ctx, fillCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer fillPool.Close()
	exec := func(s string, args ...any) {
		t.Helper()
		if _, err := fillPool.Exec(ctx, s, args...); err != nil {
			t.Fatalf("%.60s: %v", s, err)
		}
	}
	const scope = "tenant:t:create-document-task"
	fingerprint := strings.Repeat("a", 64)
	// fill writes tasks prefix1..prefixN at version 2 in status with their
	// idempotency record, the worker's and the projector's inbox rows and
	// an artifact.put effect, each in the given state.
	fill := func(prefix string, n int, status, record, message, effect string) {
		t.Helper()
		exec(`INSERT INTO task (task_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size,
  artifact_sha256, artifact_size, completed_at)
SELECT $2 || g, $4, $3, 2, 1, 'jcs', repeat('b', 64), 10,
  CASE WHEN $3 = 'completed' THEN repeat('c', 64) END, 10, CASE WHEN $3 = 'completed' THEN now() END
FROM generate_series(1, $1::int) g`, n, prefix, status, fingerprint)
		exec(`INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body,
  locked_until, expires_at)
SELECT $5, $2 || g, $4, $3, CASE WHEN $3 = 'succeeded' THEN $2 || g END, 202, '{}', now() + interval '1 hour', now() + interval '1 day'
FROM generate_series(1, $1::int) g`, n, prefix, record, fingerprint, scope)
		exec(`INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, locked_by, locked_until, completed_at)
SELECT c, $2 || g, repeat('d', 64), $3, 'owner', now() + interval '1 hour', now()
FROM generate_series(1, $1::int) g, (VALUES ('converge-worker'), ('converge-projector')) AS cs(c)`, n, prefix, message)
		exec(`INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state,
  request_sha256, request_size)
SELECT $2 || g, $2 || g, 1, 'artifact.put', $2 || g, 'target', $3, repeat('e', 64), 10
FROM generate_series(1, $1::int) g`, n, prefix, effect)
	}
	// Statistics and index sizes of a deployment whose tasks so far all
	// finished (the first tasks finish in milliseconds), one still open.
	fill("settled-", 400, "completed", "succeeded", "completed", "verified")
	fill("open-", 1, "queued", "in_progress", "processing", "started")
	exec("VACUUM ANALYZE")

	cfg, err := dbpool.ParseConfig(db.URL+"&application_name=keyed-transitions", "")
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // one connection: one plan cache
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	sum := "f" + strings.Repeat("0", 63)
	lease := time.Now().Add(time.Hour)
	transitions := []struct {
		name string
		run  func(tx pgx.Tx, id string) error
	}{
		{"task.LockIfAt", func(tx pgx.Tx, id string) error { _, _, err := task.LockIfAt(ctx, tx, id, "queued", 2); return err }},
		{"task.CancelIfQueued", func(tx pgx.Tx, id string) error { _, err := task.CancelIfQueued(ctx, tx, id, 2); return err }},
		{"task.StartIfQueued, then CompleteIfRunning", func(tx pgx.Tx, id string) error {
			if _, err := task.StartIfQueued(ctx, tx, id, 2); err != nil {
				return err
			}
			_, err := task.CompleteIfRunning(ctx, tx, id, 3, sum, 10)
			return err
		}},
		{"task.StartIfQueued, then FailIfRunning", func(tx pgx.Tx, id string) error {
			if _, err := task.StartIfQueued(ctx, tx, id, 2); err != nil {
				return err
			}
			_, err := task.FailIfRunning(ctx, tx, id, 3, "SCHEMA_INVALID")
			return err
		}},
		{"idempotency.QueueCompleteWith", func(tx pgx.Tx, id string) error {
			b := &pgx.Batch{}
			idempotency.QueueCompleteWith(b, idempotency.Key{Scope: scope, Key: id, Fingerprint: fingerprint}, id, 200, []byte(`{}`))
			return tx.SendBatch(ctx, b).Close()
		}},
		{"idempotency.Resolve", func(tx pgx.Tx, id string) error {
			rec := idempotency.Record{Scope: scope, Key: id}
			if _, err := idempotency.Resolve(ctx, tx, rec, nil); err != nil {
				return err
			}
			_, err := idempotency.Resolve(ctx, tx, rec, &taskevent.Task{TaskID: id})
			return err
		}},
		{"inbox.ReleaseLease", func(tx pgx.Tx, id string) error {
			_, err := inbox.ReleaseLease(ctx, tx, "converge-worker", id, "owner")
			return err
		}},
		{"inbox.Finish", func(tx pgx.Tx, id string) error {
			_, err := inbox.Finish(ctx, tx, "converge-worker", id, inbox.Completed, map[string]any{})
			return err
		}},
		{"inbox.Release", func(tx pgx.Tx, id string) error {
			_, err := inbox.Release(ctx, tx, inbox.Stale{Consumer: "converge-projector", MessageID: id, LastSeenAt: lease}, "completed")
			return err
		}},
		{"task.QueueStartIfQueuedReadingDocument", func(tx pgx.Tx, id string) error {
			var started task.Changed
			var doc []byte
			var found bool
			b := &pgx.Batch{}
			task.QueueStartIfQueuedReadingDocument(b, id, 2, &started, &doc, &found)
			return tx.SendBatch(ctx, b).Close()
		}},
		{"ledger.Live", func(tx pgx.Tx, id string) error {
			_, _, err := ledger.Live(ctx, tx, id)
			return err
		}},
		{"ledger.MarkVerified", func(tx pgx.Tx, id string) error {
			_, err := ledger.MarkVerified(ctx, tx, id, ledger.Started, &sum)
			return err
		}},
	}
	// run runs every transition on id in a transaction rolled back, so the
	// row stays open.
	run := func(id string) {
		t.Helper()
		for _, tr := range transitions {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := tr.run(tx, id); err != nil {
				t.Fatalf("%s on %s: %v", tr.name, id, err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	for range 8 { // past the five custom plans: the cached plans
		run("open-1")
	}
	const backlog, calls = 2000, 20
	fill("backlog-", backlog, "queued", "in_progress", "processing", "started")
	fillPool.Close()
	db.SessionsEnded(t, "keyed-fill")
	// Every index of the four tables: with the keyed indexes the planner
	// may take the primary keys only, and the partial indexes' counters
	// stay 0.
	indexReads := func() map[string]int64 {
		t.Helper()
		rows, err := db.Pool.Query(ctx, `SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes
WHERE relname IN ('task', 'idempotency_record', 'inbox_message', 'effect_ledger')`)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]int64{}
		var name string
		var n int64
		if _, err := pgx.ForEachRow(rows, []any{&name, &n}, func() error { m[name] = n; return nil }); err != nil {
			t.Fatal(err)
		}
		return m
	}
	// The baseline: the fill's reads, reported when its sessions ended
	// (the 8 runs before the backlog may or may not be in it: they read a
	// few entries each).
	before := indexReads()
	for i := 1; i <= calls; i++ {
		run(fmt.Sprintf("backlog-%d", i*(backlog/calls)))
	}
	pool.Close()
	db.SessionsEnded(t, "keyed-transitions")
	partial := []string{"task_nonterminal_idx", "idempotency_record_in_progress_idx", "inbox_message_processing_idx", "effect_ledger_unresolved_idx"}
	read := map[string]int64{}
	for name, n := range indexReads() {
		read[name] = n - before[name]
	}
	t.Logf("index entries read by %d calls of each transition (and by up to %d before the backlog): %v", calls, 8, read)
	for _, name := range partial {
		// A lookup reads an entry or two; a scan of the index, the backlog.
		// All the calls together read less than one scan would.
		if n := read[name]; n >= backlog {
			t.Errorf("%s: %d entries read by %d keyed calls (%d open rows): a call scans the index instead of looking its key up", name, n, calls, backlog)
		}
	}
	// Nor any other index: ledger.Live's guard (task_id, kind, open
	// states) also matched the leading column of the ledger's unique
	// (effect_kind, idempotency_token) index (dropped by migration 00019),
	// which every put effect shares; a plan on it read all the puts per
	// call. Any index a new plan scans is caught here the same way.
	for name, n := range read {
		if n >= backlog {
			t.Errorf("%s: %d entries read by %d keyed calls (%d open rows): a call scans the index instead of looking its key up", name, n, calls, backlog)
		}
	}
}
