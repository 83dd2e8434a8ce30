package outbox

import (
	"context"
	"fmt"
	"slices"
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
// that are not published yet (seed 4: after the broker's confirmation): the
// row-by-row record of a republication (RepublishUnpublished, an operator's
// republish). Rows already published — by their own mark or through their
// transaction (RecordTransactions) — are left as they are. It returns the
// rows it changed.
func MarkPublished(ctx context.Context, q dbpool.Querier, ids []string) (int64, error) {
	tag, err := q.Exec(ctx, `
UPDATE outbox_event
SET published_at = now(), publish_attempts = publish_attempts + 1
WHERE outbox_id = ANY($1) AND published_at IS NULL AND (parked_at IS NOT NULL OR `+sqlNotRecorded+`)`, ids)
	if err != nil {
		return 0, fmt.Errorf("mark %d outbox rows published: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// sqlRecorded is true for an outbox_event row whose transaction the relay
// recorded (RecordTransactions); sqlNotRecorded for one whose it has not.
const (
	sqlRecorded    = `EXISTS (SELECT 1 FROM outbox_published_transaction pt WHERE pt.xid = outbox_event.created_xid)`
	sqlNotRecorded = `NOT ` + sqlRecorded
)

// sqlUnpublishedRow is true for an outbox_event row that is neither
// published nor parked: outbox_published_at(row) IS NULL AND parked_at IS
// NULL (migration 00015), written out so that the planner sees an
// anti-join.
const sqlUnpublishedRow = `published_at IS NULL AND parked_at IS NULL AND ` + sqlNotRecorded

// sqlSettledRow is true for an outbox_event row that may be removed:
// published (its own mark, or not parked and its transaction recorded), or
// parked and decided.
const sqlSettledRow = `(published_at IS NOT NULL OR decision IS NOT NULL OR (parked_at IS NULL AND ` + sqlRecorded + `))`

// sqlWidenXID turns $1, an array of 32-bit transaction ids (the xids of
// pgoutput Begin messages, as bigint), into the 64-bit ids (xid8) that
// created_xid holds: each is taken in the epoch that puts it within 2^31 of
// the reference, pg_current_xact_id() of the recording transaction, which
// is newer than every transaction the slot decoded (PostgreSQL keeps every
// live xid within 2^31 of the next one: wraparound protection). The
// widening is wrapXIDExpr; TestWidenXID checks it across an epoch boundary.
const wrapXIDExpr = `(r - ((((r % 4294967296) - x + 2147483648) % 4294967296 + 4294967296) % 4294967296 - 2147483648))`

// RecordTransactions records that every outbox row of the transactions
// xids (32-bit top-level transaction ids, as pgoutput's Begin message
// carries them) was acknowledged by the broker or parked: those rows that
// are not parked are published (outbox_published_at, migration 00015). One
// statement and one narrow row per transaction, instead of an UPDATE of
// every row; a transaction recorded already (a restart streamed it again)
// is left as it is. Call it only for transactions the relay received whole
// (their Commit seen) and all of whose rows are settled: nothing else
// proves that a row was published. It returns how many transactions it
// recorded.
func RecordTransactions(ctx context.Context, q dbpool.Querier, xids []uint32) (int64, error) {
	if len(xids) == 0 {
		return 0, nil
	}
	xs := make([]int64, len(xids))
	for i, x := range xids {
		xs[i] = int64(x)
	}
	tag, err := q.Exec(ctx, `
INSERT INTO outbox_published_transaction (xid)
SELECT `+wrapXIDExpr+`::text::xid8
FROM (SELECT pg_current_xact_id()::text::bigint AS r) ref, unnest($1::bigint[]) AS u(x)
ON CONFLICT (xid) DO NOTHING`, xs)
	if err != nil {
		return 0, fmt.Errorf("record %d published outbox transactions: %w", len(xids), err)
	}
	return tag.RowsAffected(), nil
}

// deleteOrphanTransactions removes the recorded transactions among xids
// that have no outbox row left (retention removed their rows). A row of a
// transaction is never left without its record. Two removals of rows of
// the same transaction (two reconcilers, or the outbox window and a task's
// removal) each saw the other's rows, not yet removed, and both kept the
// record for ever: so the records are locked first (FOR UPDATE, in xid
// order, so two such removals never deadlock), and the question "is a row
// left" is asked by the next statement, whose snapshot is taken once the
// lock is granted, so it sees the removals committed meanwhile (READ
// COMMITTED, the project's isolation). The question is a subquery with
// LIMIT 1 on created_xid's index: as NOT EXISTS, pulled up into an
// anti-join, the planner could hash the whole outbox instead
// (TestPassReadsOnlyWhatItLooksFor).
func deleteOrphanTransactions(ctx context.Context, q dbpool.Querier, xids []string) error {
	if len(xids) == 0 {
		return nil
	}
	if _, err := q.Exec(ctx, `
SELECT 1 FROM outbox_published_transaction WHERE xid = ANY($1::text[]::xid8[]) ORDER BY xid FOR UPDATE`, xids); err != nil {
		return fmt.Errorf("lock the records of %d published outbox transactions: %w", len(xids), err)
	}
	if _, err := q.Exec(ctx, `
DELETE FROM outbox_published_transaction pt
WHERE pt.xid = ANY($1::text[]::xid8[])
  AND (SELECT true FROM outbox_event e WHERE e.created_xid = pt.xid LIMIT 1) IS NULL`, xids); err != nil {
		return fmt.Errorf("delete the records of %d published outbox transactions: %w", len(xids), err)
	}
	return nil
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
// Its statements are planned at each call with the watermark they are given
// (pgx.QueryExecModeExec: no cached generic plan, which would estimate a
// third of the outbox above an unknown watermark and could read every
// transaction record per scan; the scans run once per reconciler pass).
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
WHERE created_xid >= $1::text::xid8 AND `+sqlUnpublishedRow+` AND created_at < now() - make_interval(secs => $2)
ORDER BY created_xid, created_at, outbox_id LIMIT $3`, pgx.QueryExecModeExec, strconv.FormatUint(b.low.Load(), 10), age.Seconds(), limit)
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
// watermark (issue 13 retention), in the table's order (about the order
// they were created in), leaving out the ids of skip (rows a caller kept
// in an earlier batch: without it, rows kept at the front of the table
// would fill every batch). The rows are found through
// outbox_event_created_brin (migration 00013: only the block ranges holding
// rows older than olderThan, and the one not summarized yet, are read), not
// by walking outbox_event_created_xid_idx from the oldest row, which read
// every published row whenever none was old enough yet; the scan stops at
// the limit (an ORDER BY created_xid, which the BRIN index cannot give,
// read and sorted every row past olderThan at each call: 20 ms per 100 rows
// with 40,000 behind them, growing with the backlog, issue 11).
// Unpublished rows, and parked rows no one decided on, are never among
// them. The reconciler removes their inbox rows
// (inbox.DeleteMessages), then the rows no inbox row of which is
// processing (DeletePurgeable), in one transaction.
func (b *Backlog) Purgeable(ctx context.Context, q dbpool.Querier, olderThan time.Duration, limit int, skip []string) ([]string, error) {
	if skip == nil {
		skip = []string{} // nil is NULL, and <> ALL (NULL) is never true
	}
	rows, err := q.Query(ctx, `
SELECT outbox_id FROM outbox_event
WHERE created_xid < $1::text::xid8 AND created_at < now() - make_interval(secs => $2)
  AND `+sqlSettledRow+` AND outbox_id <> ALL ($4::text[])
LIMIT $3`, pgx.QueryExecModeExec, strconv.FormatUint(b.low.Load(), 10), olderThan.Seconds(), limit, skip)
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
// decided (a row of ids in any other state stays), and the records of their
// transactions that no row is left of, and returns the ids of the rows it
// removed. Run it in a transaction with the caller's other removals.
func DeletePurgeable(ctx context.Context, q dbpool.Querier, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `DELETE FROM outbox_event WHERE outbox_id = ANY($1) AND `+sqlSettledRow+` RETURNING outbox_id, created_xid::text`, ids)
	if err != nil {
		return nil, fmt.Errorf("delete %d outbox rows: %w", len(ids), err)
	}
	var removed, xids []string
	var id, xid string
	if _, err := pgx.ForEachRow(rows, []any{&id, &xid}, func() error {
		removed, xids = append(removed, id), append(xids, xid)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("delete %d outbox rows: %w", len(ids), err)
	}
	return removed, deleteOrphanTransactions(ctx, q, xids)
}

// IDsOfTasks returns, for each of taskIDs, the ids of its outbox rows (the
// message ids of its events), oldest first, in one statement through the
// unique (aggregate_id, ...) index (a task without rows has no entry).
func IDsOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (map[string][]string, error) {
	rows, err := q.Query(ctx, `SELECT aggregate_id, outbox_id FROM outbox_event WHERE aggregate_id = ANY($1) ORDER BY aggregate_id, created_xid`, taskIDs)
	if err != nil {
		return nil, fmt.Errorf("select outbox rows of %d tasks: %w", len(taskIDs), err)
	}
	ids := make(map[string][]string, len(taskIDs))
	var task, id string
	if _, err := pgx.ForEachRow(rows, []any{&task, &id}, func() error { ids[task] = append(ids[task], id); return nil }); err != nil {
		return nil, fmt.Errorf("read outbox rows of %d tasks: %w", len(taskIDs), err)
	}
	return ids, nil
}

// DeleteOfTasks removes the outbox rows of the tasks of taskIDs that are
// published, or parked and decided, and the records of their transactions
// that no row is left of, and returns how many rows it removed: the
// removal of tasks by retention, which first checked that no other row of
// them is left (task.Holds). One statement for the rows, one for the
// records (rows of several tasks created by one transaction, as the API's
// group commit creates them, leave its record only when the last of them
// goes, which one transaction removing them all sees).
func DeleteOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (int64, error) {
	if len(taskIDs) == 0 {
		return 0, nil
	}
	rows, err := q.Query(ctx, `DELETE FROM outbox_event WHERE aggregate_id = ANY($1) AND `+sqlSettledRow+` RETURNING created_xid::text`, taskIDs)
	if err != nil {
		return 0, fmt.Errorf("delete outbox rows of %d tasks: %w", len(taskIDs), err)
	}
	xids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("delete outbox rows of %d tasks: %w", len(taskIDs), err)
	}
	return int64(len(xids)), deleteOrphanTransactions(ctx, q, slices.Compact(slices.Sorted(slices.Values(xids))))
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
FROM outbox_event WHERE created_xid >= $1::text::xid8 AND `+sqlUnpublishedRow,
		pgx.QueryExecModeExec, strconv.FormatUint(b.low.Load(), 10), threshold.Seconds()).Scan(&rows, &age, &low)
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
