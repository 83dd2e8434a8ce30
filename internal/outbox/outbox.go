package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/taskevent"
)

// Row is one outbox_event row as written: the event's identity and its
// canonical payload (taskevent.Encode).
type Row struct {
	// ID is the outbox id, also the event id and the message identity
	// consumers deduplicate on: a UUIDv7 (NewEvent).
	ID string
	// TaskID and Version are the aggregate and its version after the change.
	TaskID  string
	Version int64
	// Type is the event type (taskevent.Type*).
	Type string
	// Payload is the canonical JSON of the event; PayloadSHA256 its
	// lowercase hex SHA-256 (the relay publishes these bytes as they are).
	Payload       []byte
	PayloadSHA256 string
	// CreatedAt is the row's created_at; zero: now() of the transaction.
	CreatedAt time.Time
	// TenantID is the task's tenant (the tenant-id record header); empty:
	// none (a task of before tenants).
	TenantID string
}

// NewEvent returns the event of a task change: a new UUIDv7 as event id (the
// outbox id), the task's id and version, occurredAt (UTC) and the snapshot.
func NewEvent(eventType string, t taskevent.Task, occurredAt time.Time) (taskevent.Event, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return taskevent.Event{}, fmt.Errorf("new outbox id: %w", err)
	}
	return taskevent.Event{EventID: id.String(), EventType: eventType, SchemaVersion: taskevent.SchemaVersion,
		TaskID: t.TaskID, TaskVersion: t.Version, OccurredAt: occurredAt.UTC(), Task: t}, nil
}

// RowOf encodes ev into its outbox row.
func RowOf(ev *taskevent.Event) (Row, error) {
	value, sum, err := taskevent.Encode(ev)
	if err != nil {
		return Row{}, err
	}
	return Row{ID: ev.EventID, TaskID: ev.TaskID, Version: ev.TaskVersion, Type: ev.EventType, Payload: value, PayloadSHA256: sum,
		TenantID: ev.Task.TenantID}, nil
}

const sqlInsert = `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, tenant_id)
VALUES ($1, $2, $3, $4, $5, $6, COALESCE($7, now()), NULLIF($8, ''))`

func (r Row) args() []any {
	var created *time.Time
	if !r.CreatedAt.IsZero() {
		created = &r.CreatedAt
	}
	return []any{r.ID, r.TaskID, r.Version, r.Type, string(r.Payload), r.PayloadSHA256, created, r.TenantID}
}

// Insert writes the event of a task change in the transaction of the change
// (seed 4): eventType of snapshot t, occurred at t.UpdatedAt. It returns the
// event as written. A second event of the same (task, version, type) fails
// on the unique constraint.
func Insert(ctx context.Context, q dbpool.Querier, eventType string, t taskevent.Task) (taskevent.Event, error) {
	ev, err := NewEvent(eventType, t, t.UpdatedAt)
	if err != nil {
		return ev, err
	}
	row, err := RowOf(&ev)
	if err != nil {
		return ev, err
	}
	if _, err := q.Exec(ctx, sqlInsert, row.args()...); err != nil {
		return ev, fmt.Errorf("insert %s outbox event of task %s: %w", eventType, t.TaskID, err)
	}
	return ev, nil
}

// InsertOnce writes ev unless an event of the same task, version and type
// exists (the unique constraint decides); it reports whether it wrote it.
// The reconciler's re-drive uses it: one TaskRedriveRequested per task
// version.
func InsertOnce(ctx context.Context, q dbpool.Querier, ev *taskevent.Event) (bool, error) {
	row, err := RowOf(ev)
	if err != nil {
		return false, err
	}
	tag, err := q.Exec(ctx, sqlInsert+`
ON CONFLICT (aggregate_id, aggregate_version, event_type) DO NOTHING`, row.args()...)
	if err != nil {
		return false, fmt.Errorf("insert %s outbox event of task %s: %w", ev.EventType, ev.TaskID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// QueueInsert queues the insert of row on b (the API's pipelined create
// transaction, which encodes the payload itself).
func QueueInsert(b *pgx.Batch, row Row) {
	b.Queue(sqlInsert, row.args()...)
}

// MarkPublished sets published_at and counts the attempt of the rows of ids
// that are not marked yet (seed 4: after the broker's confirmation). Rows
// already marked (a republication after a restart) are left as they are. It
// returns the rows it changed: fewer than ids when some are marked already
// or not visible to this session yet (Unmarked tells which).
func MarkPublished(ctx context.Context, q dbpool.Querier, ids []string) (int64, error) {
	tag, err := q.Exec(ctx, `
UPDATE outbox_event
SET published_at = now(), publish_attempts = publish_attempts + 1
WHERE outbox_id = ANY($1) AND published_at IS NULL`, ids)
	if err != nil {
		return 0, fmt.Errorf("mark %d outbox rows published: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// Unpublished counts the rows unpublished for longer than threshold and
// returns the age of the oldest unpublished row (the reconciler's backlog
// report).
func Unpublished(ctx context.Context, q dbpool.Querier, threshold time.Duration) (rows int, oldest time.Duration, err error) {
	var age float64
	err = q.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE created_at < now() - make_interval(secs => $1)),
  COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8
FROM outbox_event WHERE published_at IS NULL`, threshold.Seconds()).Scan(&rows, &age)
	if err != nil {
		return 0, 0, fmt.Errorf("count unpublished outbox rows: %w", err)
	}
	return rows, time.Duration(age * float64(time.Second)), nil
}
