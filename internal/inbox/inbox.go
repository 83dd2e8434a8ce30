package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/dbpool"
)

// State is inbox_message.state (seed 6).
type State string

// The states of a delivery.
const (
	// Processing: registered, outcome not durable yet (a delivery that
	// stopped mid-way is resumed by the next one).
	Processing State = "processing"
	// Completed: the outcome is durable; a redelivery is a duplicate.
	Completed State = "completed"
	// Failed: a deterministic failure is durable (the record was
	// dead-lettered); a redelivery is a duplicate.
	Failed State = "failed"
)

// Row is a registered message.
type Row struct {
	PayloadSHA256 string
	State         State
	// LockedBy is the lease holder (Lease.Owner) of a Processing message,
	// "" when it has none; LeaseLive reports whether its lease has not
	// expired yet (by the database's clock) and LockedUntil when it does.
	LockedBy    string
	LeaseLive   bool
	LockedUntil time.Time
}

// Lease is the lease a delivery takes on a message it processes (seed 6:
// a processing message whose lease has not expired is not processed
// concurrently). Owner names one worker instance (unique per process and
// Worker); For is how long the lease lasts, from the statement's now():
// the worker uses its attempt bound, so the holder's attempt has ended
// before another instance may take the message over.
type Lease struct {
	Owner string
	For   time.Duration
}

// Register inserts message id of consumer in state Processing with its
// payload hash, leased to l. It returns false when the identity is already
// registered: the primary key (consumer_name, message_id) decides, never a
// prior read (seed 6).
func Register(ctx context.Context, q dbpool.Querier, consumer, id, payloadSHA256 string, l Lease) (bool, error) {
	tag, err := q.Exec(ctx, sqlRegister, consumer, id, payloadSHA256, l.Owner, l.For.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("insert inbox message %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

const sqlRegister = `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, locked_by, locked_until)
VALUES ($1, $2, $3, 'processing', $4, now() + $5::bigint * interval '1 millisecond')
ON CONFLICT (consumer_name, message_id) DO NOTHING`

// QueueRegister queues Register on b; inserted is set when the batch's
// results are read.
func QueueRegister(b *pgx.Batch, consumer, id, payloadSHA256 string, l Lease, inserted *bool) {
	b.Queue(sqlRegister, consumer, id, payloadSHA256, l.Owner, l.For.Milliseconds()).Exec(func(tag pgconn.CommandTag) error {
		*inserted = tag.RowsAffected() == 1
		return nil
	})
}

// ErrLeaseHeld is wrapped by the error of Acquire when another owner's
// lease on the message is live: the delivery must not process it now
// (seed 6), but may try again later — the holder finishes it (a redelivery
// is then a duplicate) or its lease expires.
var ErrLeaseHeld = errors.New("inbox message is leased to another consumer instance")

// LeaseHeldError is the error of Acquire for a live lease of another owner.
type LeaseHeldError struct {
	MessageID string
	Owner     string    // the holder
	Until     time.Time // when the lease expires
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("inbox message %s is leased to %s until %s", e.MessageID, e.Owner, e.Until.UTC().Format(time.RFC3339Nano))
}

// Unwrap returns ErrLeaseHeld.
func (e *LeaseHeldError) Unwrap() error { return ErrLeaseHeld }

// Acquire takes the lease of a registered message that row (read by Lock
// in this transaction) shows Processing, for a delivery that resumes it:
// when the message has no lease, an expired one, or one of l.Owner (a
// retry by the same instance), the lease becomes l and the delivery is
// counted (as Touch); when another owner's lease is live, nothing changes
// and the error is a *LeaseHeldError (errors.Is ErrLeaseHeld).
func Acquire(ctx context.Context, q dbpool.Querier, consumer, id string, row Row, l Lease) error {
	if row.LeaseLive && row.LockedBy != l.Owner {
		return &LeaseHeldError{MessageID: id, Owner: row.LockedBy, Until: row.LockedUntil}
	}
	_, err := q.Exec(ctx, `
UPDATE inbox_message SET deliveries = deliveries + 1, last_seen_at = now(),
  locked_by = $3, locked_until = now() + $4::bigint * interval '1 millisecond'
WHERE consumer_name = $1 AND message_id = $2`, consumer, id, l.Owner, l.For.Milliseconds())
	if err != nil {
		return fmt.Errorf("lease inbox message %s: %w", id, err)
	}
	return nil
}

// ReleaseLease ends owner's lease on message id if it is still Processing
// under it (a compare-and-set on locked_by): the worker calls it when it
// gives a record up unfinished (Run stopping, its partition revoked), so
// the instance that receives the record next resumes it at once instead of
// waiting for the lease to expire. It reports whether a lease was ended.
func ReleaseLease(ctx context.Context, q dbpool.Querier, consumer, id, owner string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE inbox_message SET locked_until = NULL
WHERE consumer_name = $1 AND message_id = $2 AND state = 'processing' AND locked_by = $3 AND locked_until IS NOT NULL`,
		consumer, id, owner)
	if err != nil {
		return false, fmt.Errorf("release lease of inbox message %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Lock reads a registered message and locks it until the transaction ends,
// so concurrent deliveries of one message (and a dead-letter replay)
// serialise on it. The error wraps pgx.ErrNoRows when it is not registered.
func Lock(ctx context.Context, q dbpool.Querier, consumer, id string) (Row, error) {
	var (
		r     Row
		by    *string
		until *time.Time
	)
	err := q.QueryRow(ctx, `
SELECT payload_sha256, state, locked_by, locked_until, coalesce(locked_until > now(), false)
FROM inbox_message
WHERE consumer_name = $1 AND message_id = $2
FOR UPDATE`, consumer, id).Scan(&r.PayloadSHA256, &r.State, &by, &until, &r.LeaseLive)
	if err != nil {
		return r, fmt.Errorf("read inbox message %s: %w", id, err)
	}
	if by != nil {
		r.LockedBy = *by
	}
	if until != nil {
		r.LockedUntil = *until
	}
	return r, nil
}

// LockIfExists locks the row of a message when it is registered (found is
// then true), and does nothing otherwise.
func LockIfExists(ctx context.Context, q dbpool.Querier, consumer, id string) (found bool, err error) {
	_, err = Lock(ctx, q, consumer, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// Touch counts one more delivery of a registered message.
func Touch(ctx context.Context, q dbpool.Querier, consumer, id string) error {
	_, err := q.Exec(ctx, `
UPDATE inbox_message SET deliveries = deliveries + 1, last_seen_at = now()
WHERE consumer_name = $1 AND message_id = $2`, consumer, id)
	if err != nil {
		return fmt.Errorf("count delivery of inbox message %s: %w", id, err)
	}
	return nil
}

const sqlFinish = `
UPDATE inbox_message SET state = $3, result_json = $4::jsonb, completed_at = now(), last_seen_at = now()
WHERE consumer_name = $1 AND message_id = $2 AND state = 'processing'`

// Finish moves a message Processing -> to (Completed or Failed) with its
// result summary (JSON-encoded into result_json): a compare-and-set that
// reports false when the row was not processing.
func Finish(ctx context.Context, q dbpool.Querier, consumer, id string, to State, result any) (bool, error) {
	raw, err := json.Marshal(result)
	if err != nil {
		return false, fmt.Errorf("encode inbox result: %w", err)
	}
	tag, err := q.Exec(ctx, sqlFinish, consumer, id, to, string(raw))
	if err != nil {
		return false, fmt.Errorf("finish inbox message %s as %s: %w", id, to, err)
	}
	return tag.RowsAffected() == 1, nil
}

// QueueFinish queues Finish on b; applied is set when the batch's results
// are read.
func QueueFinish(b *pgx.Batch, consumer, id string, to State, result any, applied *bool) error {
	raw, err := json.Marshal(result)
	if err != nil {
		return fmt.Errorf("encode inbox result: %w", err)
	}
	b.Queue(sqlFinish, consumer, id, to, string(raw)).Exec(func(tag pgconn.CommandTag) error {
		*applied = tag.RowsAffected() == 1
		return nil
	})
	return nil
}

// Delivery is where a message was delivered from, recorded with a conflict.
type Delivery struct {
	Consumer, MessageID, PayloadSHA256 string
	Topic                              string
	Partition                          int32
	Offset                             int64
}

// InsertConflict records that message d.MessageID arrived with another
// payload hash than the one registered (storedSHA256): the message identity
// was reused, nothing is processed (seed 6, 13.4). Once per payload hash.
func InsertConflict(ctx context.Context, q dbpool.Querier, d Delivery, storedSHA256 string) error {
	_, err := q.Exec(ctx, `
INSERT INTO inbox_conflict (consumer_name, message_id, payload_sha256, stored_sha256, topic, kafka_partition, kafka_offset)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (consumer_name, message_id, payload_sha256) DO NOTHING`,
		d.Consumer, d.MessageID, d.PayloadSHA256, storedSHA256, d.Topic, d.Partition, d.Offset)
	if err != nil {
		return fmt.Errorf("record inbox conflict for %s: %w", d.MessageID, err)
	}
	return nil
}

// RecordFailure makes a deterministic failure of delivery d durable: a new
// message gets a row in state Failed with {"error_code": code}; a
// registered one in Processing moves to Failed; a registered one with
// another payload hash is a conflict (recorded; conflict is then true).
func RecordFailure(ctx context.Context, q dbpool.Querier, d Delivery, code string) (conflict bool, err error) {
	raw, _ := json.Marshal(map[string]string{"error_code": code})
	tag, err := q.Exec(ctx, `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, result_json, completed_at)
VALUES ($1, $2, $3, 'failed', $4::jsonb, now())
ON CONFLICT (consumer_name, message_id) DO NOTHING`, d.Consumer, d.MessageID, d.PayloadSHA256, string(raw))
	if err != nil {
		return false, fmt.Errorf("record failure of %s: %w", d.MessageID, err)
	}
	if tag.RowsAffected() == 1 {
		return false, nil
	}
	row, err := Lock(ctx, q, d.Consumer, d.MessageID)
	if err != nil {
		return false, err
	}
	if row.PayloadSHA256 != d.PayloadSHA256 {
		return true, InsertConflict(ctx, q, d, row.PayloadSHA256)
	}
	if err := Touch(ctx, q, d.Consumer, d.MessageID); err != nil {
		return false, err
	}
	if row.State == Processing {
		if _, err := Finish(ctx, q, d.Consumer, d.MessageID, Failed, map[string]string{"error_code": code}); err != nil {
			return false, err
		}
	}
	return false, nil
}

// ResetFailed moves a Failed message back to Processing, without a lease,
// so that a replayed record is processed at once, not taken as a
// duplicate (package deadletter).
func ResetFailed(ctx context.Context, q dbpool.Querier, consumer, id string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE inbox_message SET state = 'processing', result_json = NULL, completed_at = NULL, last_seen_at = now(),
  locked_by = NULL, locked_until = NULL
WHERE consumer_name = $1 AND message_id = $2 AND state = 'failed'`, consumer, id)
	if err != nil {
		return false, fmt.Errorf("reset inbox message %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Stale is a message left Processing, with the status of the task its
// message (an outbox event) belongs to; TaskID and TaskStatus are nil when
// the message names no known task.
type Stale struct {
	Consumer   string
	MessageID  string
	LastSeenAt time.Time
	TaskID     *string
	TaskStatus *string
}

// Stales returns at most limit messages Processing with no delivery for
// lease and no live lease of a delivery (Lease), oldest first, that the
// reconciler can finish: their task's status is one of statuses (the
// terminal ones), or their message has no outbox row of a task any more
// (TaskID nil: removed by retention; DeleteStale). Rows of tasks in other states are not returned: left in the
// batch, a hundred of them would hide every other row for ever. It reads
// the processing rows only (inbox_message_processing_idx, migrations 00013
// and 00014: keyed, so every processing row's entry is read and the stale
// ones sorted).
func Stales(ctx context.Context, q dbpool.Querier, lease time.Duration, statuses []string, limit int) ([]Stale, error) {
	rows, err := q.Query(ctx, `
SELECT i.consumer_name, i.message_id, i.last_seen_at, t.task_id, t.status
FROM inbox_message i
LEFT JOIN outbox_event o ON o.outbox_id = i.message_id
LEFT JOIN task t ON t.task_id = o.aggregate_id
WHERE i.state = 'processing' AND i.last_seen_at < now() - make_interval(secs => $1)
  AND (i.locked_until IS NULL OR i.locked_until < now())
  AND (t.task_id IS NULL OR t.status = ANY ($3))
ORDER BY i.last_seen_at
LIMIT $2`, lease.Seconds(), limit, statuses)
	if err != nil {
		return nil, fmt.Errorf("select stale inbox rows: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Stale, error) {
		var r Stale
		err := row.Scan(&r.Consumer, &r.MessageID, &r.LastSeenAt, &r.TaskID, &r.TaskStatus)
		return r, err
	})
}

// Release finishes a stale message whose task is terminal (taskStatus):
// Processing -> Completed, a compare-and-set on state and last_seen_at as
// read, so a delivery seen since keeps the row.
func Release(ctx context.Context, q dbpool.Querier, s Stale, taskStatus string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE inbox_message SET state = 'completed', completed_at = now(),
  result_json = jsonb_build_object('released_by', 'reconciler', 'task_status', $3::text)
WHERE consumer_name = $1 AND message_id = $2 AND state = 'processing' AND last_seen_at = $4`,
		s.Consumer, s.MessageID, taskStatus, s.LastSeenAt)
	if err != nil {
		return false, fmt.Errorf("release inbox row %s: %w", s.MessageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeleteStale removes a stale message whose outbox row, or its task, is
// gone (Stales, TaskID nil): a compare-and-set on state and last_seen_at as
// read, and only while no outbox row of a task names the message.
// Retention removes an inbox row with its outbox row, or with its task; a
// row of a message whose outbox row was removed already (registered by a
// later delivery, such as a dead letter's replay, or left by a version
// before the outbox kept such rows) would otherwise stay processing for
// ever. A replay's message may still belong to a live task: a redelivery
// registers it again, and the effect ledger keeps its effect safe.
func DeleteStale(ctx context.Context, q dbpool.Querier, s Stale) (bool, error) {
	tag, err := q.Exec(ctx, `
DELETE FROM inbox_message i
WHERE i.consumer_name = $1 AND i.message_id = $2 AND i.state = 'processing' AND i.last_seen_at = $3
  AND NOT EXISTS (SELECT FROM outbox_event o JOIN task t ON t.task_id = o.aggregate_id WHERE o.outbox_id = i.message_id)`,
		s.Consumer, s.MessageID, s.LastSeenAt)
	if err != nil {
		return false, fmt.Errorf("delete stale inbox row %s: %w", s.MessageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Conflict is one inbox_conflict row: a message id that arrived with a
// payload hash other than the one its inbox row registered (seed 13.4).
type Conflict struct {
	Consumer      string    `json:"consumer_name"`
	MessageID     string    `json:"message_id"`
	PayloadSHA256 string    `json:"payload_sha256"`
	StoredSHA256  string    `json:"stored_sha256"`
	Topic         string    `json:"topic"`
	Partition     int32     `json:"partition"`
	Offset        int64     `json:"offset"`
	SeenAt        time.Time `json:"seen_at"`
}

// ListConflicts returns at most limit conflicts, newest first (`converge
// inbox conflicts`; the alert ConvergeInboxConflicts points here).
func ListConflicts(ctx context.Context, q dbpool.Querier, limit int) ([]Conflict, error) {
	rows, err := q.Query(ctx, `
SELECT consumer_name, message_id, payload_sha256, stored_sha256, topic, kafka_partition, kafka_offset, seen_at
FROM inbox_conflict ORDER BY seen_at DESC, consumer_name, message_id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("list inbox conflicts: %w", err)
	}
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Conflict, error) {
		var c Conflict
		err := r.Scan(&c.Consumer, &c.MessageID, &c.PayloadSHA256, &c.StoredSHA256, &c.Topic, &c.Partition, &c.Offset, &c.SeenAt)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("list inbox conflicts: %w", err)
	}
	return cs, nil
}

// consumerNames lists the consumer names of inbox_message by a loose scan
// of its primary key (one index probe per consumer, however many rows):
// the retention statements below find a message's rows of every consumer
// through the primary key (consumer_name, message_id) without an index on
// message_id, which every Register would have to write. They name the rows
// by sqlRowsOf, two arrays given as values in the primary key's condition
// (one probe per pair), planned at each call (pgx.QueryExecModeExec): with
// the names computed inside the statement, or with a generic plan, the
// planner did not know how many there were and took the names alone as
// the index condition, reading every row of every consumer (12,000 rows
// for 200 messages, growing with the table; TestPassReadsOnlyWhatItLooksFor).
func consumerNames(ctx context.Context, q dbpool.Querier) ([]string, error) {
	rows, err := q.Query(ctx, `
WITH RECURSIVE consumers(name) AS (
  (SELECT consumer_name FROM inbox_message ORDER BY consumer_name LIMIT 1)
  UNION ALL
  SELECT (SELECT i.consumer_name FROM inbox_message i WHERE i.consumer_name > c.name ORDER BY i.consumer_name LIMIT 1)
  FROM consumers c WHERE c.name IS NOT NULL)
SELECT name FROM consumers WHERE name IS NOT NULL`)
	if err != nil {
		return nil, fmt.Errorf("list inbox consumers: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list inbox consumers: %w", err)
	}
	return names, nil
}

// sqlRowsOf is the condition on inbox_message m naming the rows of the
// consumers $2 (consumerNames) of the message ids $1.
const sqlRowsOf = `m.consumer_name = ANY ($2::text[]) AND m.message_id = ANY ($1::text[])`

// DeleteMessages removes the rows of every consumer for the messages ids
// that are not Processing (Completed or Failed: their outcome is durable)
// and returns how many: retention (issue 13) once the messages can no
// longer be delivered — their outbox rows are past the outbox window, or
// their task past the task window. A Processing row is never removed.
func DeleteMessages(ctx context.Context, q dbpool.Querier, ids []string) (int64, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	names, err := consumerNames(ctx, q)
	if err != nil || len(names) == 0 {
		return 0, err
	}
	tag, err := q.Exec(ctx, `DELETE FROM inbox_message m WHERE `+sqlRowsOf+` AND m.state <> 'processing'`,
		pgx.QueryExecModeExec, ids, names)
	if err != nil {
		return 0, fmt.Errorf("delete inbox rows of %d messages: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// ProcessingOf returns which of the messages ids a consumer has in state
// Processing (a delivery whose outcome is not durable yet): the retention
// of their tasks waits. One statement after the consumers' names.
func ProcessingOf(ctx context.Context, q dbpool.Querier, ids []string) (map[string]bool, error) {
	busy := map[string]bool{}
	if len(ids) == 0 {
		return busy, nil
	}
	names, err := consumerNames(ctx, q)
	if err != nil || len(names) == 0 {
		return busy, err
	}
	rows, err := q.Query(ctx, `SELECT DISTINCT m.message_id FROM inbox_message m WHERE `+sqlRowsOf+` AND m.state = 'processing'`,
		pgx.QueryExecModeExec, ids, names)
	if err != nil {
		return nil, fmt.Errorf("read inbox rows of %d messages: %w", len(ids), err)
	}
	processing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read inbox rows of %d messages: %w", len(ids), err)
	}
	for _, id := range processing {
		busy[id] = true
	}
	return busy, nil
}

// LockMessages locks every consumer's inbox row of the messages ids (FOR
// UPDATE, in (consumer, message) order), as a delivery does before it
// locks the task: see deadletter.LockOfTasks for the retention batch's
// lock order.
func LockMessages(ctx context.Context, q dbpool.Querier, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	names, err := consumerNames(ctx, q)
	if err != nil || len(names) == 0 {
		return err
	}
	if _, err := q.Exec(ctx, `SELECT 1 FROM inbox_message m WHERE `+sqlRowsOf+`
ORDER BY m.consumer_name, m.message_id FOR UPDATE OF m`, pgx.QueryExecModeExec, ids, names); err != nil {
		return fmt.Errorf("lock inbox rows of %d messages: %w", len(ids), err)
	}
	return nil
}
