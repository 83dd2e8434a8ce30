package dbpool_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/testenv"
)

// sends counts what a pool's connections send: batches and single
// statements (each one round trip to PostgreSQL).
type sends struct{ batches, queries atomic.Int64 }

func (s *sends) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	s.queries.Add(1)
	return ctx
}
func (s *sends) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (s *sends) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	s.batches.Add(1)
	return ctx
}
func (s *sends) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (s *sends) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// txPool is a pool of one connection on a fresh database with table kv,
// whose sends are counted.
func txPool(t *testing.T) (*pgxpool.Pool, *sends) {
	t.Helper()
	ctx := context.Background()
	db := testenv.NewDB(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE kv (k text PRIMARY KEY, v int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg, err := dbpool.ParseConfig(db.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	s := &sends{}
	cfg.ConnConfig.Tracer = s
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, s
}

func insert(b *pgx.Batch, k string, v int) {
	b.Queue(`INSERT INTO kv (k, v) VALUES ($1, $2)`, k, v)
}

// sendTwo sends a batch queued by first with send1, then, unless that
// failed, one queued by second with send2 (tx.SendBatch or
// tx.SendBatchAndCommit).
func sendTwo(ctx context.Context, send1, send2 func(context.Context, *pgx.Batch) error, first, second func(*pgx.Batch)) error {
	var b pgx.Batch
	first(&b)
	if err := send1(ctx, &b); err != nil {
		return err
	}
	b = pgx.Batch{}
	second(&b)
	return send2(ctx, &b)
}

// wantKeys fails t unless the committed keys of kv are want (sorted, comma
// separated).
func wantKeys(t *testing.T, pool *pgxpool.Pool, want string) {
	t.Helper()
	if got := keys(t, pool); got != want {
		t.Errorf("committed keys %q, want %q", got, want)
	}
}

func keys(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var got string
	if err := pool.QueryRow(context.Background(), `SELECT COALESCE(string_agg(k, ',' ORDER BY k), '') FROM kv`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	return got
}

// A transaction of two batches, the second with COMMIT, takes two round
// trips: BEGIN travels with the first batch, COMMIT with the last.
func TestPipelinedTxTakesOneRoundTripPerBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := txPool(t)
	err := dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
		return sendTwo(ctx, tx.SendBatch, tx.SendBatchAndCommit,
			func(b *pgx.Batch) { insert(b, "a", 1) },
			func(b *pgx.Batch) { insert(b, "b", 2) })
	})
	if err != nil {
		t.Fatal(err)
	}
	if b, q := s.batches.Load(), s.queries.Load(); b != 2 || q != 0 {
		t.Errorf("sent %d batches and %d single statements, want 2 and 0", b, q)
	}
	wantKeys(t, pool, "a,b")
}

// Without SendBatchAndCommit, COMMIT is sent on its own when fn returns nil;
// a fn that sends nothing sends nothing.
func TestPipelinedTxCommitsAfterFn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := txPool(t)
	err := dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		insert(&b, "a", 1)
		return tx.SendBatch(ctx, &b)
	})
	if err != nil {
		t.Fatal(err)
	}
	wantKeys(t, pool, "a")
	s.batches.Store(0)
	s.queries.Store(0)
	if err := dbpool.InPipelinedTx(ctx, pool, func(*dbpool.PipelinedTx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if b, q := s.batches.Load(), s.queries.Load(); b != 0 || q != 0 {
		t.Errorf("an empty transaction sent %d batches and %d statements, want none", b, q)
	}
}

// Whatever ends a transaction without its COMMIT — fn's error, a failed
// statement in a batch, a failed statement before the pipelined COMMIT —
// rolls all of it back, and the connection goes back to the pool usable,
// outside any transaction.
func TestPipelinedTxRollsBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := txPool(t)
	errFn := errors.New("fn failed")
	pid := func() uint32 {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		return conn.Conn().PgConn().PID()
	}
	first := pid()
	for _, tc := range []struct {
		name string
		fn   func(tx *dbpool.PipelinedTx) error
		want string
	}{
		{"fn error after a batch", func(tx *dbpool.PipelinedTx) error {
			var b pgx.Batch
			insert(&b, "x1", 1)
			if err := tx.SendBatch(ctx, &b); err != nil {
				return err
			}
			return errFn
		}, errFn.Error()},
		{"failed statement in the first batch", func(tx *dbpool.PipelinedTx) error {
			var b pgx.Batch
			insert(&b, "x2", 1)
			insert(&b, "x2", 2) // unique violation
			return tx.SendBatch(ctx, &b)
		}, "23505"},
		{"failed statement before COMMIT", func(tx *dbpool.PipelinedTx) error {
			return sendTwo(ctx, tx.SendBatch, tx.SendBatchAndCommit,
				func(b *pgx.Batch) { insert(b, "x3", 1) },
				func(b *pgx.Batch) { insert(b, "x4", 1); b.Queue(`SELECT 1/0`) })
		}, "22012"},
		{"a batch after COMMIT", func(tx *dbpool.PipelinedTx) error {
			return sendTwo(ctx, tx.SendBatchAndCommit, tx.SendBatch,
				func(b *pgx.Batch) { insert(b, "y", 1) },
				func(b *pgx.Batch) { insert(b, "x5", 1) })
		}, "after the transaction committed"},
	} {
		err := dbpool.InPipelinedTx(ctx, pool, tc.fn)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
		// The transaction was rolled back on its connection, which the pool
		// keeps (pgxpool destroys a connection released inside a
		// transaction, and the next Acquire would open another).
		if got := pid(); got != first {
			t.Errorf("%s: the pool's connection is backend %d, want %d: the transaction's connection was not reused", tc.name, got, first)
		}
	}
	wantKeys(t, pool, "y")
}

// A COMMIT sent whose answer is not read may have run: the error says so,
// whether COMMIT went with the last batch or on its own. Here commits are
// held (a synchronous standby that never answers), the context ends while
// COMMIT waits, pgx closes the connection, and PostgreSQL commits locally:
// the transactions did commit although their callers could not know.
func TestPipelinedTxCommitUnknown(t *testing.T) {
	t.Parallel()
	h := testenv.NewCommitHold(t)
	pool := h.DB.Pool
	bg := context.Background()
	if _, err := pool.Exec(bg, `CREATE TABLE kv (k text PRIMARY KEY, v int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	h.Hold(t)
	for _, tc := range []struct {
		name   string
		commit func(ctx context.Context, tx *dbpool.PipelinedTx, b *pgx.Batch) error
		key    string
	}{
		{"COMMIT with the last batch", func(ctx context.Context, tx *dbpool.PipelinedTx, b *pgx.Batch) error {
			return tx.SendBatchAndCommit(ctx, b)
		}, "with-batch"},
		{"COMMIT on its own", func(ctx context.Context, tx *dbpool.PipelinedTx, b *pgx.Batch) error {
			return tx.SendBatch(ctx, b)
		}, "alone"},
	} {
		ctx, cancel := context.WithTimeout(bg, 500*time.Millisecond)
		err := dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
			var b pgx.Batch
			insert(&b, tc.key, 1)
			return tc.commit(ctx, tx, &b)
		})
		cancel()
		var unknown *dbpool.CommitUnknownError
		if !errors.As(err, &unknown) {
			t.Errorf("%s: err = %v, want a *CommitUnknownError", tc.name, err)
		}
	}
	h.Release(t)
	wantKeys(t, pool, "alone,with-batch")
	// A failed statement before COMMIT is not unknown: COMMIT did not run.
	err := dbpool.InPipelinedTx(bg, pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		b.Queue(`SELECT 1/0`)
		return tx.SendBatchAndCommit(bg, &b)
	})
	var unknown *dbpool.CommitUnknownError
	if err == nil || errors.As(err, &unknown) {
		t.Fatalf("err = %v, want a statement's error, not a *CommitUnknownError", err)
	}
}

// What an error of SendBatchAndCommit says about the COMMIT it sent:
// PostgreSQL's own errors, before COMMIT or of COMMIT, mean not committed,
// even when a callback replaced the error; a callback's own error while
// every statement succeeded is unknown, and the transaction did commit
// (PostgreSQL runs the pipelined COMMIT whatever the client's checks say).
func TestPipelinedTxCommitOutcomeOfTheLastBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := txPool(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE child (k text REFERENCES kv (k) DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	errCheck := errors.New("a check of a result")
	for _, tc := range []struct {
		name    string
		queue   func(b *pgx.Batch)
		unknown bool
		key     string // committed by the case, or ""
	}{
		{"a statement fails; its callback replaces the error", func(b *pgx.Batch) {
			insert(b, "s", 1)
			q := b.Queue(`SELECT 1/0`)
			q.Fn = func(br pgx.BatchResults) error {
				if _, err := br.Exec(); err != nil {
					return errCheck // as tenant.QueueConsumeQuota maps 22012
				}
				return nil
			}
		}, false, ""},
		{"COMMIT fails (a deferred foreign key)", func(b *pgx.Batch) {
			insert(b, "d", 1)
			b.Queue(`INSERT INTO child (k) VALUES ('no-such-key')`)
		}, false, ""},
		{"every statement succeeds; a callback fails", func(b *pgx.Batch) {
			b.Queue(`INSERT INTO kv (k, v) VALUES ('c', 1)`).Exec(func(pgconn.CommandTag) error { return errCheck })
		}, true, "c"},
	} {
		err := dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
			var b pgx.Batch
			tc.queue(&b)
			return tx.SendBatchAndCommit(ctx, &b)
		})
		var unknown *dbpool.CommitUnknownError
		if err == nil || errors.As(err, &unknown) != tc.unknown {
			t.Errorf("%s: err = %v, want an error that is a *CommitUnknownError: %v", tc.name, err, tc.unknown)
		}
	}
	wantKeys(t, pool, "c")
}

// After a batch's error the transaction sends nothing more, even when fn
// ignores the error: a batch after a failed BEGIN or a failed COMMIT would
// run outside any transaction and commit on its own (found by a review:
// a failed first batch, whose BEGIN was skipped by a statement PostgreSQL
// could not parse, let the next batch commit alone).
func TestPipelinedTxSendsNothingAfterAFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := txPool(t)
	unparsable := func(b *pgx.Batch, k string) {
		insert(b, k, 1)
		b.Queue(`SELEC 1`)
	}
	// fn goes on after the error and ends with a failing COMMIT batch.
	err := dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		unparsable(&b, "a")
		_ = tx.SendBatch(ctx, &b)
		b = pgx.Batch{}
		insert(&b, "b", 1)
		if err := tx.SendBatch(ctx, &b); err == nil || !strings.Contains(err.Error(), "after the transaction failed") {
			t.Errorf("a batch after a failed one: err = %v, want it refused", err)
		}
		b = pgx.Batch{}
		insert(&b, "b2", 1)
		return tx.SendBatchAndCommit(ctx, &b)
	})
	if err == nil || !strings.Contains(err.Error(), "after the transaction failed") {
		t.Errorf("COMMIT after a failed batch: err = %v, want it refused", err)
	}
	// fn ignores the error and returns nil: InPipelinedTx returns the error
	// and sends no COMMIT.
	err = dbpool.InPipelinedTx(ctx, pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		unparsable(&b, "c")
		_ = tx.SendBatch(ctx, &b)
		b = pgx.Batch{}
		insert(&b, "d", 1)
		_ = tx.SendBatch(ctx, &b)
		return nil
	})
	if err == nil || !strings.Contains(err.Error(), "42601") {
		t.Errorf("fn that ignored a failed batch: err = %v, want the batch's error (42601)", err)
	}
	wantKeys(t, pool, "")
}
