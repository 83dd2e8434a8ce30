package task

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
)

// Retention of whole tasks (issue 13, seed 3.3). A task past the task
// window is removed with everything of it — its input, effects, outbox and
// inbox rows, dead letters, and first its artifacts through the ledger —
// only once nothing can still need it. Hold states that rule, once; the
// reconciler applies it (consumers/reconciler, scanRetention), each
// aggregate's rows removed by its owner.

// Hold reasons: why Hold keeps a task. Stable strings (logs, tests).
const (
	// HoldNotTerminal: the task is queued, running or compensating.
	HoldNotTerminal = "not_terminal"
	// HoldInsideWindow: its last update is younger than the task window.
	HoldInsideWindow = "inside_window"
	// HoldIdempotencyRecord: an idempotency record still names it (the key
	// must never outlive its task: a replay would answer a task that is
	// gone). The record goes first, after its own window
	// (idempotency.Purge).
	HoldIdempotencyRecord = "idempotency_record"
	// HoldUnpublishedEvent: an outbox event of it is neither published nor
	// parked and decided.
	HoldUnpublishedEvent = "unpublished_event"
	// HoldDeadLetter: a dead letter of it waits for a person (parked or
	// refused): a replay may re-open it.
	HoldDeadLetter = "undecided_dead_letter"
	// HoldEffect: an artifact.put or artifact.hide of it is not settled
	// (planned, started, unknown, completed, compensation_required): the
	// reconciler's effect scans resolve it first.
	HoldEffect = "unsettled_effect"
	// HoldArtifact: only its artifacts are left — an artifact.put whose
	// object may be in the store without a verified artifact.delete
	// (ledger.UndeletedOf). Not a reason to keep the task: the reconciler
	// deletes them (ledger.DeleteArtifacts), then removes the rows.
	HoldArtifact = "artifact_not_deleted"
)

// Cursor is a position in the retention scan's walk over terminal tasks:
// the (updated_at, task_id) of the last task returned. The zero Cursor is
// the start.
type Cursor struct {
	UpdatedAt time.Time
	TaskID    string
}

// Expired returns the ids of at most limit terminal tasks (completed,
// failed, compensated, cancelled) last updated more than olderThan ago and
// after cursor after, oldest update first, and the cursor of the last one
// (after itself when none). A caller walks the tasks it keeps by passing
// the returned cursor, and starts again from the zero Cursor when fewer
// than limit came back. Through task_terminal_updated_idx (migration
// 00012), which holds terminal tasks only.
func Expired(ctx context.Context, q dbpool.Querier, olderThan time.Duration, after Cursor, limit int) ([]string, Cursor, error) {
	rows, err := q.Query(ctx, `
SELECT task_id, updated_at FROM task
WHERE `+sqlExpired+`
  AND (updated_at, task_id) > ($2, $3)
ORDER BY updated_at, task_id
LIMIT $4`, olderThan.Seconds(), after.UpdatedAt, after.TaskID, limit)
	if err != nil {
		return nil, after, fmt.Errorf("select expired tasks: %w", err)
	}
	defer rows.Close()
	var ids []string
	next := after
	for rows.Next() {
		if err := rows.Scan(&next.TaskID, &next.UpdatedAt); err != nil {
			return nil, after, fmt.Errorf("read expired tasks: %w", err)
		}
		ids = append(ids, next.TaskID)
	}
	if err := rows.Err(); err != nil {
		return nil, after, fmt.Errorf("read expired tasks: %w", err)
	}
	return ids, next, nil
}

// sqlExpired is the condition on task of the terminal tasks last updated
// more than $1 seconds ago (Expired, CountExpired): the predicate of
// task_terminal_updated_idx (migration 00012) and its key.
const sqlExpired = `status IN ('completed', 'failed', 'compensated', 'cancelled') AND updated_at < now() - make_interval(secs => $1)`

// CountExpired counts the terminal tasks last updated more than olderThan
// ago, up to limit (through task_terminal_updated_idx: at most limit index
// entries read): the tasks retention has not removed yet, kept for a
// reason (Hold) or not reached yet. The reconciler exports it after each
// pass, so that a retention falling behind shows.
func CountExpired(ctx context.Context, q dbpool.Querier, olderThan time.Duration, limit int) (int, error) {
	var n int
	err := q.QueryRow(ctx, `
SELECT count(*) FROM (SELECT 1 FROM task WHERE `+sqlExpired+` LIMIT $2) x`, olderThan.Seconds(), limit).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count expired tasks: %w", err)
	}
	return n, nil
}

// Hold reports why task id must be kept past the task window olderThan
// (one of the Hold* reasons, the first that applies in their order above),
// or "" when every row of it may be removed; found is false when the task
// does not exist. Inbox rows are the inbox's to judge (inbox.ProcessingOf
// on the task's outbox ids). Under locks on the task's rows (Lock), the
// answer holds until the transaction ends for everything but rows inserted
// meanwhile, which none of converge's writers inserts for a settled task.
func Hold(ctx context.Context, q dbpool.Querier, id string, olderThan time.Duration) (reason string, found bool, err error) {
	holds, err := Holds(ctx, q, []string{id}, olderThan)
	if err != nil {
		return "", false, err
	}
	reason, found = holds[id]
	return reason, found, nil
}

// Holds is Hold for each of ids in one statement: the reason each task
// that exists must be kept ("" when every row of it may be removed); a task
// that does not exist has no entry. The reconciler's retention reads a
// batch of expired tasks with it, and again under the batch's locks. Each
// question is a subquery with LIMIT 1, looked up by the task's id: written
// as EXISTS, the planner could hash the whole table's answer instead (it
// did for idempotency_record, every row of its index read per batch;
// TestPassReadsOnlyWhatItLooksFor).
func Holds(ctx context.Context, q dbpool.Querier, ids []string, olderThan time.Duration) (map[string]string, error) {
	holds := make(map[string]string, len(ids))
	if len(ids) == 0 {
		return holds, nil
	}
	rows, err := q.Query(ctx, `
SELECT t.task_id, t.status, t.updated_at < now() - make_interval(secs => $2),
  (SELECT true FROM idempotency_record ir WHERE ir.task_id = t.task_id LIMIT 1) IS NOT NULL,
  (SELECT true FROM outbox_event o WHERE o.aggregate_id = t.task_id AND outbox_published_at(o) IS NULL AND o.decision IS NULL LIMIT 1) IS NOT NULL,
  (SELECT true FROM dead_letter d WHERE d.task_id = t.task_id AND d.state IN ('parked', 'refused') LIMIT 1) IS NOT NULL,
  (SELECT true FROM effect_ledger e WHERE e.task_id = t.task_id AND e.effect_kind IN ('artifact.put', 'artifact.hide')
          AND e.state NOT IN ('verified', 'compensated', 'failed') LIMIT 1) IS NOT NULL,
  (SELECT true FROM effect_ledger p WHERE p.task_id = t.task_id AND p.effect_kind = 'artifact.put' AND p.state <> 'failed'
          AND NOT EXISTS (SELECT 1 FROM effect_ledger d WHERE d.effect_id = 'delete-for-' || p.effect_id
                          AND d.effect_kind = 'artifact.delete' AND d.state = 'verified') LIMIT 1) IS NOT NULL
FROM task t WHERE t.task_id = ANY($1)`, ids, olderThan.Seconds())
	if err != nil {
		return nil, fmt.Errorf("read retention of %d tasks: %w", len(ids), err)
	}
	var (
		id, status                                     string
		old, keyed, unpublished, deadLetter, unsettled bool
		undeleted                                      bool
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &old, &keyed, &unpublished, &deadLetter, &unsettled, &undeleted}, func() error {
		var reason string
		switch {
		case status != "completed" && status != "failed" && status != "compensated" && status != "cancelled":
			reason = HoldNotTerminal
		case !old:
			reason = HoldInsideWindow
		case keyed:
			reason = HoldIdempotencyRecord
		case unpublished:
			reason = HoldUnpublishedEvent
		case deadLetter:
			reason = HoldDeadLetter
		case unsettled:
			reason = HoldEffect
		case undeleted:
			reason = HoldArtifact
		}
		holds[id] = reason
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read retention of %d tasks: %w", len(ids), err)
	}
	return holds, nil
}

// LockAll locks the tasks of ids that exist (FOR UPDATE, in task id order,
// so that two batches lock their common tasks in the same order) and
// returns each one's version: the retention batch's compare-and-set
// (DeleteAll).
func LockAll(ctx context.Context, q dbpool.Querier, ids []string) (map[string]int64, error) {
	rows, err := q.Query(ctx, `SELECT task_id, version FROM task WHERE task_id = ANY($1) ORDER BY task_id FOR UPDATE`, ids)
	if err != nil {
		return nil, fmt.Errorf("lock %d tasks: %w", len(ids), err)
	}
	versions := make(map[string]int64, len(ids))
	var id string
	var v int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &v}, func() error { versions[id] = v; return nil }); err != nil {
		return nil, fmt.Errorf("lock %d tasks: %w", len(ids), err)
	}
	return versions, nil
}

// DeleteAll removes each task of versions (task id -> version), terminal,
// with its input (task_input), and returns how many tasks it removed: a
// task that moved since it was read keeps its row (a compare-and-set), but
// its input is removed with the others', so call it only on tasks locked at
// these versions (LockAll), in the transaction that checked Holds and first
// removed every row that references them (effects, idempotency records:
// their foreign keys refuse otherwise).
func DeleteAll(ctx context.Context, q dbpool.Querier, versions map[string]int64) (int64, error) {
	if len(versions) == 0 {
		return 0, nil
	}
	ids := make([]string, 0, len(versions))
	vs := make([]int64, 0, len(versions))
	for id, v := range versions {
		ids = append(ids, id)
		vs = append(vs, v)
	}
	if _, err := q.Exec(ctx, `DELETE FROM task_input WHERE task_id = ANY($1)`, ids); err != nil {
		return 0, fmt.Errorf("delete inputs of %d tasks: %w", len(ids), err)
	}
	// The tasks are named by their primary key (ANY); a join with the
	// (id, version) pairs let the planner hash the whole table instead.
	tag, err := q.Exec(ctx, `
DELETE FROM task t
WHERE t.task_id = ANY($1::text[]) AND t.version = ($2::bigint[])[array_position($1::text[], t.task_id)]
  AND t.status IN ('completed', 'failed', 'compensated', 'cancelled')`, ids, vs)
	if err != nil {
		return 0, fmt.Errorf("delete %d tasks: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}
