package reconciler

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/services/api/idempotency"
)

// The reconciler's transactions. It writes no table itself: every repair
// goes through the owner of the aggregate it repairs (packages ledger,
// inbox, task, outbox, idempotency), each a compare-and-set on the state
// read, so a repair computed from a stale read can never undo newer
// progress (DESIGN.md, River's rescuer bug).

// redrive writes a TaskRedriveRequested outbox event for t's current
// version, in a transaction that locks the task and checks it is still at
// t's status and version (compare-and-set). false: the task moved, or a
// re-drive of this version exists (the outbox's unique (task, version,
// type) allows one).
func redrive(ctx context.Context, db *pgxpool.Pool, t taskevent.Task) (bool, error) {
	var ok bool
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		cur, found, err := task.LockIfAt(ctx, tx, t.TaskID, t.Status, t.Version)
		if err != nil || !found {
			return err
		}
		ev, err := outbox.NewEvent(taskevent.TypeTaskRedriveRequested, cur, time.Now().Truncate(time.Microsecond))
		if err != nil {
			return err
		}
		ok, err = outbox.InsertOnce(ctx, tx, &ev)
		if err != nil {
			return fmt.Errorf("re-drive task %s: %w", t.TaskID, err)
		}
		return nil
	})
	return ok, err
}

// resolveIdempotency resolves an expired in_progress record from its task's
// state (idempotency.Resolve): with a task, succeeded with the response the
// API gave for it; without one, deleted.
func resolveIdempotency(ctx context.Context, db *pgxpool.Pool, rec idempotency.Record) (bool, error) {
	var t *taskevent.Task
	if rec.TaskID != nil {
		cur, found, err := task.Get(ctx, db, *rec.TaskID)
		if err != nil {
			return false, err
		}
		if !found {
			return false, nil // its foreign key makes this impossible
		}
		t = &cur
	}
	return idempotency.Resolve(ctx, db, rec, t)
}
