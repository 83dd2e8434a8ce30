package api

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/taskevent"
)

// Idempotency scope of task creation (idempotency_record.scope).
const createScope = "public:create-document-task"

// Idempotency record states (idempotency_record.state).
const (
	stateInProgress = "in_progress"
	stateSucceeded  = "succeeded"
)

var (
	// errKeyTaken: the idempotency record's primary key already exists; the
	// create transaction was rolled back.
	errKeyTaken = errors.New("idempotency key already recorded")
	// errTaskNotFound: no task row has this id.
	errTaskNotFound = errors.New("task not found")
	// errNoVerifiedArtifact: the task has no verified artifact.put effect.
	errNoVerifiedArtifact = errors.New("no verified artifact effect")
)

// store holds every SQL statement of the API.
type store struct {
	pool *pgxpool.Pool
}

// newTask is everything the create transaction writes besides the
// idempotency record.
type newTask struct {
	Task          taskevent.Task // the snapshot at version 0
	Document      []byte         // the "document" member as received
	OutboxID      string
	Payload       []byte // canonical JSON of the TaskCreated event
	PayloadSHA256 string
	Response      []byte // canonical JSON of the 202 body
}

// createKey identifies the idempotency record of a create request.
type createKey struct {
	Key         string
	Fingerprint string
	TTL         time.Duration // expires_at = created_at + TTL
	Lease       time.Duration // locked_until = created_at + Lease
}

// idemRecord is a stored idempotency record.
type idemRecord struct {
	Fingerprint    string
	State          string
	TaskID         *string
	ResponseStatus *int
	ResponseBody   []byte // JSON text (jsonb rendering), nil when not set
}

// SQL of the create transaction (seed section 3.1), in the order it runs.
const (
	sqlInsertIdempotencyRecord = `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, created_at, expires_at)
VALUES ($1, $2, $3, 'in_progress', now() + $4 * interval '1 millisecond', now(), now() + $5 * interval '1 millisecond')
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING created_at`
	// sqlCompleteRecordInsertTask completes the idempotency record and
	// inserts the task FROM the completed row: when the record is not ours
	// and in progress, no task is inserted and the task_input insert that
	// follows fails on its foreign key, so the pipelined COMMIT never runs.
	// (The record's own foreign key to the task is checked at the end of
	// the statement, when the task row exists.)
	sqlCompleteRecordInsertTask = `
WITH completed AS (
  UPDATE idempotency_record
  SET state = 'succeeded', task_id = $3, response_status = 202, response_body = $4, locked_until = NULL
  WHERE scope = $1 AND idempotency_key = $2 AND state = 'in_progress' AND request_fingerprint = $5
  RETURNING 1
)
INSERT INTO task (task_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at)
SELECT $3, $5, $6::text, $7::bigint, $8::integer, $9::text, $10::text, $11::bigint, $12::timestamptz, $13::timestamptz FROM completed`
	sqlInsertTaskInput   = `INSERT INTO task_input (task_id, document) VALUES ($1, $2)`
	sqlInsertOutboxEvent = `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7)`
)

// createTask runs the create transaction of seed section 3.1. The
// idempotency record is inserted FIRST, state in_progress, with ON CONFLICT
// DO NOTHING: its primary key decides between concurrent first uses (a
// concurrent inserter waits for the winner's commit or rollback). Only the
// winner goes on: build is called with the transaction's timestamp (the
// database clock, now()) and returns the task, its input and the TaskCreated
// outbox row; the record is completed to succeeded with the replayable
// response and they are inserted, all in the same transaction. A loser gets
// errKeyTaken with nothing written; it then reads the record with
// idempotencyRecord.
//
// The transaction takes two round trips to PostgreSQL, its statements
// pipelined (pgx.Batch: one write, one Sync): BEGIN with the record insert,
// whose RETURNING gives the timestamp; then the record completion with the
// task insert, the task_input and outbox inserts and COMMIT. A statement that
// fails makes PostgreSQL skip the rest of its batch, COMMIT included; the
// transaction is then rolled back. A connection whose rollback fails is
// closed, never returned to the pool mid-transaction.
func (s *store) createTask(ctx context.Context, k createKey, build func(now time.Time) (*newTask, error)) (*newTask, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire connection: %w", err)
	}
	defer conn.Release()
	committed := false
	defer func() {
		if !committed {
			rollback(conn.Conn())
		}
	}()

	var b pgx.Batch
	b.Queue("BEGIN")
	b.Queue(sqlInsertIdempotencyRecord, createScope, k.Key, k.Fingerprint, k.Lease.Milliseconds(), k.TTL.Milliseconds())
	br := conn.SendBatch(ctx, &b)
	var now time.Time
	_, err = br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(&now)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errKeyTaken
	}
	if err != nil {
		return nil, fmt.Errorf("insert idempotency record: %w", err)
	}

	n, err := build(now.UTC())
	if err != nil {
		return nil, err
	}
	t := n.Task
	b = pgx.Batch{}
	b.Queue(sqlCompleteRecordInsertTask, createScope, k.Key, t.TaskID, string(n.Response), k.Fingerprint,
		t.Status, t.Version, t.Attempt, t.OutputFormat, t.InputSHA256, t.InputSize, t.CreatedAt, t.UpdatedAt)
	b.Queue(sqlInsertTaskInput, t.TaskID, n.Document)
	b.Queue(sqlInsertOutboxEvent, n.OutboxID, t.TaskID, t.Version, taskevent.TypeTaskCreated, string(n.Payload), n.PayloadSHA256, t.CreatedAt)
	b.Queue("COMMIT")
	br = conn.SendBatch(ctx, &b)
	tag, err := br.Exec()
	switch {
	case err != nil:
		err = fmt.Errorf("complete idempotency record, insert task %s: %w", t.TaskID, err)
	case tag.RowsAffected() != 1: // unreachable: task_input's foreign key fails first
		err = fmt.Errorf("complete idempotency record: %d tasks inserted, want 1", tag.RowsAffected())
	default:
		err = batchExec(br, "insert task input "+t.TaskID, "insert outbox event "+n.OutboxID)
	}
	if err == nil {
		if tag, err = br.Exec(); err == nil && tag.String() != "COMMIT" {
			err = errors.New(tag.String())
		}
		if err != nil {
			err = fmt.Errorf("commit task %s: %w", t.TaskID, err)
		}
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("create task %s: %w", t.TaskID, cerr)
	}
	if err != nil {
		return nil, err
	}
	committed = true
	return n, nil
}

// batchExec reads the results of the next len(what) statements of br,
// which return no rows; the first error is wrapped with its description.
func batchExec(br pgx.BatchResults, what ...string) error {
	for _, w := range what {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("%s: %w", w, err)
		}
	}
	return nil
}

// rollback ends the open transaction of conn; when that fails the
// connection is closed, so the pool never reuses it mid-transaction (pgxpool
// also destroys a released connection whose transaction status is not idle).
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

// idempotencyRecord reads the record of key, or returns pgx.ErrNoRows.
func (s *store) idempotencyRecord(ctx context.Context, key string) (*idemRecord, error) {
	var r idemRecord
	var body *string
	err := s.pool.QueryRow(ctx, `
SELECT request_fingerprint, state, task_id, response_status, response_body::text
FROM idempotency_record WHERE scope = $1 AND idempotency_key = $2`, createScope, key).
		Scan(&r.Fingerprint, &r.State, &r.TaskID, &r.ResponseStatus, &body)
	if err != nil {
		return nil, fmt.Errorf("read idempotency record: %w", err)
	}
	if body != nil {
		r.ResponseBody = []byte(*body)
	}
	return &r, nil
}

// task reads a task row as a snapshot, or returns errTaskNotFound.
func (s *store) task(ctx context.Context, id string) (*taskevent.Task, error) {
	var t taskevent.Task
	err := s.pool.QueryRow(ctx, `
SELECT task_id, status, version, attempt, output_format, input_sha256, input_size,
       artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at
FROM task WHERE task_id = $1`, id).Scan(&t.TaskID, &t.Status, &t.Version, &t.Attempt, &t.OutputFormat, &t.InputSHA256, &t.InputSize,
		&t.ArtifactSHA256, &t.ArtifactSize, &t.TerminalErrorCode, &t.CreatedAt, &t.UpdatedAt, &t.CompletedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errTaskNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("read task %s: %w", id, err)
	}
	t.CreatedAt, t.UpdatedAt = t.CreatedAt.UTC(), t.UpdatedAt.UTC()
	if t.CompletedAt != nil {
		c := t.CompletedAt.UTC()
		t.CompletedAt = &c
	}
	return &t, nil
}

// verifiedArtifactToken returns the idempotency token (the artifact store
// key) of the task's latest verified artifact.put effect, or
// errNoVerifiedArtifact.
func (s *store) verifiedArtifactToken(ctx context.Context, taskID string) (string, error) {
	var token string
	err := s.pool.QueryRow(ctx, `
SELECT idempotency_token FROM effect_ledger
WHERE task_id = $1 AND effect_kind = 'artifact.put' AND state = 'verified'
ORDER BY attempt DESC LIMIT 1`, taskID).Scan(&token)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", errNoVerifiedArtifact
	}
	if err != nil {
		return "", fmt.Errorf("read artifact effect of %s: %w", taskID, err)
	}
	return token, nil
}

// ping checks that PostgreSQL answers.
func (s *store) ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}
