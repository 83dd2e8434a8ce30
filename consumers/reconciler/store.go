package reconciler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
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

// purgeOutbox removes, in one transaction, the inbox rows (of every
// consumer, not processing) of the outbox rows ids, then those rows that
// are still published or decided: the inbox first, the order of the
// project's transactions (package inbox). It returns how many of each.
func purgeOutbox(ctx context.Context, db *pgxpool.Pool, ids []string) (inboxRows, outboxRows int64, err error) {
	if len(ids) == 0 {
		return 0, 0, nil
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		if inboxRows, err = inbox.DeleteMessages(ctx, tx, ids); err != nil {
			return err
		}
		outboxRows, err = outbox.DeletePurgeable(ctx, tx, ids)
		return err
	})
	if err != nil {
		return 0, 0, err
	}
	return inboxRows, outboxRows, nil
}

// removed is what removeTask did: hold is the reason it kept the task
// ("" when it removed it), the others count the rows removed with it.
type removed struct {
	hold                                string
	deadLetters, inbox, effects, outbox int64
}

// errKept rolls back removeTask's transaction when the task is kept.
var errKept = errors.New("task kept")

// removeTask removes task id and every row of it in one transaction, in
// the order the project's transactions lock rows (dead letters, as a
// replay does; inbox; task; effects; outbox): its resolved and replayed
// dead letters, its events' inbox rows that are not processing, then the
// task is locked and task.Hold checked again, and no inbox row of its
// events may be processing — the task or one of its rows changed since the
// pass read it: everything is rolled back and hold says why — then its
// effects, outbox rows, input and the task itself (task.Delete, a
// compare-and-set on the version locked).
func removeTask(ctx context.Context, db *pgxpool.Pool, id string, olderThan time.Duration) (removed, error) {
	var rm removed
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		if rm.deadLetters, err = deadletter.DeleteOfTask(ctx, tx, id); err != nil {
			return err
		}
		msgs, err := outbox.IDsOfTask(ctx, tx, id)
		if err != nil {
			return err
		}
		if rm.inbox, err = inbox.DeleteMessages(ctx, tx, msgs); err != nil {
			return err
		}
		t, found, err := task.Lock(ctx, tx, id)
		if err != nil {
			return err
		}
		if !found {
			rm.hold = "not_found"
			return errKept
		}
		hold, _, err := task.Hold(ctx, tx, id, olderThan)
		if err != nil {
			return err
		}
		if hold == "" {
			var busy bool
			if busy, err = inbox.AnyProcessing(ctx, tx, msgs); err != nil {
				return err
			} else if busy {
				hold = holdInboxProcessing
			}
		}
		if hold != "" {
			rm.hold = hold
			return errKept
		}
		if rm.effects, err = ledger.DeleteOfTask(ctx, tx, id); err != nil {
			return err
		}
		if rm.outbox, err = outbox.DeleteOfTask(ctx, tx, id); err != nil {
			return err
		}
		ok, err := task.Delete(ctx, tx, id, t.Version)
		if err != nil {
			return err
		}
		if !ok {
			rm.hold = "changed"
			return errKept
		}
		return nil
	})
	if errors.Is(err, errKept) {
		return removed{hold: rm.hold}, nil
	}
	if err != nil {
		return removed{}, fmt.Errorf("remove task %s: %w", id, err)
	}
	return rm, nil
}
