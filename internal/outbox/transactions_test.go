package outbox_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/testenv"
)

// TestWidenXID: a 32-bit xid of pgoutput's Begin is taken in the epoch that
// puts it within 2^31 of the reference (the recording transaction's own
// xid): in the reference's epoch, in the one before across a wraparound, and
// just above the reference (a transaction decoded while the reference was
// taken from a snapshot that did not count it yet).
func TestWidenXID(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const epoch = uint64(1) << 32
	for _, tc := range []struct {
		ref  uint64
		xid  uint32
		want uint64
	}{
		{ref: 1000, xid: 990, want: 990},
		{ref: 1000, xid: 1000, want: 1000},
		{ref: 1000, xid: 1005, want: 1005},
		{ref: 5*epoch + 10, xid: 5, want: 5*epoch + 5},
		{ref: 5*epoch + 10, xid: 4294967293, want: 4*epoch + 4294967293},
		{ref: 5*epoch + 4294967290, xid: 3, want: 6*epoch + 3},
		{ref: 5*epoch + 3_000_000_000, xid: 1_000_000_000, want: 5*epoch + 1_000_000_000},
		{ref: 5*epoch + 500_000_000, xid: 3_500_000_000, want: 4*epoch + 3_500_000_000},
	} {
		var got string
		if err := db.Pool.QueryRow(context.Background(), `SELECT `+outbox.WrapXIDExpr+`::text::xid8::text FROM (SELECT $1::bigint AS r, $2::bigint AS x) v`,
			int64(tc.ref), int64(tc.xid)).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != strconv.FormatUint(tc.want, 10) {
			t.Errorf("widen(ref %d, xid %d) = %s, want %d", tc.ref, tc.xid, got, tc.want)
		}
	}
}

// insertInTx writes outbox rows created an hour ago in one transaction and
// returns its 32-bit xid, as pgoutput's Begin message would carry it.
func insertInTx(t *testing.T, db *testenv.DB, ids ...string) uint32 {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, id := range ids {
		insertRow(t, tx, id, false)
	}
	var full uint64
	if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&full); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return uint32(full)
}

func publishedAt(t *testing.T, q dbpool.Querier, id string) (bool, int) {
	t.Helper()
	var published bool
	var attempts int
	if err := q.QueryRow(context.Background(), `SELECT outbox_published_at(outbox_event) IS NOT NULL, outbox_publish_attempts(outbox_event)
FROM outbox_event WHERE outbox_id = $1`, id).Scan(&published, &attempts); err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	return published, attempts
}

// TestRecordTransactions: the relay's record of a transaction publishes
// every row of it that is not parked (migration 00015), once; rows of other
// transactions stay unpublished for the backlog scan; retention removes a
// transaction's record with its last row.
func TestRecordTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	both := insertInTx(t, db, "a", "b")
	insertInTx(t, db, "c")
	parked := insertInTx(t, db, "p", "q")
	if changed, err := outbox.Park(ctx, db.Pool, "p", "MESSAGE_TOO_LARGE", "too large"); err != nil || !changed {
		t.Fatalf("Park = %v, %v", changed, err)
	}

	n, err := outbox.RecordTransactions(ctx, db.Pool, []uint32{both, parked, both})
	if err != nil || n != 2 {
		t.Fatalf("RecordTransactions = %d, %v; want 2", n, err)
	}
	if n, err := outbox.RecordTransactions(ctx, db.Pool, []uint32{both}); err != nil || n != 0 {
		t.Fatalf("RecordTransactions again = %d, %v; want 0 (recorded already)", n, err)
	}
	for id, want := range map[string]bool{"a": true, "b": true, "c": false, "p": false, "q": true} {
		got, attempts := publishedAt(t, db.Pool, id)
		if got != want {
			t.Errorf("row %s published = %v, want %v", id, got, want)
		}
		if want && attempts != 1 {
			t.Errorf("row %s: %d publish attempts, want 1 (the relay's)", id, attempts)
		}
	}
	// A parked row of a recorded transaction cannot be parked again, and a
	// published one cannot be parked.
	if changed, err := outbox.Park(ctx, db.Pool, "a", "MESSAGE_TOO_LARGE", "too large"); err != nil || changed {
		t.Fatalf("Park of a published row = %v, %v; want unchanged", changed, err)
	}
	if st, err := outbox.Classify(ctx, db.Pool, []outbox.Pending{{ID: "a"}, {ID: "c"}}); err != nil || st[0] != outbox.Marked || st[1] != outbox.Unmarked {
		t.Fatalf("Classify = %v, %v; want Marked, Unmarked", st, err)
	}

	var b outbox.Backlog
	if n, _ := unpublished(t, &b, db.Pool); n != 1 {
		t.Fatalf("backlog = %d rows, want 1 (c)", n)
	}
	stale, err := b.Stale(ctx, db.Pool, time.Minute, 10)
	if err != nil || len(stale) != 1 || stale[0].ID != "c" {
		t.Fatalf("Stale = %+v, %v; want c", stale, err)
	}
	// MarkPublished (a republication) marks c and leaves a alone.
	if n, err := outbox.MarkPublished(ctx, db.Pool, []string{"a", "c"}); err != nil || n != 1 {
		t.Fatalf("MarkPublished = %d, %v; want 1", n, err)
	}

	records := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_published_transaction`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if got, err := outbox.DeletePurgeable(ctx, db.Pool, []string{"a", "p"}); err != nil || !slices.Equal(got, []string{"a"}) {
		t.Fatalf("DeletePurgeable(a, p) = %v, %v; want [a] (p is parked, undecided)", got, err)
	}
	if got := records(); got != 2 {
		t.Fatalf("%d transaction records after a's removal, want 2 (b keeps its own)", got)
	}
	if published, _ := publishedAt(t, db.Pool, "b"); !published {
		t.Fatal("b unpublished after a was removed")
	}
	if got, err := outbox.DeletePurgeable(ctx, db.Pool, []string{"b"}); err != nil || !slices.Equal(got, []string{"b"}) {
		t.Fatalf("DeletePurgeable(b) = %v, %v", got, err)
	}
	if got := records(); got != 1 {
		t.Fatalf("%d transaction records after the last row of a transaction went, want 1", got)
	}
	if n, err := outbox.DeleteOfTasks(ctx, db.Pool, []string{"q"}); err != nil || n != 1 {
		t.Fatalf("DeleteOfTasks(q) = %d, %v", n, err)
	}
	if got := records(); got != 1 {
		t.Fatalf("%d transaction records while parked p is left, want 1", got)
	}
}

// Two removals of rows of the same transaction, concurrent (two
// reconcilers, or the outbox window and a task's removal), leave no record
// of it once both committed: each saw the other's row, not yet removed,
// and both kept the record for ever. The second now waits for the first's
// lock on the record, then sees its removal.
func TestConcurrentRemovalsLeaveNoRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	xid := insertInTx(t, db, "a", "b")
	if n, err := outbox.RecordTransactions(ctx, db.Pool, []uint32{xid}); err != nil || n != 1 {
		t.Fatalf("RecordTransactions = %d, %v", n, err)
	}
	first, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx)
	if got, err := outbox.DeletePurgeable(ctx, first, []string{"a"}); err != nil || len(got) != 1 {
		t.Fatalf("first removal = %v, %v", got, err)
	}
	second := make(chan error, 1)
	go func() {
		second <- pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := outbox.DeletePurgeable(ctx, tx, []string{"b"})
			return err
		})
	}()
	// The second removal waits for the record's lock.
	testenv.Eventually(t, 10*time.Second, "the second removal waiting for the record", func() bool {
		var waiting int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting == 1
	})
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	var records int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_published_transaction`).Scan(&records); err != nil || records != 0 {
		t.Fatalf("%d transaction records left (%v), want 0: both rows are gone", records, err)
	}
}
