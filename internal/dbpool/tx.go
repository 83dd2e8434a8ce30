package dbpool

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PipelinedTx is a transaction on one pool connection whose BEGIN is sent
// with its first batch, and whose COMMIT may be sent with its last
// (SendBatchAndCommit): a transaction of two batches takes two round trips
// to PostgreSQL where pgx.BeginFunc takes four (BEGIN, the batches, COMMIT).
//
// A statement that fails makes PostgreSQL skip the rest of its batch (one
// Sync per batch), COMMIT included, and leaves the transaction aborted; the
// transaction is then rolled back when it ends (InPipelinedTx), and a
// connection whose rollback fails is closed, never returned to the pool
// mid-transaction. After a batch's error the transaction takes no more
// batches and InPipelinedTx sends no COMMIT, even when fn goes on or returns
// nil: a batch after a failed BEGIN or a failed COMMIT would otherwise run
// outside any transaction, committed on its own.
type PipelinedTx struct {
	conn      *pgxpool.Conn
	begun     bool
	committed bool
	failed    error // the first batch error, as returned to the caller
}

// InPipelinedTx runs fn in a PipelinedTx on a connection of pool. When fn
// returns nil without having committed (SendBatchAndCommit), COMMIT is sent
// on its own, with SendBatchAndCommit's errors (a lost answer is a
// *CommitUnknownError); when fn returns an error, or a statement before
// COMMIT fails, the transaction is rolled back and the error returned. A fn
// that sends no batch sends nothing.
func InPipelinedTx(ctx context.Context, pool *pgxpool.Pool, fn func(*PipelinedTx) error) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquire connection: %w", err)
	}
	tx := &PipelinedTx{conn: conn}
	defer tx.end()
	if err := fn(tx); err != nil {
		return err
	}
	if tx.failed != nil {
		return tx.failed // fn ignored it; nothing more is sent
	}
	if !tx.begun || tx.committed {
		return nil
	}
	if err := tx.SendBatchAndCommit(ctx, &pgx.Batch{}); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// SendBatch sends b in the transaction (preceded by BEGIN when it is the
// first batch) and reads all of its results: the error is the first one,
// from PostgreSQL or from a result callback of b. b is changed. After an
// error, or after COMMIT, it sends nothing and returns an error.
func (t *PipelinedTx) SendBatch(ctx context.Context, b *pgx.Batch) error {
	if err := t.send(ctx, b); err != nil {
		if t.failed == nil {
			t.failed = err
		}
		return err
	}
	return nil
}

func (t *PipelinedTx) send(ctx context.Context, b *pgx.Batch) error {
	switch {
	case t.committed:
		return errors.New("batch sent after the transaction committed")
	case t.failed != nil:
		return fmt.Errorf("batch sent after the transaction failed: %w", t.failed)
	}
	if !t.begun {
		b.QueuedQueries = append([]*pgx.QueuedQuery{{SQL: "BEGIN"}}, b.QueuedQueries...)
		t.begun = true
	}
	return t.conn.SendBatch(ctx, b).Close()
}

// SendBatchAndCommit is SendBatch with COMMIT appended to b: when it returns
// nil the transaction is committed. When it returns an error, PostgreSQL's
// transaction status after the batch (the Sync's ReadyForQuery) says what
// happened:
//   - still in the transaction, or in a failed one (a statement failed, and
//     PostgreSQL skipped the rest of the batch, COMMIT included): not
//     committed; the error is returned as it is;
//   - out of the transaction, with an error PostgreSQL raised (a
//     *pgconn.PgError: COMMIT itself failed, as a deferred constraint does):
//     not committed either;
//   - anything else is a *CommitUnknownError: the connection was closed
//     before the answers were read (a broken connection, or ctx's end: pgx
//     closes the connection then), or COMMIT ran while a result callback of
//     b returned an error. PostgreSQL runs a pipelined COMMIT whatever the
//     client does with the results before it (pgx stops calling callbacks at
//     the first error and only drains the rest), so a check that must keep
//     the transaction from committing belongs in a statement, not in a
//     callback of the last batch.
func (t *PipelinedTx) SendBatchAndCommit(ctx context.Context, b *pgx.Batch) error {
	if t.committed || t.failed != nil {
		return t.SendBatch(ctx, b) // refused
	}
	QueueCommit(b)
	err := t.send(ctx, b)
	if err == nil {
		t.committed = true
		return nil
	}
	pc := t.conn.Conn().PgConn()
	var pe *pgconn.PgError
	switch {
	case pc.IsClosed():
	case pc.TxStatus() == 'T' || pc.TxStatus() == 'E':
		t.failed = err
		return err
	case errors.As(err, &pe):
		t.failed = err
		return err
	}
	t.failed = &CommitUnknownError{Err: err}
	return t.failed
}

// CommitUnknownError is the error of a transaction whose COMMIT was sent and
// whose outcome was not received (SendBatchAndCommit): it may have
// committed. The caller settles it by reading what the transaction wrote,
// on another connection.
type CommitUnknownError struct{ Err error }

func (e *CommitUnknownError) Error() string { return "commit outcome unknown: " + e.Err.Error() }

// Unwrap returns the error of the send.
func (e *CommitUnknownError) Unwrap() error { return e.Err }

// end rolls the transaction back unless it committed or never began, and
// releases the connection.
func (t *PipelinedTx) end() {
	if t.begun && !t.committed {
		rollback(t.conn.Conn())
	}
	t.conn.Release()
}

// QueueCommit queues COMMIT on b, failing the batch unless PostgreSQL
// answered COMMIT (a transaction that failed before it answers ROLLBACK).
func QueueCommit(b *pgx.Batch) {
	b.Queue("COMMIT").Exec(func(tag pgconn.CommandTag) error {
		if tag.String() != "COMMIT" {
			return errors.New(tag.String())
		}
		return nil
	})
}

// rollback ends the open transaction of conn; when that fails the connection
// is closed, so a pool never reuses it mid-transaction (pgxpool also
// destroys a released connection whose transaction status is not idle).
func rollback(conn *pgx.Conn) {
	if conn.IsClosed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		_ = conn.Close(ctx)
	}
}

// IsStatementError reports whether err is PostgreSQL's answer to one
// statement (a *pgconn.PgError: a constraint, a serialization failure, ...),
// as opposed to a failure of the connection or of the caller's context,
// which fails every statement after it the same way. Callers that retry a
// failed batch item by item stop at the first error that is not one.
func IsStatementError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe)
}
