package deadletter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// All SQL of the dead-letter store. State changes are compare-and-sets on
// rows locked in the transaction (FOR UPDATE) or on their version.

type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ querier = pgx.Tx(nil)
	_ querier = (*pgxpool.Pool)(nil)
)

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
WHERE ($1 = '' OR error_code = $1) AND (cardinality($2::text[]) = 0 OR state = ANY($2)) AND ($3 = '' OR task_id = $3)
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

func get(ctx context.Context, q querier, id int64, lock string) (DeadLetter, error) {
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
type taskState struct {
	Status  string
	Version int64
	Code    *string
}

func lockTask(ctx context.Context, q querier, taskID string) (taskState, bool, error) {
	var t taskState
	err := q.QueryRow(ctx, `SELECT status, version, terminal_error_code FROM task WHERE task_id = $1 FOR UPDATE`, taskID).Scan(&t.Status, &t.Version, &t.Code)
	if errors.Is(err, pgx.ErrNoRows) {
		return t, false, nil
	}
	if err != nil {
		return t, false, fmt.Errorf("lock task %s: %w", taskID, err)
	}
	return t, true, nil
}

// reopenTask moves a task failed at version back to queued (version+1, no
// terminal error code); false when it changed meanwhile.
func reopenTask(ctx context.Context, q querier, taskID string, version int64) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE task SET status = 'queued', version = version + 1, terminal_error_code = NULL, updated_at = now()
WHERE task_id = $1 AND status = 'failed' AND version = $2`, taskID, version)
	if err != nil {
		return false, fmt.Errorf("reopen task %s: %w", taskID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// resetInbox makes a failed inbox row processing again so that the
// replayed message is processed, not taken as a duplicate.
func resetInbox(ctx context.Context, q querier, consumer, messageID string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE inbox_message SET state = 'processing', result_json = NULL, completed_at = NULL, last_seen_at = now()
WHERE consumer_name = $1 AND message_id = $2 AND state = 'failed'`, consumer, messageID)
	if err != nil {
		return false, fmt.Errorf("reset inbox message %s: %w", messageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// recordReplay writes the outcome of a replay request on a locked dead
// letter: new state, replay_count + inc, who/when/why.
func recordReplay(ctx context.Context, q querier, id int64, state string, inc int, by, reason, outcome string) error {
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
