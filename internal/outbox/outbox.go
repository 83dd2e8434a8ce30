package outbox

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

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

const sqlInsertMany = `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, tenant_id)
SELECT u.id, u.agg, u.ver, u.typ, u.payload, u.sha, COALESCE(u.created, now()), NULLIF(u.tenant, '')
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::timestamptz[], $8::text[])
  AS u(id, agg, ver, typ, payload, sha, created, tenant)`

// QueueInsertMany queues the insert of rows on b as one statement (the
// worker's completion of a run: one statement per run instead of one per
// row; the rows, their WAL records and what the relay streams are those of
// QueueInsert for each, in order). Any row violating a constraint fails
// the statement, and so the transaction. rows must not be empty.
func QueueInsertMany(b *pgx.Batch, rows []Row) {
	n := len(rows)
	ids, aggs, types, payloads, shas, tenants := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	versions := make([]int64, n)
	created := make([]pgtype.Timestamptz, n)
	for i, r := range rows {
		ids[i], aggs[i], versions[i], types[i], payloads[i], shas[i], tenants[i] = r.ID, r.TaskID, r.Version, r.Type, string(r.Payload), r.PayloadSHA256, r.TenantID
		created[i] = pgtype.Timestamptz{Time: r.CreatedAt, Valid: !r.CreatedAt.IsZero()}
	}
	b.Queue(sqlInsertMany, ids, aggs, versions, types, payloads, shas, created, tenants).Exec(func(tag pgconn.CommandTag) error {
		if tag.RowsAffected() != int64(n) {
			return fmt.Errorf("insert %d outbox rows: %d inserted", n, tag.RowsAffected())
		}
		return nil
	})
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

// Backlog finds the unpublished outbox rows without an index on
// published_at (migration 00008: such an index would make every
// MarkPublished a non-HOT update). It keeps a watermark on created_xid, the
// inserting transaction's 64-bit id: every row below it was seen published.
// A row a snapshot cannot see yet belongs to a transaction in progress for
// it, so its created_xid is at least the snapshot's xmin
// (pg_snapshot_xmin); after a scan the watermark moves to the smaller of
// that xmin and the oldest unpublished row the scan found. Each scan so
// reads the rows inserted since the oldest of those two, through
// outbox_event_created_xid_idx. The zero Backlog starts from the first row.
//
// A Backlog is one scanner's state (the reconciler keeps one); concurrent
// scans are safe (a watermark once valid stays valid: a published row stays
// published, so the larger of two is kept). Rows set back to unpublished (published_at reset
// by hand) below the watermark are seen again only by a new Backlog.
type Backlog struct {
	low atomic.Uint64 // created_xid watermark; 0 before the first scan
}

// Stale returns at most limit rows neither published nor parked whose
// created_at is older than age, at or above the watermark, in
// created_xid order (a task's events are written by transactions that
// follow each other, so this is each task's event order): the rows the
// slot did not deliver (a slot lost and recreated, rows committed before
// the slot existed, a relay down). The reconciler republishes them.
func (b *Backlog) Stale(ctx context.Context, q dbpool.Querier, age time.Duration, limit int) ([]Stored, error) {
	rows, err := q.Query(ctx, `SELECT `+storedColumns+` FROM outbox_event
WHERE created_xid >= $1::text::xid8 AND published_at IS NULL AND parked_at IS NULL AND created_at < now() - make_interval(secs => $2)
ORDER BY created_xid, created_at, outbox_id LIMIT $3`, strconv.FormatUint(b.low.Load(), 10), age.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("read stale outbox rows: %w", err)
	}
	defer rows.Close()
	var out []Stored
	for rows.Next() {
		s, err := scanStored(rows)
		if err != nil {
			return nil, fmt.Errorf("read stale outbox rows: %w", err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read stale outbox rows: %w", err)
	}
	return out, nil
}

// Purgeable returns the ids of at most limit outbox rows created more than
// olderThan ago that are published, or parked and decided, and below the
// watermark (issue 13 retention), the oldest first. The rows are found
// through outbox_event_created_brin (migration 00013: only the block ranges
// holding rows older than olderThan, and the one not summarized yet, are
// read), not by walking outbox_event_created_xid_idx from the oldest row,
// which read every published row whenever none was old enough yet. Unpublished rows, and parked rows no one decided on,
// are never among them. The reconciler removes their inbox rows
// (inbox.DeleteMessages), then the rows (DeletePurgeable), in one
// transaction.
func (b *Backlog) Purgeable(ctx context.Context, q dbpool.Querier, olderThan time.Duration, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `
SELECT outbox_id FROM outbox_event
WHERE created_xid < $1::text::xid8 AND created_at < now() - make_interval(secs => $2)
  AND (published_at IS NOT NULL OR decision IS NOT NULL)
ORDER BY created_xid LIMIT $3`, strconv.FormatUint(b.low.Load(), 10), olderThan.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("select purgeable outbox rows: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read purgeable outbox rows: %w", err)
	}
	return ids, nil
}

// DeletePurgeable removes the rows of ids that are published, or parked and
// decided (a row of ids in any other state stays), and returns how many.
func DeletePurgeable(ctx context.Context, q dbpool.Querier, ids []string) (int64, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, `DELETE FROM outbox_event WHERE outbox_id = ANY($1) AND (published_at IS NOT NULL OR decision IS NOT NULL)`, ids)
	if err != nil {
		return 0, fmt.Errorf("delete %d outbox rows: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// IDsOfTask returns the ids of the outbox rows of task taskID (the message
// ids of its events), through the unique (aggregate_id, ...) index.
func IDsOfTask(ctx context.Context, q dbpool.Querier, taskID string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT outbox_id FROM outbox_event WHERE aggregate_id = $1 ORDER BY created_xid`, taskID)
	if err != nil {
		return nil, fmt.Errorf("select outbox rows of task %s: %w", taskID, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read outbox rows of task %s: %w", taskID, err)
	}
	return ids, nil
}

// DeleteOfTask removes the outbox rows of task taskID that are published, or
// parked and decided, and returns how many: the task's removal by
// retention, which first checked that no other row of it is left
// (task.Hold).
func DeleteOfTask(ctx context.Context, q dbpool.Querier, taskID string) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM outbox_event WHERE aggregate_id = $1 AND (published_at IS NOT NULL OR decision IS NOT NULL)`, taskID)
	if err != nil {
		return 0, fmt.Errorf("delete outbox rows of task %s: %w", taskID, err)
	}
	return tag.RowsAffected(), nil
}

// Watermark returns the created_xid below which every row was seen
// published (0 before the first scan).
func (b *Backlog) Watermark() uint64 { return b.low.Load() }

// Unpublished counts the rows unpublished for longer than threshold and
// returns the age of the oldest unpublished row (seconds resolution of
// created_at, which writers may set from their own clock), then advances
// the watermark. An error leaves the watermark where it was.
func (b *Backlog) Unpublished(ctx context.Context, q dbpool.Querier, threshold time.Duration) (rows int, oldest time.Duration, err error) {
	var (
		age float64
		low string
	)
	// One statement: the rows counted and the snapshot whose xmin bounds
	// the rows it could not see are the same (pg_current_snapshot returns
	// the statement's snapshot under READ COMMITTED).
	err = q.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE created_at < now() - make_interval(secs => $2)),
  COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8,
  LEAST(min(created_xid), pg_snapshot_xmin(pg_current_snapshot()))::text
FROM outbox_event WHERE created_xid >= $1::text::xid8 AND published_at IS NULL AND parked_at IS NULL`,
		strconv.FormatUint(b.low.Load(), 10), threshold.Seconds()).Scan(&rows, &age, &low)
	if err != nil {
		return 0, 0, fmt.Errorf("count unpublished outbox rows: %w", err)
	}
	next, err := strconv.ParseUint(low, 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("count unpublished outbox rows: watermark %q: %w", low, err)
	}
	for cur := b.low.Load(); next > cur && !b.low.CompareAndSwap(cur, next); cur = b.low.Load() {
	}
	return rows, time.Duration(age * float64(time.Second)), nil
}
