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
// mid-transaction.
type PipelinedTx struct {
	conn      *pgxpool.Conn
	begun     bool
	committed bool
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
// from PostgreSQL or from a result callback of b. b is changed.
func (t *PipelinedTx) SendBatch(ctx context.Context, b *pgx.Batch) error {
	if t.committed {
		return errors.New("batch sent after the transaction committed")
	}
	if !t.begun {
		b.QueuedQueries = append([]*pgx.QueuedQuery{{SQL: "BEGIN"}}, b.QueuedQueries...)
		t.begun = true
	}
	return t.conn.SendBatch(ctx, b).Close()
}

// SendBatchAndCommit is SendBatch with COMMIT appended to b: when it returns
// nil the transaction is committed. An error whose connection was closed
// before PostgreSQL's answers were read (a broken connection, or ctx's end:
// pgx closes the connection then) is a *CommitUnknownError: COMMIT may have
// run. Any other error means it did not: a statement failed before it.
func (t *PipelinedTx) SendBatchAndCommit(ctx context.Context, b *pgx.Batch) error {
	QueueCommit(b)
	if err := t.SendBatch(ctx, b); err != nil {
		if t.conn.Conn().IsClosed() {
			return &CommitUnknownError{Err: err}
		}
		return err
	}
	t.committed = true
	return nil
}

// CommitUnknownError is the error of a transaction whose COMMIT was sent and
// whose answer was not received: it may have committed. The caller settles
// it by reading what the transaction wrote, on another connection.
type CommitUnknownError struct{ Err error }

func (e *CommitUnknownError) Error() string { return "commit outcome unknown: " + e.Err.Error() }

// Unwrap returns the error of the send.
func (e *CommitUnknownError) Unwrap() error { return e.Err }

// end rolls the transaction back unless it committed or never began, and
// releases the connection.
func (t *PipelinedTx) end() {
	if t.begun && !t.committed {
		Rollback(t.conn.Conn())
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

// Rollback ends the open transaction of conn; when that fails the connection
// is closed, so a pool never reuses it mid-transaction (pgxpool also
// destroys a released connection whose transaction status is not idle).
func Rollback(conn *pgx.Conn) {
	if conn.IsClosed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		_ = conn.Close(ctx)
	}
}
