package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/testenv"
)

// insertRow writes an outbox row created an hour ago (so any threshold
// below that counts it), published or not.
func insertRow(t *testing.T, q dbpool.Querier, id string, published bool) {
	t.Helper()
	var at any
	if published {
		at = time.Now()
	}
	if _, err := q.Exec(context.Background(), `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, published_at)
VALUES ($1, $1, 1, 'TaskCreated', '{}', repeat('0', 64), now() - interval '1 hour', $2)`, id, at); err != nil {
		t.Fatalf("insert %s: %v", id, err)
	}
}

func unpublished(t *testing.T, b *outbox.Backlog, q dbpool.Querier) (int, time.Duration) {
	t.Helper()
	n, age, err := b.Unpublished(context.Background(), q, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return n, age
}

// The backlog scan has no index on published_at to lean on (migration
// 00008), only its created_xid watermark. A row whose transaction is still
// open while rows committed after it are scanned must be found once it
// commits; the watermark really bounds the scan (a row reset to unpublished
// below it is seen only by a new Backlog); an error leaves it unchanged.
func TestBacklogWatermark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	var b outbox.Backlog
	insertRow(t, db.Pool, "before-1", true)
	insertRow(t, db.Pool, "before-2", false)
	if n, age := unpublished(t, &b, db.Pool); n != 1 || age < 59*time.Minute {
		t.Fatalf("first scan: %d rows, oldest %s; want 1, about 1h", n, age)
	}

	held, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Rollback(ctx)
	insertRow(t, held, "held", false)
	for i := range 3 {
		insertRow(t, db.Pool, fmt.Sprintf("after-%d", i), true)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET published_at = now() WHERE outbox_id = 'before-2'`); err != nil {
		t.Fatal(err)
	}
	// The held row is invisible; the scan may move its watermark up to the
	// snapshot's xmin, which the held transaction bounds.
	if n, _ := unpublished(t, &b, db.Pool); n != 0 {
		t.Fatalf("scan with the row held: %d rows, want 0", n)
	}
	insertRow(t, db.Pool, "after-3", true)
	if n, _ := unpublished(t, &b, db.Pool); n != 0 {
		t.Fatalf("second scan with the row held: %d rows, want 0", n)
	}
	if err := held.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := unpublished(t, &b, db.Pool); n != 1 {
		t.Fatalf("scan after the held row committed: %d rows, want 1 (the watermark passed it)", n)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET published_at = now() WHERE outbox_id = 'held'`); err != nil {
		t.Fatal(err)
	}
	if n, _ := unpublished(t, &b, db.Pool); n != 0 {
		t.Fatalf("scan after marking: %d rows, want 0", n)
	}

	// Everything is published: the watermark moves past every row as soon
	// as no older transaction runs in the cluster (xids are cluster-wide,
	// and other tests share it). A row set back to unpublished by hand is
	// then below it, and the scan does not see it.
	var maxXID uint64
	if err := db.Pool.QueryRow(ctx, `SELECT max(created_xid)::text::bigint FROM outbox_event`).Scan(&maxXID); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); b.Watermark() <= maxXID; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("watermark %d still at or below the newest row's xid %d after 20s with every row published", b.Watermark(), maxXID)
		}
		if n, _ := unpublished(t, &b, db.Pool); n != 0 {
			t.Fatalf("scan with every row published: %d rows", n)
		}
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET published_at = NULL WHERE outbox_id = 'before-1'`); err != nil {
		t.Fatal(err)
	}
	if n, _ := unpublished(t, &b, db.Pool); n != 0 {
		t.Fatalf("scan of a row reset below the watermark: %d rows, want 0 (the scan starts at the watermark)", n)
	}
	var fresh outbox.Backlog
	if n, _ := unpublished(t, &fresh, db.Pool); n != 1 {
		t.Fatalf("new Backlog: %d rows, want 1", n)
	}

	// A failing scan (a closed connection) returns its error and keeps the
	// watermark: a new row is still found afterwards.
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if _, _, err := b.Unpublished(ctx, conn, time.Minute); err == nil {
		t.Fatal("scan on a closed connection: no error")
	}
	insertRow(t, db.Pool, "late", false)
	if n, _ := unpublished(t, &b, db.Pool); n != 1 {
		t.Fatalf("scan after an error: %d rows, want 1", n)
	}
}
