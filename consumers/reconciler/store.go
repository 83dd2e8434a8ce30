package reconciler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/taskevent"
)

// All SQL of the reconciler. Every repair is a compare-and-set on the
// effect's state, so a repair computed from a stale read can never undo
// newer progress (DESIGN.md, River's rescuer bug).

// querier is what the store functions need from a pgx.Tx or *pgxpool.Pool.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ querier = pgx.Tx(nil)
	_ querier = (*pgxpool.Pool)(nil)
)

// Effect kinds and states (effect_ledger, seed 7).
const (
	kindArtifactPut = "artifact.put"

	statePlanned              = "planned"
	stateStarted              = "started"
	stateUnknown              = "unknown"
	stateVerified             = "verified"
	stateCompensationRequired = "compensation_required"
	stateCompensated          = "compensated"
)

// effect is an effect_ledger row as the reconciler reads it.
type effect struct {
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
	UpdatedAt      time.Time
}

const effectColumns = `effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state,
request_sha256, request_size, observed_result_sha256, updated_at`

func scanEffects(rows pgx.Rows) ([]effect, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (effect, error) {
		var e effect
		err := row.Scan(&e.EffectID, &e.TaskID, &e.Attempt, &e.Kind, &e.Token, &e.TargetIdentity, &e.State,
			&e.RequestSHA256, &e.RequestSize, &e.ObservedSHA256, &e.UpdatedAt)
		return e, err
	})
}

// staleEffects returns at most limit effects of kind kind in one of states
// whose updated_at is older than deadline, oldest first.
func staleEffects(ctx context.Context, q querier, kind string, states []string, deadline time.Duration, limit int) ([]effect, error) {
	rows, err := q.Query(ctx, `
SELECT `+effectColumns+`
FROM effect_ledger
WHERE effect_kind = $1 AND state = ANY($2) AND updated_at < now() - make_interval(secs => $3)
ORDER BY updated_at
LIMIT $4`, kind, states, deadline.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("select stale %s effects: %w", kind, err)
	}
	effects, err := scanEffects(rows)
	if err != nil {
		return nil, fmt.Errorf("read stale %s effects: %w", kind, err)
	}
	return effects, nil
}

// setState moves an effect from state from to state to (compare-and-set);
// observed and code are stored when non-nil. It returns false when the
// effect was no longer in state from.
func setState(ctx context.Context, q querier, effectID, from, to string, observed, code *string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE effect_ledger SET state = $3,
  observed_result_sha256 = COALESCE($4, observed_result_sha256),
  error_code = COALESCE($5, error_code),
  updated_at = now()
WHERE effect_id = $1 AND state = $2`, effectID, from, to, observed, code)
	if err != nil {
		return false, fmt.Errorf("effect %s %s -> %s: %w", effectID, from, to, err)
	}
	return tag.RowsAffected() == 1, nil
}

// oneVerifiedIndex allows at most one verified artifact.put effect per
// task (migration 00003; worker.OneVerifiedIndex).
const oneVerifiedIndex = "effect_ledger_one_verified_put_idx"

// oneVerifiedViolation reports whether err violates oneVerifiedIndex.
func oneVerifiedViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == oneVerifiedIndex
}

// planHide writes the ledger row of the compensation of effect e (kind
// artifact.hide, token "compensation-for-<effect_id>", seed 8) unless it
// exists, and returns its id and current state.
func planHide(ctx context.Context, q querier, e effect, requestSHA256 string) (id, state string, err error) {
	id = "compensation-for-" + e.EffectID
	_, err = q.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, 'artifact.hide', $1, $4, 'started', $5, $6)
ON CONFLICT (effect_kind, idempotency_token) DO NOTHING`, id, e.TaskID, e.Attempt, e.TargetIdentity, requestSHA256, e.RequestSize)
	if err != nil {
		return id, "", fmt.Errorf("plan compensation %s: %w", id, err)
	}
	err = q.QueryRow(ctx, `SELECT state FROM effect_ledger WHERE effect_kind = 'artifact.hide' AND idempotency_token = $1`, id).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return id, "", fmt.Errorf("compensation %s vanished", id)
	}
	if err != nil {
		return id, "", fmt.Errorf("read compensation %s: %w", id, err)
	}
	return id, state, nil
}

// inboxRow is an inbox row left processing, with its task's status (nil
// when the message names no known task).
type inboxRow struct {
	Consumer   string
	MessageID  string
	LastSeenAt time.Time
	TaskID     *string
	TaskStatus *string
}

// staleInbox returns at most limit inbox rows processing with no delivery
// for lease, oldest first, with the status of the task their message
// (outbox event) belongs to.
func staleInbox(ctx context.Context, q querier, lease time.Duration, limit int) ([]inboxRow, error) {
	rows, err := q.Query(ctx, `
SELECT i.consumer_name, i.message_id, i.last_seen_at, t.task_id, t.status
FROM inbox_message i
LEFT JOIN outbox_event o ON o.outbox_id = i.message_id
LEFT JOIN task t ON t.task_id = o.aggregate_id
WHERE i.state = 'processing' AND i.last_seen_at < now() - make_interval(secs => $1)
ORDER BY i.last_seen_at
LIMIT $2`, lease.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("select stale inbox rows: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (inboxRow, error) {
		var r inboxRow
		err := row.Scan(&r.Consumer, &r.MessageID, &r.LastSeenAt, &r.TaskID, &r.TaskStatus)
		return r, err
	})
}

// releaseInbox finishes a processing inbox row whose task is terminal
// (compare-and-set on state and last_seen_at as read).
func releaseInbox(ctx context.Context, q querier, in inboxRow, taskStatus string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE inbox_message SET state = 'completed', completed_at = now(),
  result_json = jsonb_build_object('released_by', 'reconciler', 'task_status', $3::text)
WHERE consumer_name = $1 AND message_id = $2 AND state = 'processing' AND last_seen_at = $4`,
		in.Consumer, in.MessageID, taskStatus, in.LastSeenAt)
	if err != nil {
		return false, fmt.Errorf("release inbox row %s: %w", in.MessageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

const taskColumns = `task_id, status, version, attempt, output_format, input_sha256, input_size,
artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at`

func scanTask(row pgx.Row) (taskevent.Task, error) {
	var t taskevent.Task
	err := row.Scan(&t.TaskID, &t.Status, &t.Version, &t.Attempt, &t.OutputFormat, &t.InputSHA256, &t.InputSize,
		&t.ArtifactSHA256, &t.ArtifactSize, &t.TerminalErrorCode, &t.CreatedAt, &t.UpdatedAt, &t.CompletedAt)
	t.CreatedAt, t.UpdatedAt = t.CreatedAt.UTC(), t.UpdatedAt.UTC()
	if t.CompletedAt != nil {
		c := t.CompletedAt.UTC()
		t.CompletedAt = &c
	}
	return t, err
}

func collectTasks(rows pgx.Rows, err error) ([]taskevent.Task, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (taskevent.Task, error) { return scanTask(row) })
}

// stuckTasks returns at most limit tasks queued or running without an
// update for deadline that have no TaskRedriveRequested for their current
// version yet, oldest first.
func stuckTasks(ctx context.Context, q querier, deadline time.Duration, limit int) ([]taskevent.Task, error) {
	ts, err := collectTasks(q.Query(ctx, `
SELECT `+taskColumns+` FROM task t
WHERE status IN ('queued', 'running') AND updated_at < now() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM outbox_event o WHERE o.aggregate_id = t.task_id AND o.aggregate_version = t.version
                  AND o.event_type = 'TaskRedriveRequested')
ORDER BY updated_at
LIMIT $2`, deadline.Seconds(), limit))
	if err != nil {
		return nil, fmt.Errorf("select stuck tasks: %w", err)
	}
	return ts, nil
}

// redrive writes a TaskRedriveRequested outbox event for t's current
// version, in a transaction that locks the task and checks it is still at
// t's status and version (compare-and-set). false: the task moved, or a
// re-drive of this version exists.
func redrive(ctx context.Context, db *pgxpool.Pool, t taskevent.Task) (bool, error) {
	var ok bool
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		cur, err := scanTask(tx.QueryRow(ctx, `SELECT `+taskColumns+` FROM task WHERE task_id = $1 AND status = $2 AND version = $3 FOR UPDATE`,
			t.TaskID, t.Status, t.Version))
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("lock task %s: %w", t.TaskID, err)
		}
		id, err := uuid.NewV7()
		if err != nil {
			return err
		}
		ev := taskevent.Event{EventID: id.String(), EventType: taskevent.TypeTaskRedriveRequested, SchemaVersion: taskevent.SchemaVersion,
			TaskID: cur.TaskID, TaskVersion: cur.Version, OccurredAt: time.Now().UTC().Truncate(time.Microsecond), Task: cur}
		value, sum, err := taskevent.Encode(&ev)
		if err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (aggregate_id, aggregate_version, event_type) DO NOTHING`, ev.EventID, cur.TaskID, cur.Version, ev.EventType, string(value), sum)
		if err != nil {
			return fmt.Errorf("insert re-drive of task %s: %w", t.TaskID, err)
		}
		ok = tag.RowsAffected() == 1
		return nil
	})
	return ok, err
}

// idemRecord is an idempotency record in_progress past locked_until.
type idemRecord struct {
	Scope, Key string
	TaskID     *string
}

func expiredIdempotency(ctx context.Context, q querier, limit int) ([]idemRecord, error) {
	rows, err := q.Query(ctx, `
SELECT scope, idempotency_key, task_id FROM idempotency_record
WHERE state = 'in_progress' AND locked_until < now()
ORDER BY locked_until LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("select expired idempotency records: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (idemRecord, error) {
		var r idemRecord
		err := row.Scan(&r.Scope, &r.Key, &r.TaskID)
		return r, err
	})
}

// resolveIdempotency resolves an expired in_progress record from the task
// state (compare-and-set on state in_progress): with a task, succeeded with
// the 202 response of the task as first created (status queued, version 0,
// the API's body shape); without one, the record is deleted so the same
// key can create the task.
func resolveIdempotency(ctx context.Context, q querier, rec idemRecord) (bool, error) {
	var tag pgconn.CommandTag
	var err error
	if rec.TaskID != nil {
		tag, err = q.Exec(ctx, `
UPDATE idempotency_record i SET state = 'succeeded', response_status = 202, locked_until = NULL,
  response_body = jsonb_build_object('task_id', t.task_id, 'status', 'queued', 'version', 0, 'input_sha256', t.input_sha256,
    'output_format', t.output_format, 'links', jsonb_build_object('self', '/v1/tasks/' || t.task_id, 'artifact', '/v1/tasks/' || t.task_id || '/artifact'))
FROM task t
WHERE i.scope = $1 AND i.idempotency_key = $2 AND i.state = 'in_progress' AND t.task_id = i.task_id`, rec.Scope, rec.Key)
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

// unpublishedOutbox counts outbox rows unpublished for longer than
// threshold and returns the age of the oldest unpublished row.
func unpublishedOutbox(ctx context.Context, q querier, threshold time.Duration) (int, time.Duration, error) {
	var n int
	var age float64
	err := q.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE created_at < now() - make_interval(secs => $1)),
  COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8
FROM outbox_event WHERE published_at IS NULL`, threshold.Seconds()).Scan(&n, &age)
	if err != nil {
		return 0, 0, fmt.Errorf("count unpublished outbox rows: %w", err)
	}
	return n, time.Duration(age * float64(time.Second)), nil
}

// tasksAfter returns at most limit tasks with task_id > after, by task id.
func tasksAfter(ctx context.Context, q querier, after string, limit int) ([]taskevent.Task, error) {
	ts, err := collectTasks(q.Query(ctx, `SELECT `+taskColumns+` FROM task WHERE task_id > $1 ORDER BY task_id LIMIT $2`, after, limit))
	if err != nil {
		return nil, fmt.Errorf("select tasks for the cache scan: %w", err)
	}
	return ts, nil
}
