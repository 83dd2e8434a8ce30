// Package idempotency owns converge's idempotency records (seed 3) — every
// statement that writes idempotency_record — and the one encoder of the
// response they replay: the 202 body of POST /v1/tasks. The API creates and
// completes records; the reconciler resolves records left in progress.
//
// # Invariants
//
//   - A record is identified by (scope, idempotency key); its primary key,
//     not a prior read, decides between concurrent first uses: the record is
//     inserted first in the create transaction, and the loser waits for the
//     winner's commit or rollback.
//   - The key is bound to the request fingerprint it was first used with:
//     the same key with another fingerprint never creates a second task.
//   - A create inserts its record complete (QueueInsertSucceeded:
//     succeeded, the task id, the replayable response) in the transaction
//     that then creates the task and its TaskCreated outbox row; the record
//     is never visible to anyone before that transaction commits, so the
//     in_progress state of seed 3.1 lasts exactly as long as the
//     transaction (migration 00016). A cancel inserts its record
//     in_progress (QueueBegin) and completes it (QueueCompleteWith); when
//     the record is not in progress with this fingerprint, the completion
//     fails and the transaction commits nothing.
//   - A record left in_progress past locked_until is never taken to mean
//     that the first execution did not happen (seed 3.1): Resolve completes
//     it from its task, or deletes it only when it has no task.
//   - The stored response is canonical JSON (RFC 8785, AppendCreateResponse);
//     a replay answers the same bytes.
package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/taskevent"
)

// The scope of a record (idempotency_record.scope) names its owner and
// operation: tenant.CreateScope for the API's creates (issue 12; before
// tenants existed every record had the scope "public:create-document-task").

// DefaultTTL is the retention window of a record by default (the API's
// IdempotencyTTL, published in README and OpenAPI): expires_at = creation +
// DefaultTTL. A task is kept at least as long (the reconciler's
// TaskRetention refuses a shorter window), so a key never outlives its
// task.
const DefaultTTL = 24 * time.Hour

// State is idempotency_record.state.
type State string

// The record states (seed 3).
const (
	InProgress      State = "in_progress"
	Succeeded       State = "succeeded"
	FailedRetryable State = "failed_retryable"
	FailedFinal     State = "failed_final"
)

// Key identifies a record and what the request binds it to.
type Key struct {
	Scope       string
	Key         string
	Fingerprint string
	TTL         time.Duration // expires_at = created_at + TTL
	Lease       time.Duration // locked_until = created_at + Lease
}

// QueueInsertSucceeded queues the insert of k's record, complete, on b: the
// first statement of a create transaction after BEGIN (migration 00016).
// The record is succeeded with taskID and the 202 response (CreatedResponse),
// which the caller chose before the transaction; the task, inserted later in
// the same transaction, satisfies the record's deferred foreign key at
// COMMIT. When the batch is read, created is the record's created_at (the
// transaction's now()); the callback returns pgx.ErrNoRows when the key is
// recorded already (ON CONFLICT DO NOTHING: nothing was written). A
// concurrent insert of the same key waits for this transaction to end: the
// primary key decides (seed 3.1).
func QueueInsertSucceeded(b *pgx.Batch, k Key, taskID string, response []byte, created *time.Time) {
	queueInsertSucceeded(b, k, taskID, response, func(row pgx.Row) error { return row.Scan(created) })
}

// QueueInsertSucceededOutcome is QueueInsertSucceeded for one of several
// records inserted in the same transaction (the API's group commit of
// creates): a key recorded already is not an error but won = false, so the
// batch's other statements are read on; won = true and created set when the
// record was inserted.
func QueueInsertSucceededOutcome(b *pgx.Batch, k Key, taskID string, response []byte, created *time.Time, won *bool) {
	queueInsertSucceeded(b, k, taskID, response, func(row pgx.Row) error {
		err := row.Scan(created)
		*won = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
}

// queueInsertSucceeded queues sqlInsertSucceeded for k on b; scan reads its
// RETURNING row.
func queueInsertSucceeded(b *pgx.Batch, k Key, taskID string, response []byte, scan func(pgx.Row) error) {
	b.Queue(sqlInsertSucceeded, k.Scope, k.Key, k.Fingerprint, k.TTL.Milliseconds(), taskID, string(response)).QueryRow(scan)
}

const sqlInsertSucceeded = `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, created_at, expires_at)
VALUES ($1, $2, $3, 'succeeded', $5, 202, $6, now(), now() + $4 * interval '1 millisecond')
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING created_at`

// QueueBegin queues the insert of k's record, in_progress, on b (the first
// statement of a transaction that completes it later with
// QueueCompleteWith: a cancel). When the batch is read, created is the
// record's created_at (the transaction's now()); the callback returns
// pgx.ErrNoRows when the key is recorded already (ON CONFLICT DO NOTHING:
// nothing was written).
func QueueBegin(b *pgx.Batch, k Key, created *time.Time) {
	b.Queue(sqlBegin, k.Scope, k.Key, k.Fingerprint, k.Lease.Milliseconds(), k.TTL.Milliseconds()).
		QueryRow(func(row pgx.Row) error { return row.Scan(created) })
}

const sqlBegin = `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, created_at, expires_at)
VALUES ($1, $2, $3, 'in_progress', now() + $4 * interval '1 millisecond', now(), now() + $5 * interval '1 millisecond')
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING created_at`

// sqlComplete completes the record to succeeded with its task and response
// and fails (division by zero, SQLSTATE 22012) when no record of this key is
// in progress with this fingerprint: a statement that fails makes
// PostgreSQL skip the rest of a pipelined batch, the COMMIT included, so
// nothing of the transaction is committed. Queued after the task insert
// (the record's foreign key to the task is checked at the end of the
// statement).
const sqlComplete = `
WITH completed AS (
  UPDATE idempotency_record
  SET state = 'succeeded', task_id = $3, response_status = $6, response_body = $4, locked_until = NULL
  WHERE scope = $1 AND idempotency_key = $2 AND state = 'in_progress' AND request_fingerprint = $5
  RETURNING 1)
SELECT 1 / (SELECT count(*)::int FROM completed)`

// QueueCompleteWith queues the completion of k's record, begun with
// QueueBegin, with taskID, the response's status (a cancel's 200) and its
// body on b (see sqlComplete).
func QueueCompleteWith(b *pgx.Batch, k Key, taskID string, status int, response []byte) {
	b.Queue(sqlComplete, k.Scope, k.Key, taskID, string(response), k.Fingerprint, status).
		Exec(func(pgconn.CommandTag) error { return nil })
}

// Record is a stored idempotency record.
type Record struct {
	Scope, Key     string
	Fingerprint    string
	State          State
	TaskID         *string
	ResponseStatus *int
	ResponseBody   []byte // JSON text (jsonb's rendering), nil when not set
}

// Get reads the record of (scope, key); the error wraps pgx.ErrNoRows when
// there is none.
func Get(ctx context.Context, q dbpool.Querier, scope, key string) (*Record, error) {
	r := Record{Scope: scope, Key: key}
	var body *string
	err := q.QueryRow(ctx, `
SELECT request_fingerprint, state, task_id, response_status, response_body::text
FROM idempotency_record WHERE scope = $1 AND idempotency_key = $2`, scope, key).
		Scan(&r.Fingerprint, &r.State, &r.TaskID, &r.ResponseStatus, &body)
	if err != nil {
		return nil, fmt.Errorf("read idempotency record: %w", err)
	}
	if body != nil {
		r.ResponseBody = []byte(*body)
	}
	return &r, nil
}

// Expired returns at most limit records in_progress past locked_until,
// oldest lease first. It reads the in-progress records only
// (idempotency_record_in_progress_idx, migrations 00013 and 00014); the create
// transaction never commits one, so it finds a record only after a defect.
func Expired(ctx context.Context, q dbpool.Querier, limit int) ([]Record, error) {
	rows, err := q.Query(ctx, `
SELECT scope, idempotency_key, task_id FROM idempotency_record
WHERE state = 'in_progress' AND locked_until < now()
ORDER BY locked_until LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("select expired idempotency records: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) {
		r := Record{State: InProgress}
		err := row.Scan(&r.Scope, &r.Key, &r.TaskID)
		return r, err
	})
}

// Resolve resolves an expired in_progress record (compare-and-set on state
// in_progress): with a task (t, the task's current row), succeeded with the
// 202 response of the task as first created (CreatedResponse); without
// one, the record is deleted so that the client's retry with the same key
// creates the task. It reports whether the record changed.
func Resolve(ctx context.Context, q dbpool.Querier, rec Record, t *taskevent.Task) (bool, error) {
	var tag pgconn.CommandTag
	var err error
	if t != nil {
		tag, err = q.Exec(ctx, `
UPDATE idempotency_record SET state = 'succeeded', response_status = 202, response_body = $4, locked_until = NULL
WHERE scope = $1 AND idempotency_key = $2 AND state = 'in_progress' AND task_id = $3`,
			rec.Scope, rec.Key, t.TaskID, string(CreatedResponse(*t)))
	} else {
		tag, err = q.Exec(ctx, `
DELETE FROM idempotency_record WHERE scope = $1 AND idempotency_key = $2 AND state = 'in_progress' AND task_id IS NULL
  AND locked_until < now()`, rec.Scope, rec.Key)
	}
	if err != nil {
		return false, fmt.Errorf("resolve idempotency record %s: %w", rec.Key, err)
	}
	return tag.RowsAffected() == 1, nil
}

// TaskPath is the path of a task resource.
func TaskPath(id string) string { return "/v1/tasks/" + id }

// CreatedResponse is the 202 body of POST /v1/tasks for task t as created
// (status queued, version 0; schemas/openapi.yaml TaskAccepted): canonical
// JSON (RFC 8785), stored in the record and replayed byte for byte.
func CreatedResponse(t taskevent.Task) []byte {
	return AppendCreateResponse(make([]byte, 0, 320), t.TaskID, taskevent.StatusQueued, 0, t.InputSHA256, t.OutputFormat)
}

// AppendCreateResponse appends the 202 body to dst: {"input_sha256",
// "links":{"artifact","self"}, "output_format", "status", "task_id",
// "version"}, members in RFC 8785 order, strings quoted with RFC 8785's
// minimal escaping (TestCreateResponseIsCanonical checks it against
// canon.Transform).
func AppendCreateResponse(dst []byte, taskID, status string, version int64, inputSHA256, outputFormat string) []byte {
	dst = append(dst, `{"input_sha256":`...)
	dst, _ = jsontext.AppendQuote(dst, inputSHA256)
	dst = append(dst, `,"links":{"artifact":`...)
	dst, _ = jsontext.AppendQuote(dst, TaskPath(taskID)+"/artifact")
	dst = append(dst, `,"self":`...)
	dst, _ = jsontext.AppendQuote(dst, TaskPath(taskID))
	dst = append(dst, `},"output_format":`...)
	dst, _ = jsontext.AppendQuote(dst, outputFormat)
	dst = append(dst, `,"status":`...)
	dst, _ = jsontext.AppendQuote(dst, status)
	dst = append(dst, `,"task_id":`...)
	dst, _ = jsontext.AppendQuote(dst, taskID)
	dst = append(dst, `,"version":`...)
	dst = strconv.AppendInt(dst, version, 10)
	return append(dst, '}')
}

// Purge removes at most limit records past expires_at whose removal cannot
// make an old request look new while it still matters (seed 3.3): records
// of failed requests (no task), and succeeded records whose task is
// terminal (completed, failed, compensated, cancelled), whose outbox events
// are all published or decided (parked rows count only once republished
// or discarded), and none of whose effects is started, unknown or
// compensation_required. Records in_progress are never removed (the
// reconciler resolves them first). Rows locked by a concurrent request are
// skipped. It returns how many it removed. After removal the key may create
// a new task: the retention window (the API's IdempotencyTTL, 24 h by
// default) is public (README, OpenAPI).
//
// The records are taken in the table's order, not oldest first: an ORDER
// BY expires_at (which the BRIN index on it cannot give) made each call
// test every expired record and sort them to keep 100, 4.6 s for 20,000
// expired records; without it the scan stops at the limit. The task's
// status is read by its primary key, and each other question is a
// subquery with LIMIT 1 by the task's id: a status condition inside the
// lookup let the planner walk the partial index of terminal tasks instead
// (a whole index per record), and NOT EXISTS, pulled up into an anti-join,
// let it hash the whole outbox (TestPassReadsOnlyWhatItLooksFor).
func Purge(ctx context.Context, q dbpool.Querier, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `
WITH victims AS (
  SELECT ir.scope, ir.idempotency_key FROM idempotency_record ir
  WHERE ir.expires_at < now()
    AND (ir.state IN ('failed_retryable', 'failed_final')
      OR (ir.state = 'succeeded'
        AND (SELECT t.status FROM task t WHERE t.task_id = ir.task_id) IN ('completed', 'failed', 'compensated', 'cancelled')
        AND (SELECT true FROM outbox_event o
             WHERE o.aggregate_id = ir.task_id AND outbox_published_at(o) IS NULL AND o.decision IS NULL LIMIT 1) IS NULL
        AND (SELECT true FROM effect_ledger e
             WHERE e.task_id = ir.task_id AND e.state IN ('started', 'unknown', 'compensation_required') LIMIT 1) IS NULL))
  LIMIT $1
  FOR UPDATE OF ir SKIP LOCKED)
DELETE FROM idempotency_record d USING victims v
WHERE d.scope = v.scope AND d.idempotency_key = v.idempotency_key`, limit)
	if err != nil {
		return 0, fmt.Errorf("purge expired idempotency records: %w", err)
	}
	return tag.RowsAffected(), nil
}
