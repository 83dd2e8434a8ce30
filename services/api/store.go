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

// createTask runs the create transaction of seed section 3.1. The
// idempotency record is inserted FIRST, state in_progress, with ON CONFLICT
// DO NOTHING: its primary key decides between concurrent first uses (a
// concurrent inserter waits for the winner's commit or rollback). Only the
// winner goes on: build is called with the transaction's timestamp (the
// database clock, now()) and returns the task, its input and the TaskCreated
// outbox row, which are inserted; then the record is completed to succeeded
// with the replayable response, all in the same transaction. A loser gets
// errKeyTaken with nothing written; it then reads the record with
// idempotencyRecord.
func (s *store) createTask(ctx context.Context, k createKey, build func(now time.Time) (*newTask, error)) (*newTask, error) {
	var n *newTask
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var now time.Time
		err := tx.QueryRow(ctx, `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, created_at, expires_at)
VALUES ($1, $2, $3, 'in_progress', now() + $4 * interval '1 millisecond', now(), now() + $5 * interval '1 millisecond')
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING created_at`, createScope, k.Key, k.Fingerprint, k.Lease.Milliseconds(), k.TTL.Milliseconds()).Scan(&now)
		if errors.Is(err, pgx.ErrNoRows) {
			return errKeyTaken
		}
		if err != nil {
			return fmt.Errorf("insert idempotency record: %w", err)
		}
		if n, err = build(now.UTC()); err != nil {
			return err
		}
		t := n.Task
		if _, err := tx.Exec(ctx, `
INSERT INTO task (task_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)`,
			t.TaskID, k.Fingerprint, t.Status, t.Version, t.Attempt, t.OutputFormat, t.InputSHA256, t.InputSize, t.CreatedAt, t.UpdatedAt); err != nil {
			return fmt.Errorf("insert task %s: %w", t.TaskID, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO task_input (task_id, document) VALUES ($1, $2)`, t.TaskID, n.Document); err != nil {
			return fmt.Errorf("insert task input %s: %w", t.TaskID, err)
		}
		if _, err := tx.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7)`,
			n.OutboxID, t.TaskID, t.Version, taskevent.TypeTaskCreated, string(n.Payload), n.PayloadSHA256, t.CreatedAt); err != nil {
			return fmt.Errorf("insert outbox event %s: %w", n.OutboxID, err)
		}
		tag, err := tx.Exec(ctx, `
UPDATE idempotency_record
SET state = 'succeeded', task_id = $3, response_status = 202, response_body = $4, locked_until = NULL
WHERE scope = $1 AND idempotency_key = $2 AND state = 'in_progress' AND request_fingerprint = $5`,
			createScope, k.Key, t.TaskID, string(n.Response), k.Fingerprint)
		if err != nil {
			return fmt.Errorf("complete idempotency record: %w", err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("complete idempotency record: %d rows updated, want 1", tag.RowsAffected())
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return n, nil
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
