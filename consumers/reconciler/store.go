package reconciler

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/dbpool"
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
// are still published or decided and of which no inbox row is processing:
// the inbox first, the order of the project's transactions (package
// inbox). A processing row is a delivery whose outcome is not durable yet;
// its outbox row stays, so that the inbox scan still finds the row's task
// (and releases it once the task is terminal) and task retention still
// finds the row. It returns how many inbox rows it removed and the ids of
// the outbox rows it removed.
func purgeOutbox(ctx context.Context, db *pgxpool.Pool, ids []string) (inboxRows int64, outboxRows []string, err error) {
	if len(ids) == 0 {
		return 0, nil, nil
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		if inboxRows, err = inbox.DeleteMessages(ctx, tx, ids); err != nil {
			return err
		}
		// What is left of those inbox rows is processing.
		busy, err := inbox.ProcessingOf(ctx, tx, ids)
		if err != nil {
			return err
		}
		outboxRows, err = outbox.DeletePurgeable(ctx, tx, slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return busy[id] }))
		return err
	})
	if err != nil {
		return 0, nil, err
	}
	return inboxRows, outboxRows, nil
}

// removed is what removeTasks did: the tasks it removed, the reasons it
// kept the others (task.Hold's, holdInboxProcessing, or "not_found"), and
// the rows it removed with the removed ones.
type removed struct {
	tasks                               []string
	kept                                map[string]string
	deadLetters, inbox, effects, outbox int64
}

// add counts o's tasks and rows in rm.
func (rm *removed) add(o removed) {
	rm.tasks = append(rm.tasks, o.tasks...)
	maps.Copy(rm.kept, o.kept)
	rm.deadLetters += o.deadLetters
	rm.inbox += o.inbox
	rm.effects += o.effects
	rm.outbox += o.outbox
}

// removeTasks removes the tasks of ids, and every row of each, in one
// transaction, taking the order the project's transactions lock rows
// (dead letters, as a replay does; inbox; task; effects; outbox): it locks
// their dead letters, the inbox rows of their events and of their dead
// letters' messages (a replay may deliver one after the outbox window
// removed its outbox row) and the tasks, then reads
// task.Holds again, and whether an inbox row of their events is
// processing, under those locks — a task whose answer is no longer "" (it
// or one of its rows changed since the pass read it) is kept, with the
// reason — and removes the others': their resolved and replayed dead
// letters, inbox rows, effects, outbox rows, inputs and the tasks
// themselves (task.DeleteAll, a compare-and-set on the versions locked).
// One transaction per batch: a batch of tasks costs a few statements and
// one commit, not a transaction of ten statements per task (issue 11).
func removeTasks(ctx context.Context, db *pgxpool.Pool, ids []string, olderThan time.Duration) (removed, error) {
	var rm removed
	if len(ids) == 0 {
		return rm, nil
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		rm = removed{kept: map[string]string{}}
		msgs, err := taskMessages(ctx, tx, ids, deadletter.LockOfTasks)
		if err != nil {
			return err
		}
		if err := inbox.LockMessages(ctx, tx, messagesOf(msgs, ids)); err != nil {
			return err
		}
		versions, err := task.LockAll(ctx, tx, ids)
		if err != nil {
			return err
		}
		holds, err := task.Holds(ctx, tx, ids, olderThan)
		if err != nil {
			return err
		}
		busy, err := inbox.ProcessingOf(ctx, tx, messagesOf(msgs, ids))
		if err != nil {
			return err
		}
		gone := map[string]int64{}
		for _, id := range ids {
			_, found := versions[id]
			switch {
			case !found:
				rm.kept[id] = "not_found"
			case holds[id] != "":
				rm.kept[id] = holds[id]
			case anyBusy(msgs[id], busy):
				rm.kept[id] = holdInboxProcessing
			default:
				gone[id] = versions[id]
				rm.tasks = append(rm.tasks, id)
			}
		}
		if len(rm.tasks) == 0 {
			return nil
		}
		if rm.deadLetters, err = deadletter.DeleteOfTasks(ctx, tx, rm.tasks); err != nil {
			return err
		}
		if rm.inbox, err = inbox.DeleteMessages(ctx, tx, messagesOf(msgs, rm.tasks)); err != nil {
			return err
		}
		if rm.effects, err = ledger.DeleteOfTasks(ctx, tx, rm.tasks); err != nil {
			return err
		}
		if rm.outbox, err = outbox.DeleteOfTasks(ctx, tx, rm.tasks); err != nil {
			return err
		}
		n, err := task.DeleteAll(ctx, tx, gone)
		if err != nil {
			return err
		}
		if n != int64(len(gone)) {
			// Locked at these versions, so it cannot happen; if it does,
			// nothing of the batch is removed.
			return fmt.Errorf("%d of %d tasks changed under their locks", int64(len(gone))-n, len(gone))
		}
		return nil
	})
	if err != nil {
		return removed{}, fmt.Errorf("remove %d tasks: %w", len(ids), err)
	}
	return rm, nil
}

// anyBusy reports whether one of a task's messages is processing (busy:
// inbox.ProcessingOf).
func anyBusy(messages []string, busy map[string]bool) bool {
	return slices.ContainsFunc(messages, func(m string) bool { return busy[m] })
}

// taskMessages returns each task of ids' message ids (task id -> ids; a
// task without messages has no entry): its outbox rows' ids, and the ids
// its dead letters hold, read by deadLetters (deadletter.MessagesOfTasks,
// or LockOfTasks, which also locks them). A replay after the outbox window
// delivers a message that no outbox row names any more, and its inbox row
// is found through the dead letter.
func taskMessages(ctx context.Context, q dbpool.Querier, ids []string,
	deadLetters func(context.Context, dbpool.Querier, []string) (map[string][]string, error)) (map[string][]string, error) {
	msgs, err := outbox.IDsOfTasks(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	replayed, err := deadLetters(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	for id, m := range replayed {
		for _, msg := range m {
			if !slices.Contains(msgs[id], msg) {
				msgs[id] = append(msgs[id], msg)
			}
		}
	}
	return msgs, nil
}

// messagesOf is the message ids of the tasks of ids, from msgs (task id ->
// its outbox ids).
func messagesOf(msgs map[string][]string, ids []string) []string {
	var all []string
	for _, id := range ids {
		all = append(all, msgs[id]...)
	}
	return all
}

// retentionLockClass is the first key of the session advisory locks by
// which reconcilers claim the tasks they remove (claimTasks): "conv". The
// two-key advisory locks do not conflict with the one-key ones (goose's
// migration lock).
const retentionLockClass = 0x636f6e76

// claim is a set of tasks claimed for removal on one connection.
type claim struct {
	ids  []string
	conn *pgxpool.Conn
}

// claimTasks takes, on a connection of its own, a session advisory lock
// for each task of ids that no other reconciler holds
// (pg_try_advisory_lock(retentionLockClass, hashtext(task id)): never
// waits) and returns the tasks it locked, which release gives up. The locks
// only spread the work: every removal still takes its row locks and checks
// its rows again under them (removeTasks), so a claim that is lost (a
// collision of hashes, a connection that dies) costs time, never a row.
// The connection is held for the batch (a lock left on a pooled connection
// would outlive the batch), so a pool of one connection, which the batch
// itself needs, claims nothing and takes every task as before.
func claimTasks(ctx context.Context, db *pgxpool.Pool, ids []string) (claim, error) {
	if db.Stat().MaxConns() < 2 {
		return claim{ids: ids}, nil
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		return claim{}, fmt.Errorf("claim %d expired tasks: %w", len(ids), err)
	}
	rows, err := conn.Query(ctx, `SELECT id FROM unnest($1::text[]) id WHERE pg_try_advisory_lock($2, hashtext(id))`, ids, retentionLockClass)
	var claimed []string
	if err == nil {
		claimed, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	c := claim{ids: claimed, conn: conn}
	if err != nil {
		c.release()
		return claim{}, fmt.Errorf("claim %d expired tasks: %w", len(ids), err)
	}
	return c, nil
}

// release gives up the claim's locks and its connection. A connection
// whose locks could not be given up is closed (which gives them up), not
// returned to the pool.
func (c claim) release() {
	if c.conn == nil {
		return
	}
	defer c.conn.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`); err != nil {
		_ = c.conn.Conn().Close(ctx)
	}
}
