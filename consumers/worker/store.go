package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/taskevent"
)

// All SQL of the worker. Every function runs on the querier it is given (a
// transaction, or the pool for single statements); every state change is a
// compare-and-set on state and/or version and reports whether it applied.

// querier is what the store functions need from a pgx.Tx or *pgxpool.Pool.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ querier = pgx.Tx(nil)
	_ querier = (*pgxpool.Pool)(nil)
)

// Inbox states (inbox_message.state).
const (
	inboxProcessing = "processing"
	inboxCompleted  = "completed"
	inboxFailed     = "failed"
)

// Effect kinds and states (effect_ledger.effect_kind / state, seed 7).
const (
	kindArtifactPut  = "artifact.put"
	kindArtifactHide = "artifact.hide"

	effectPlanned              = "planned"
	effectStarted              = "started"
	effectUnknown              = "unknown"
	effectVerified             = "verified"
	effectCompensationRequired = "compensation_required"
	effectCompensated          = "compensated"
	effectFailed               = "failed"
)

type inboxRow struct {
	PayloadSHA256 string
	State         string
}

// insertInbox registers a delivery of message id for consumer in state
// processing. It returns false when the identity is already registered (the
// primary key decides, seed 6).
func insertInbox(ctx context.Context, q querier, consumer, messageID, payloadSHA256 string) (bool, error) {
	tag, err := q.Exec(ctx, `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state)
VALUES ($1, $2, $3, 'processing')
ON CONFLICT (consumer_name, message_id) DO NOTHING`, consumer, messageID, payloadSHA256)
	if err != nil {
		return false, fmt.Errorf("insert inbox message %s: %w", messageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// lockInbox reads an inbox row and locks it until the transaction ends, so
// concurrent deliveries of one message serialise on it.
func lockInbox(ctx context.Context, q querier, consumer, messageID string) (inboxRow, error) {
	var r inboxRow
	err := q.QueryRow(ctx, `
SELECT payload_sha256, state FROM inbox_message
WHERE consumer_name = $1 AND message_id = $2
FOR UPDATE`, consumer, messageID).Scan(&r.PayloadSHA256, &r.State)
	if err != nil {
		return r, fmt.Errorf("read inbox message %s: %w", messageID, err)
	}
	return r, nil
}

// touchInbox counts one more delivery of a registered message.
func touchInbox(ctx context.Context, q querier, consumer, messageID string) error {
	_, err := q.Exec(ctx, `
UPDATE inbox_message SET deliveries = deliveries + 1, last_seen_at = now()
WHERE consumer_name = $1 AND message_id = $2`, consumer, messageID)
	if err != nil {
		return fmt.Errorf("count delivery of inbox message %s: %w", messageID, err)
	}
	return nil
}

const sqlFinishInbox = `
UPDATE inbox_message SET state = $3, result_json = $4::jsonb, completed_at = now(), last_seen_at = now()
WHERE consumer_name = $1 AND message_id = $2 AND state = 'processing'`

// finishInbox moves a message from processing to completed or failed with
// its result summary. It returns false when the row was not processing.
func finishInbox(ctx context.Context, q querier, consumer, messageID, state string, result any) (bool, error) {
	raw, err := json.Marshal(result)
	if err != nil {
		return false, fmt.Errorf("encode inbox result: %w", err)
	}
	tag, err := q.Exec(ctx, sqlFinishInbox, consumer, messageID, state, string(raw))
	if err != nil {
		return false, fmt.Errorf("finish inbox message %s as %s: %w", messageID, state, err)
	}
	return tag.RowsAffected() == 1, nil
}

// conflictRecord is a delivery whose message id is registered with another
// payload hash (seed 6, 13.4).
type conflictRecord struct {
	Consumer, MessageID, PayloadSHA256, StoredSHA256 string
	Topic                                            string
	Partition                                        int32
	Offset                                           int64
}

func insertInboxConflict(ctx context.Context, q querier, c conflictRecord) error {
	_, err := q.Exec(ctx, `
INSERT INTO inbox_conflict (consumer_name, message_id, payload_sha256, stored_sha256, topic, kafka_partition, kafka_offset)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (consumer_name, message_id, payload_sha256) DO NOTHING`,
		c.Consumer, c.MessageID, c.PayloadSHA256, c.StoredSHA256, c.Topic, c.Partition, c.Offset)
	if err != nil {
		return fmt.Errorf("record inbox conflict for %s: %w", c.MessageID, err)
	}
	return nil
}

// recordFailure makes a deterministic failure of a delivery durable: a new
// message id gets an inbox row in state failed with {"error_code": code}; a
// registered one in state processing moves to failed; a registered one with
// another payload hash is a conflict. It returns the outcome to count.
func recordFailure(ctx context.Context, q querier, c conflictRecord, code string) (string, error) {
	raw, _ := json.Marshal(map[string]string{"error_code": code})
	tag, err := q.Exec(ctx, `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, result_json, completed_at)
VALUES ($1, $2, $3, 'failed', $4::jsonb, now())
ON CONFLICT (consumer_name, message_id) DO NOTHING`, c.Consumer, c.MessageID, c.PayloadSHA256, string(raw))
	if err != nil {
		return "", fmt.Errorf("record failure of %s: %w", c.MessageID, err)
	}
	if tag.RowsAffected() == 1 {
		return OutcomeFailed, nil
	}
	row, err := lockInbox(ctx, q, c.Consumer, c.MessageID)
	if err != nil {
		return "", err
	}
	if row.PayloadSHA256 != c.PayloadSHA256 {
		c.StoredSHA256 = row.PayloadSHA256
		return OutcomeConflict, insertInboxConflict(ctx, q, c)
	}
	if err := touchInbox(ctx, q, c.Consumer, c.MessageID); err != nil {
		return "", err
	}
	if row.State == inboxProcessing {
		if _, err := finishInbox(ctx, q, c.Consumer, c.MessageID, inboxFailed, map[string]string{"error_code": code}); err != nil {
			return "", err
		}
	}
	return OutcomeFailed, nil
}

const taskColumns = `task_id, status, version, attempt, output_format, input_sha256, input_size,
artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at`

func scanTask(row pgx.Row) (taskevent.Task, error) {
	var t taskevent.Task
	err := row.Scan(&t.TaskID, &t.Status, &t.Version, &t.Attempt, &t.OutputFormat, &t.InputSHA256, &t.InputSize,
		&t.ArtifactSHA256, &t.ArtifactSize, &t.TerminalErrorCode, &t.CreatedAt, &t.UpdatedAt, &t.CompletedAt)
	if err != nil {
		return t, err
	}
	t.CreatedAt = t.CreatedAt.UTC()
	t.UpdatedAt = t.UpdatedAt.UTC()
	if t.CompletedAt != nil {
		c := t.CompletedAt.UTC()
		t.CompletedAt = &c
	}
	return t, nil
}

// oneTask scans a single-row task query; found is false when no row matched.
func oneTask(row pgx.Row, action string) (taskevent.Task, bool, error) {
	t, err := scanTask(row)
	if errors.Is(err, pgx.ErrNoRows) {
		return t, false, nil
	}
	if err != nil {
		return t, false, fmt.Errorf("%s: %w", action, err)
	}
	return t, true, nil
}

// sqlStartTask moves a task queued -> running when its version is at least
// the event's (seed 2.2, 10): version+1, attempt+1. A task queued at a
// higher version than the event was re-opened by a dead-letter replay (or
// is re-driven): it starts from its current version. The update is a
// compare-and-set on status queued, so of two deliveries only one starts the
// task; no row returned means nothing matched.
const sqlStartTask = `
UPDATE task SET status = 'running', version = version + 1, attempt = attempt + 1, updated_at = now()
WHERE task_id = $1 AND status = 'queued' AND version >= $2
RETURNING ` + taskColumns

// startInputs is what the intake reads after starting a task, fetched in
// the round trip of startTaskWithInputs.
type startInputs struct {
	doc       []byte
	docFound  bool
	live      effectRow
	liveFound bool
}

// startTaskWithInputs runs startTask, getDocument and liveEffect of the
// task in one round trip (a batch, executed in this order in q's
// transaction). The reads are only used when the task started (ok).
func startTaskWithInputs(ctx context.Context, q querier, taskID string, version int64) (taskevent.Task, bool, startInputs, error) {
	var in startInputs
	b := &pgx.Batch{}
	b.Queue(sqlStartTask, taskID, version)
	b.Queue(sqlGetDocument, taskID)
	b.Queue(sqlLiveEffect, taskID)
	br := q.SendBatch(ctx, b)
	defer br.Close()
	t, ok, err := oneTask(br.QueryRow(), "start task "+taskID)
	if err != nil {
		return t, false, in, err
	}
	if in.doc, in.docFound, err = scanDocument(br.QueryRow(), taskID); err != nil {
		return t, false, in, err
	}
	if in.live, in.liveFound, err = scanLiveEffect(br.QueryRow(), taskID); err != nil {
		return t, false, in, err
	}
	if err := br.Close(); err != nil {
		return t, false, in, fmt.Errorf("start task %s: %w", taskID, err)
	}
	return t, ok, in, nil
}

// getTask reads a task; found is false when it does not exist.
func getTask(ctx context.Context, q querier, taskID string) (taskevent.Task, bool, error) {
	return oneTask(q.QueryRow(ctx, `SELECT `+taskColumns+` FROM task WHERE task_id = $1`, taskID), "read task "+taskID)
}

// sqlCompleteTask moves a task running -> completed at version, recording
// the verified artifact.
const sqlCompleteTask = `
UPDATE task SET status = 'completed', version = version + 1, artifact_sha256 = $3, artifact_size = $4,
  completed_at = now(), updated_at = now()
WHERE task_id = $1 AND status = 'running' AND version = $2
RETURNING ` + taskColumns

// failTask moves a task running -> failed at version with a terminal error
// code.
func failTask(ctx context.Context, q querier, taskID string, version int64, code string) (taskevent.Task, bool, error) {
	return oneTask(q.QueryRow(ctx, `
UPDATE task SET status = 'failed', version = version + 1, terminal_error_code = $3, updated_at = now()
WHERE task_id = $1 AND status = 'running' AND version = $2
RETURNING `+taskColumns, taskID, version, code), "fail task "+taskID)
}

// getDocument reads the submitted document of a task.
func getDocument(ctx context.Context, q querier, taskID string) ([]byte, bool, error) {
	return scanDocument(q.QueryRow(ctx, sqlGetDocument, taskID), taskID)
}

const sqlGetDocument = `SELECT document FROM task_input WHERE task_id = $1`

func scanDocument(row pgx.Row, taskID string) ([]byte, bool, error) {
	var doc []byte
	err := row.Scan(&doc)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read input of task %s: %w", taskID, err)
	}
	return doc, true, nil
}

// effectRow is an effect_ledger row.
type effectRow struct {
	EffectID       string
	TaskID         string
	Attempt        int
	Kind           string
	Token          string
	TargetIdentity string
	State          string
	RequestSHA256  string
	RequestSize    int64
	ObservedSHA256 *string
	ErrorCode      *string
}

// planEffect writes the ledger row of an effect before the effect is
// attempted (seed 7) unless its identity (kind, token) is already recorded,
// and returns the row as stored and whether this call inserted it.
func planEffect(ctx context.Context, q querier, e effectRow) (effectRow, bool, error) {
	// The insert and the read go in one round trip (a batch, executed in
	// order).
	b := &pgx.Batch{}
	b.Queue(`
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (effect_kind, idempotency_token) DO NOTHING`,
		e.EffectID, e.TaskID, e.Attempt, e.Kind, e.Token, e.TargetIdentity, e.State, e.RequestSHA256, e.RequestSize)
	b.Queue(`
SELECT effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size,
  observed_result_sha256, error_code
FROM effect_ledger WHERE effect_kind = $1 AND idempotency_token = $2`, e.Kind, e.Token)
	br := q.SendBatch(ctx, b)
	defer br.Close()
	tag, err := br.Exec()
	if err != nil {
		return e, false, fmt.Errorf("plan effect %s: %w", e.EffectID, err)
	}
	var r effectRow
	err = br.QueryRow().Scan(
		&r.EffectID, &r.TaskID, &r.Attempt, &r.Kind, &r.Token, &r.TargetIdentity, &r.State, &r.RequestSHA256, &r.RequestSize,
		&r.ObservedSHA256, &r.ErrorCode)
	if err != nil {
		return e, false, fmt.Errorf("read effect %s: %w", e.EffectID, err)
	}
	if err := br.Close(); err != nil {
		return e, false, fmt.Errorf("plan effect %s: %w", e.EffectID, err)
	}
	return r, tag.RowsAffected() == 1, nil
}

// OneVerifiedIndex is the partial unique index that allows at most one
// verified artifact.put effect per task (migration 00003).
const OneVerifiedIndex = "effect_ledger_one_verified_put_idx"

// OneVerifiedViolation reports whether err is the violation of
// OneVerifiedIndex: another artifact.put effect of the task is verified.
func OneVerifiedViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == OneVerifiedIndex
}

// liveEffect returns the task's artifact.put effect that a new attempt
// must resume rather than replace: a verified one, else the one of the
// highest attempt in planned, started, unknown or completed (its outcome
// is not known). found is false when there is none (no effect yet, or only
// failed or compensated ones).
func liveEffect(ctx context.Context, q querier, taskID string) (effectRow, bool, error) {
	return scanLiveEffect(q.QueryRow(ctx, sqlLiveEffect, taskID), taskID)
}

const sqlLiveEffect = `
SELECT effect_id, attempt, idempotency_token, state FROM effect_ledger
WHERE task_id = $1 AND effect_kind = 'artifact.put' AND state IN ('planned', 'started', 'unknown', 'completed', 'verified')
ORDER BY state = 'verified' DESC, attempt DESC
LIMIT 1`

func scanLiveEffect(row pgx.Row, taskID string) (effectRow, bool, error) {
	var r effectRow
	err := row.Scan(&r.EffectID, &r.Attempt, &r.Token, &r.State)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	if err != nil {
		return r, false, fmt.Errorf("read artifact effects of task %s: %w", taskID, err)
	}
	return r, true, nil
}

// setEffectState moves an effect from state from to state to (a
// compare-and-set); observed and code are stored when non-nil. It returns
// false when the effect was no longer in state from.
func setEffectState(ctx context.Context, q querier, effectID, from, to string, observed, code *string) (bool, error) {
	tag, err := q.Exec(ctx, sqlSetEffectState, effectID, from, to, observed, code)
	if err != nil {
		return false, fmt.Errorf("effect %s %s -> %s: %w", effectID, from, to, err)
	}
	return tag.RowsAffected() == 1, nil
}

const sqlSetEffectState = `
UPDATE effect_ledger SET state = $3,
  observed_result_sha256 = COALESCE($4, observed_result_sha256),
  error_code = COALESCE($5, error_code),
  updated_at = now()
WHERE effect_id = $1 AND state = $2`

// insertOutbox writes the event of a task change in the transaction of the
// change (seed 4): outbox_id is a new UUIDv7 and becomes the event id.
func insertOutbox(ctx context.Context, q querier, eventType string, t taskevent.Task) (taskevent.Event, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return taskevent.Event{}, fmt.Errorf("new outbox id: %w", err)
	}
	ev := taskevent.Event{
		EventID:       id.String(),
		EventType:     eventType,
		SchemaVersion: taskevent.SchemaVersion,
		TaskID:        t.TaskID,
		TaskVersion:   t.Version,
		OccurredAt:    t.UpdatedAt,
		Task:          t,
	}
	value, sum, err := taskevent.Encode(&ev)
	if err != nil {
		return ev, err
	}
	_, err = q.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6)`, ev.EventID, t.TaskID, t.Version, eventType, string(value), sum)
	if err != nil {
		return ev, fmt.Errorf("insert %s outbox event of task %s: %w", eventType, t.TaskID, err)
	}
	return ev, nil
}

// lockTask reads a task and locks its row until the transaction ends.
func lockTask(ctx context.Context, q querier, taskID string) (taskevent.Task, bool, error) {
	return oneTask(q.QueryRow(ctx, `SELECT `+taskColumns+` FROM task WHERE task_id = $1 FOR UPDATE`, taskID), "lock task "+taskID)
}

// failTaskAt moves a task from status at version to failed with a terminal
// error code (compare-and-set on status and version).
func failTaskAt(ctx context.Context, q querier, taskID, status string, version int64, code string) (taskevent.Task, bool, error) {
	return oneTask(q.QueryRow(ctx, `
UPDATE task SET status = 'failed', version = version + 1, terminal_error_code = $4, updated_at = now()
WHERE task_id = $1 AND status = $2 AND version = $3
RETURNING `+taskColumns, taskID, status, version, code), "fail task "+taskID)
}
