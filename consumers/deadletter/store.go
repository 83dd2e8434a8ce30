package deadletter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/dbpool"
)

// All SQL of the dead-letter store. State changes are compare-and-sets on
// rows locked in the transaction (FOR UPDATE) or on their version. The
// rows of other aggregates a replay changes (task, inbox, outbox) are
// written through their owners (packages task, inbox, outbox).

// Store reads and writes the dead_letter table.
type Store struct {
	pool *pgxpool.Pool
}

// NewStore returns a Store on pool.
func NewStore(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

const columns = `dead_letter_id, origin_topic, origin_partition, origin_offset, consumer_group, record_key, record_value,
record_headers, message_id, task_id, error_class, error_code, error_message, attempts, processor_version,
first_failure_at, last_failure_at, dlq_partition, dlq_offset, state, replay_count, last_replay_at, last_replay_by,
last_replay_reason, last_replay_outcome, recorded_at, updated_at`

func scan(row pgx.Row) (DeadLetter, error) {
	var d DeadLetter
	var hdr []byte
	err := row.Scan(&d.ID, &d.OriginTopic, &d.OriginPartition, &d.OriginOffset, &d.ConsumerGroup, &d.Key, &d.Value,
		&hdr, &d.MessageID, &d.TaskID, &d.ErrorClass, &d.ErrorCode, &d.ErrorMessage, &d.Attempts, &d.ProcessorVersion,
		&d.FirstFailureAt, &d.LastFailureAt, &d.DLQPartition, &d.DLQOffset, &d.State, &d.ReplayCount, &d.LastReplayAt,
		&d.LastReplayBy, &d.LastReplayReason, &d.LastReplayOutcome, &d.RecordedAt, &d.UpdatedAt)
	if err != nil {
		return d, err
	}
	if err := json.Unmarshal(hdr, &d.Headers); err != nil {
		return d, fmt.Errorf("decode headers of dead letter %d: %w", d.ID, err)
	}
	return d, nil
}

// Insert records d unless its origin (topic, partition, offset) is already
// recorded; it reports whether a row was inserted.
func (s *Store) Insert(ctx context.Context, d DeadLetter) (bool, error) {
	hdr, err := json.Marshal(d.Headers)
	if err != nil {
		return false, fmt.Errorf("encode dead letter headers: %w", err)
	}
	tag, err := s.pool.Exec(ctx, `
INSERT INTO dead_letter (origin_topic, origin_partition, origin_offset, consumer_group, record_key, record_value,
  record_headers, message_id, task_id, error_class, error_code, error_message, attempts, processor_version,
  first_failure_at, last_failure_at, dlq_partition, dlq_offset)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)
ON CONFLICT (origin_topic, origin_partition, origin_offset) DO NOTHING`,
		d.OriginTopic, d.OriginPartition, d.OriginOffset, d.ConsumerGroup, d.Key, d.Value, string(hdr), d.MessageID, d.TaskID,
		d.ErrorClass, d.ErrorCode, d.ErrorMessage, d.Attempts, d.ProcessorVersion, d.FirstFailureAt, d.LastFailureAt,
		d.DLQPartition, d.DLQOffset)
	if err != nil {
		return false, fmt.Errorf("insert dead letter %s/%d/%d: %w", d.OriginTopic, d.OriginPartition, d.OriginOffset, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Filter selects dead letters for List. Zero values select everything.
type Filter struct {
	// Code keeps dead letters with this error code.
	Code string
	// States keeps dead letters in one of these states.
	States []string
	// TaskID keeps the dead letters of one task.
	TaskID string
	// Limit bounds the rows returned. Defaults to 100.
	Limit int
}

// List returns dead letters matching f, oldest first.
func (s *Store) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := s.pool.Query(ctx, `
SELECT `+columns+` FROM dead_letter
WHERE ($1 = '' OR error_code = $1) AND (COALESCE(cardinality($2::text[]), 0) = 0 OR state = ANY($2)) AND ($3 = '' OR task_id = $3)
ORDER BY dead_letter_id
LIMIT $4`, f.Code, f.States, f.TaskID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) { return scan(r) })
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	return out, nil
}

// Get returns dead letter id, or ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (DeadLetter, error) {
	return get(ctx, s.pool, id, "")
}

func get(ctx context.Context, q dbpool.Querier, id int64, lock string) (DeadLetter, error) {
	d, err := scan(q.QueryRow(ctx, `SELECT `+columns+` FROM dead_letter WHERE dead_letter_id = $1 `+lock, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return d, fmt.Errorf("dead letter %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return d, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	return d, nil
}

// Unresolved counts dead letters that need a person: parked or refused.
func (s *Store) Unresolved(ctx context.Context) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM dead_letter WHERE state IN ('parked', 'refused')`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count unresolved dead letters: %w", err)
	}
	return n, nil
}

// taskState is what a replay needs of the dead letter's task.
// lockTaskDeadLetters locks every dead letter of the task of dead letter
// id — of its message when it names no task — in id order, so concurrent
// replays never deadlock, and returns how many times they were replayed in
// all. A replay that fails again is dead-lettered anew under new origin
// offsets, twice: the re-published original record and the
// TaskRedriveRequested event the replay wrote (another message id), so
// MaxReplays bounds the task, not one of its dead letters or messages.
func lockTaskDeadLetters(ctx context.Context, q dbpool.Querier, id int64) (int, error) {
	var n int
	err := q.QueryRow(ctx, `
WITH m AS (SELECT task_id, message_id FROM dead_letter WHERE dead_letter_id = $1),
locked AS (
  SELECT d.dead_letter_id, d.replay_count FROM dead_letter d, m
  WHERE d.dead_letter_id = $1
     OR (m.task_id IS NOT NULL AND d.task_id = m.task_id)
     OR (m.task_id IS NULL AND m.message_id IS NOT NULL AND d.message_id = m.message_id)
  ORDER BY d.dead_letter_id FOR UPDATE OF d)
SELECT COALESCE(sum(replay_count), 0)::int FROM locked`, id).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("lock dead letters of the task of %d: %w", id, err)
	}
	return n, nil
}

// Resolved is a dead letter ResolveCompleted resolved.
type Resolved struct {
	ID     int64
	TaskID string
	// From is the state it left (parked or refused).
	From string
}

// ResolvedBy is recorded as last_replay_by of the dead letters
// ResolveCompleted resolves.
const ResolvedBy = "reconciler"

// ResolveCompleted resolves at most limit dead letters, oldest first, that
// wait for a person (parked or refused) although their task has completed
// since (by another route: a later delivery, a replay of another dead
// letter of the task): nothing is left to replay. A completed task is
// never re-opened, so the decision cannot go stale; rows locked by a
// concurrent replay are skipped (the replay resolves them itself, or a
// later call does). who/when/why are recorded as for a replay request.
func (s *Store) ResolveCompleted(ctx context.Context, limit int) ([]Resolved, error) {
	rows, err := s.pool.Query(ctx, `
WITH c AS (
  SELECT d.dead_letter_id, d.state FROM dead_letter d JOIN task t ON t.task_id = d.task_id
  WHERE d.state IN ('parked', 'refused') AND t.status = 'completed'
  ORDER BY d.dead_letter_id LIMIT $1
  FOR UPDATE OF d SKIP LOCKED)
UPDATE dead_letter d SET state = 'resolved', last_replay_at = now(), last_replay_by = $2,
  last_replay_reason = 'task completed',
  last_replay_outcome = 'task ' || d.task_id || ' is already completed; nothing to replay (resolved by the reconciler)',
  updated_at = now()
FROM c WHERE d.dead_letter_id = c.dead_letter_id
RETURNING d.dead_letter_id, d.task_id, c.state`, limit, ResolvedBy)
	if err != nil {
		return nil, fmt.Errorf("resolve dead letters of completed tasks: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Resolved, error) {
		var v Resolved
		err := r.Scan(&v.ID, &v.TaskID, &v.From)
		return v, err
	})
	if err != nil {
		return nil, fmt.Errorf("resolve dead letters of completed tasks: %w", err)
	}
	return out, nil
}

// recordReplay writes the outcome of a replay (or resolve) request on a
// locked dead letter: new state, replay_count + inc, who/when/why. The row
// keeps the last request only; every request is also logged.
func recordReplay(ctx context.Context, q dbpool.Querier, id int64, state string, inc int, by, reason, outcome string) error {
	_, err := q.Exec(ctx, `
UPDATE dead_letter SET state = $2, replay_count = replay_count + $3, last_replay_at = now(), last_replay_by = $4,
  last_replay_reason = $5, last_replay_outcome = $6, updated_at = now()
WHERE dead_letter_id = $1`, id, state, inc, by, reason, outcome)
	if err != nil {
		return fmt.Errorf("record replay of dead letter %d: %w", id, err)
	}
	return nil
}

// replayable returns the ids of dead letters a bulk replay considers
// (parked, optionally of one code), oldest first. A replayed dead letter
// whose redelivery failed again is parked anew under its new origin offset.
func (s *Store) replayable(ctx context.Context, code string, limit int) ([]int64, error) {
	rows, err := s.pool.Query(ctx, `
SELECT dead_letter_id FROM dead_letter
WHERE state = 'parked' AND ($1 = '' OR error_code = $1)
ORDER BY dead_letter_id LIMIT $2`, code, limit)
	if err != nil {
		return nil, fmt.Errorf("select replayable dead letters: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// DeleteOrphans removes at most limit dead letters that no longer wait for
// anyone (resolved, replayed) and belong to no task — none named (a record
// without a task id), or one that does not exist (forged, never created,
// or removed) — last updated more than olderThan ago (the task window:
// issue 13, "nothing grows forever"), and returns how many. Parked and
// refused ones are never removed: a person decides.
func DeleteOrphans(ctx context.Context, q dbpool.Querier, olderThan time.Duration, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `
DELETE FROM dead_letter WHERE dead_letter_id IN (
  SELECT d.dead_letter_id FROM dead_letter d
  WHERE d.state IN ('resolved', 'replayed') AND d.updated_at < now() - make_interval(secs => $1)
    AND (d.task_id IS NULL OR NOT EXISTS (SELECT 1 FROM task t WHERE t.task_id = d.task_id))
  ORDER BY d.dead_letter_id LIMIT $2)`, olderThan.Seconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("delete orphan dead letters: %w", err)
	}
	return tag.RowsAffected(), nil
}

// DeleteOfTasks removes the dead letters of the tasks of taskIDs that no longer wait
// for anyone — resolved, or replayed (a replay that failed again was
// recorded as a new dead letter) — and returns how many: the retention of
// the task (issue 13), which keeps a task while one of its dead letters is
// parked or refused (task.Hold). A dead letter of a removed task could
// only re-publish a record about a task that is gone, and its value holds
// the task's data, so it goes with the task. Parked and refused ones are
// never removed. One statement for the whole batch.
func DeleteOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (int64, error) {
	if len(taskIDs) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, `DELETE FROM dead_letter WHERE task_id = ANY($1) AND state IN ('resolved', 'replayed')`, taskIDs)
	if err != nil {
		return 0, fmt.Errorf("delete dead letters of %d tasks: %w", len(taskIDs), err)
	}
	return tag.RowsAffected(), nil
}

// LockOfTasks locks the dead letters of the tasks of taskIDs (FOR UPDATE),
// as a replay or a resolution does before it
// locks the task: the retention of a batch of tasks takes the project's
// lock order (dead letters, inbox, task) before it reads which of them it
// may remove. It returns MessagesOfTasks' answer, read under the locks.
func LockOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (map[string][]string, error) {
	return messagesOfTasks(ctx, q, taskIDs, " FOR UPDATE")
}

// MessagesOfTasks returns, for each task of taskIDs with dead letters, the
// message ids they hold (those with one): a replay delivers its message
// again, maybe after retention removed the message's outbox row, so the
// inbox row that delivery leaves is found through the dead letter.
func MessagesOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (map[string][]string, error) {
	return messagesOfTasks(ctx, q, taskIDs, "")
}

func messagesOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string, lock string) (map[string][]string, error) {
	msgs := map[string][]string{}
	if len(taskIDs) == 0 {
		return msgs, nil
	}
	// Planned with the ids (pgx.QueryExecModeExec), through the index on
	// task_id, in its order: an ORDER BY dead_letter_id walked the whole
	// primary key instead.
	rows, err := q.Query(ctx, `SELECT task_id, message_id FROM dead_letter WHERE task_id = ANY($1)`+lock, pgx.QueryExecModeExec, taskIDs)
	if err != nil {
		return nil, fmt.Errorf("read the dead letters of %d tasks: %w", len(taskIDs), err)
	}
	var task string
	var msg *string
	if _, err := pgx.ForEachRow(rows, []any{&task, &msg}, func() error {
		if msg != nil {
			msgs[task] = append(msgs[task], *msg)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("read the dead letters of %d tasks: %w", len(taskIDs), err)
	}
	return msgs, nil
}
