package task

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/taskevent"
)

// Columns are the task columns Scan reads, in its order.
const Columns = `task_id, COALESCE(tenant_id, ''), status, version, attempt, output_format, input_sha256, input_size,
artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at`

// Scan reads a row of Columns into a snapshot; times are UTC.
func Scan(row pgx.Row) (taskevent.Task, error) {
	var t taskevent.Task
	err := row.Scan(dests(&t)...)
	if err != nil {
		return t, err
	}
	inUTC(&t)
	return t, nil
}

// dests are the scan destinations of Columns in t, in their order.
func dests(t *taskevent.Task) []any {
	return []any{&t.TaskID, &t.TenantID, &t.Status, &t.Version, &t.Attempt, &t.OutputFormat, &t.InputSHA256, &t.InputSize,
		&t.ArtifactSHA256, &t.ArtifactSize, &t.TerminalErrorCode, &t.CreatedAt, &t.UpdatedAt, &t.CompletedAt}
}

// inUTC puts t's times in UTC.
func inUTC(t *taskevent.Task) {
	t.CreatedAt, t.UpdatedAt = t.CreatedAt.UTC(), t.UpdatedAt.UTC()
	if t.CompletedAt != nil {
		c := t.CompletedAt.UTC()
		t.CompletedAt = &c
	}
}

// Changed is the outcome of a compare-and-set transition: Applied reports
// whether the row matched; Task is the snapshot after the change (zero when
// not applied).
type Changed struct {
	Task    taskevent.Task
	Applied bool
}

// scanChanged reads the RETURNING row of a transition; no row is a
// transition that did not apply.
func scanChanged(row pgx.Row, out *Changed, action string) error {
	t, err := Scan(row)
	if errors.Is(err, pgx.ErrNoRows) {
		*out = Changed{}
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w", action, err)
	}
	*out = Changed{Task: t, Applied: true}
	return nil
}

func checkOne(tag pgconn.CommandTag, action string) error {
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%s: %d rows, want 1", action, tag.RowsAffected())
	}
	return nil
}

func one(row pgx.Row, action string) (taskevent.Task, bool, error) {
	var c Changed
	err := scanChanged(row, &c, action)
	return c.Task, c.Applied, err
}

// Get reads task id; found is false when it does not exist (or is not
// visible to this session yet: see consumers/worker, ErrNotYetVisible).
func Get(ctx context.Context, q dbpool.Querier, id string) (t taskevent.Task, found bool, err error) {
	return one(q.QueryRow(ctx, `SELECT `+Columns+` FROM task WHERE task_id = $1`, id), "read task "+id)
}

// Lock reads task id and locks its row until the transaction ends.
func Lock(ctx context.Context, q dbpool.Querier, id string) (t taskevent.Task, found bool, err error) {
	return one(q.QueryRow(ctx, `SELECT `+Columns+` FROM task WHERE task_id = $1 FOR UPDATE`, id), "lock task "+id)
}

// LockIfAt locks task id when it is still at status and version (a
// compare-and-set read for a repair computed from an earlier read); found is
// false when it moved.
func LockIfAt(ctx context.Context, q dbpool.Querier, id, status string, version int64) (t taskevent.Task, found bool, err error) {
	return one(q.QueryRow(ctx, `SELECT `+Columns+` FROM task WHERE task_id = $1 AND status = $2 AND version = $3 FOR UPDATE`,
		id, status, version), "lock task "+id)
}

// QueueCreate queues, on b, the inserts of a new task (snapshot t at version
// 0, with the request fingerprint of its idempotency record) and of its
// document (task_input, whose foreign key needs the task). The API runs them
// in its pipelined create transaction (seed 3.1).
func QueueCreate(b *pgx.Batch, t taskevent.Task, fingerprint string, document []byte) {
	b.Queue(`
INSERT INTO task (task_id, tenant_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at)
VALUES ($1, NULLIF($2, ''), $3, $4, $5, $6, $7, $8, $9, $10, $11)`,
		t.TaskID, t.TenantID, fingerprint, t.Status, t.Version, t.Attempt, t.OutputFormat, t.InputSHA256, t.InputSize, t.CreatedAt, t.UpdatedAt).
		Exec(func(tag pgconn.CommandTag) error { return checkOne(tag, "insert task "+t.TaskID) })
	b.Queue(`INSERT INTO task_input (task_id, document) VALUES ($1, $2)`, t.TaskID, document).
		Exec(func(tag pgconn.CommandTag) error { return checkOne(tag, "insert input of task "+t.TaskID) })
}

// Document reads the stored input of task id (task_input.document: see
// CanonicalInput); found is false when the task has no task_input row.
func Document(ctx context.Context, q dbpool.Querier, id string) (doc []byte, found bool, err error) {
	return scanDocument(q.QueryRow(ctx, sqlDocument, id), id)
}

const sqlDocument = `SELECT document FROM task_input WHERE task_id = $1`

func scanDocument(row pgx.Row, id string) ([]byte, bool, error) {
	var doc []byte
	err := row.Scan(&doc)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read input of task %s: %w", id, err)
	}
	return doc, true, nil
}

// Transitions. Each is a compare-and-set on status and version that
// increments the version (DESIGN.md "Data model"; seed 2.2, 10); the
// returned snapshot is the one the transition's outbox event carries.

// sqlStartIfQueued moves a task queued -> running when its version is at
// least minVersion: version+1, attempt+1. A task queued at a higher version
// than the event that drives it was re-opened by a dead-letter replay (or is
// re-driven) and starts from its current version. Of two deliveries only
// one starts the task.
const sqlStartIfQueued = `
UPDATE task SET status = 'running', version = version + 1, attempt = attempt + 1, updated_at = now()
WHERE task_id = $1 AND status = 'queued' AND version >= $2
RETURNING ` + Columns

// StartIfQueued moves task id queued -> running (see sqlStartIfQueued).
func StartIfQueued(ctx context.Context, q dbpool.Querier, id string, minVersion int64) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, sqlStartIfQueued, id, minVersion), &c, "start task "+id)
	return c, err
}

// sqlStartIfQueuedReadingDocument is sqlStartIfQueued that also returns, after
// Columns, the task's document (Document; NULL when task_input has no row):
// the worker's intake reads the document in the statement that starts the
// task instead of one of its own.
const sqlStartIfQueuedReadingDocument = sqlStartIfQueued + `,
  (SELECT document FROM task_input WHERE task_input.task_id = task.task_id)`

// QueueStartIfQueuedReadingDocument queues StartIfQueued on b, reading the
// task's document in the same statement: out is set when the batch's
// results are read; doc and docFound only when the start applied (doc is
// Document's bytes; docFound is false when the task has no input row).
func QueueStartIfQueuedReadingDocument(b *pgx.Batch, id string, minVersion int64, out *Changed, doc *[]byte, docFound *bool) {
	b.Queue(sqlStartIfQueuedReadingDocument, id, minVersion).QueryRow(func(row pgx.Row) error {
		var t taskevent.Task
		*doc, *docFound, *out = nil, false, Changed{}
		err := row.Scan(append(dests(&t), doc)...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("start task %s: %w", id, err)
		}
		inUTC(&t)
		*out, *docFound = Changed{Task: t, Applied: true}, *doc != nil
		return nil
	})
}

const sqlCompleteIfRunning = `
UPDATE task SET status = 'completed', version = version + 1, artifact_sha256 = $3, artifact_size = $4,
  completed_at = now(), updated_at = now()
WHERE task_id = $1 AND status = 'running' AND version = $2
RETURNING ` + Columns

// CompleteIfRunning moves task id running -> completed at version, recording
// its verified artifact's SHA-256 and size (bytes).
func CompleteIfRunning(ctx context.Context, q dbpool.Querier, id string, version int64, artifactSHA256 string, artifactSize int64) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, sqlCompleteIfRunning, id, version, artifactSHA256, artifactSize), &c, "complete task "+id)
	return c, err
}

// QueueCompleteIfRunning queues CompleteIfRunning on b.
func QueueCompleteIfRunning(b *pgx.Batch, id string, version int64, artifactSHA256 string, artifactSize int64, out *Changed) {
	b.Queue(sqlCompleteIfRunning, id, version, artifactSHA256, artifactSize).QueryRow(func(row pgx.Row) error {
		return scanChanged(row, out, "complete task "+id)
	})
}

// FailIfRunning moves task id running -> failed at version with a terminal
// error code.
func FailIfRunning(ctx context.Context, q dbpool.Querier, id string, version int64, code string) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, `
UPDATE task SET status = 'failed', version = version + 1, terminal_error_code = $3, updated_at = now()
WHERE task_id = $1 AND status = 'running' AND version = $2
RETURNING `+Columns, id, version, code), &c, "fail task "+id)
	return c, err
}

// FailIfNotTerminal moves task id, at version and in a status that is not
// terminal, to failed with a terminal error code (a dead letter parks the
// task's record, seed 13.5).
func FailIfNotTerminal(ctx context.Context, q dbpool.Querier, id string, version int64, code string) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, `
UPDATE task SET status = 'failed', version = version + 1, terminal_error_code = $3, updated_at = now()
WHERE task_id = $1 AND version = $2 AND status NOT IN ('completed', 'failed', 'compensated', 'cancelled')
RETURNING `+Columns, id, version, code), &c, "fail task "+id)
	return c, err
}

// CancelIfQueued moves task id queued at version to cancelled (version+1): a
// client's version-guarded cancel (issue 12). The worker's StartIfQueued
// takes the same row at the same version: of a concurrent cancel and start
// exactly one applies.
func CancelIfQueued(ctx context.Context, q dbpool.Querier, id string, version int64) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, `
UPDATE task SET status = 'cancelled', version = version + 1, updated_at = now()
WHERE task_id = $1 AND status = 'queued' AND version = $2
RETURNING `+Columns, id, version), &c, "cancel task "+id)
	return c, err
}

// ReopenIfFailed moves task id failed at version back to queued (version+1,
// no terminal error code, no artifact): a dead-letter replay (package
// deadletter).
func ReopenIfFailed(ctx context.Context, q dbpool.Querier, id string, version int64) (Changed, error) {
	var c Changed
	err := scanChanged(q.QueryRow(ctx, `
UPDATE task SET status = 'queued', version = version + 1, terminal_error_code = NULL,
  artifact_sha256 = NULL, artifact_size = NULL, completed_at = NULL, updated_at = now()
WHERE task_id = $1 AND status = 'failed' AND version = $2
RETURNING `+Columns, id, version), &c, "reopen task "+id)
	return c, err
}

// Stuck returns at most limit tasks queued or running without an update for
// deadline that have no TaskRedriveRequested outbox event for their current
// version yet, oldest first (the reconciler re-drives them).
func Stuck(ctx context.Context, q dbpool.Querier, deadline time.Duration, limit int) ([]taskevent.Task, error) {
	ts, err := collect(q.Query(ctx, `
SELECT `+Columns+` FROM task t
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

// GetMany reads the tasks of ids in one statement; ids without a task are
// left out.
func GetMany(ctx context.Context, q dbpool.Querier, ids []string) ([]taskevent.Task, error) {
	ts, err := collect(q.Query(ctx, `SELECT `+Columns+` FROM task WHERE task_id = ANY($1)`, ids))
	if err != nil {
		return nil, fmt.Errorf("read %d tasks: %w", len(ids), err)
	}
	return ts, nil
}

// After returns at most limit tasks with task_id > after, by task id (a
// cursor over the whole table).
func After(ctx context.Context, q dbpool.Querier, after string, limit int) ([]taskevent.Task, error) {
	ts, err := collect(q.Query(ctx, `SELECT `+Columns+` FROM task WHERE task_id > $1 ORDER BY task_id LIMIT $2`, after, limit))
	if err != nil {
		return nil, fmt.Errorf("select tasks after %q: %w", after, err)
	}
	return ts, nil
}

func collect(rows pgx.Rows, err error) ([]taskevent.Task, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (taskevent.Task, error) { return Scan(row) })
}
