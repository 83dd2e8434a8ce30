package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/testenv"
)

// QueueInsertMany writes the rows QueueInsert writes one by one — every
// column, created_at defaulting to the transaction's now() and an empty
// tenant to NULL — in one statement; a row violating a constraint fails
// all of them.
func TestQueueInsertManyWritesWhatQueueInsertWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	at := time.Date(2026, 12, 3, 8, 0, 0, 123456000, time.UTC)
	rows := func(prefix string) []outbox.Row {
		return []outbox.Row{
			{ID: prefix + "-1", TaskID: prefix + "-task-1", Version: 2, Type: "TaskCompleted", Payload: []byte(`{"a":1}`), PayloadSHA256: strings.Repeat("a", 64), CreatedAt: at, TenantID: "tenant-1"},
			{ID: prefix + "-2", TaskID: prefix + "-task-2", Version: 0, Type: "TaskCreated", Payload: []byte(`{"b":[2]}`), PayloadSHA256: strings.Repeat("b", 64)},
		}
	}
	var b pgx.Batch
	for _, r := range rows("one") {
		outbox.QueueInsert(&b, r)
	}
	outbox.QueueInsertMany(&b, rows("many"))
	if err := db.Pool.SendBatch(ctx, &b).Close(); err != nil {
		t.Fatal(err)
	}
	read := func(prefix string) []string {
		t.Helper()
		var out []string
		rs, err := db.Pool.Query(ctx, `SELECT replace(aggregate_id, $1, '') || ' ' || aggregate_version || ' ' || event_type || ' ' || payload || ' ' || payload_sha256 || ' ' ||
  COALESCE(tenant_id, 'NULL') || ' ' || (created_at = $2 OR created_at > now() - interval '1 minute') FROM outbox_event WHERE outbox_id LIKE $1 || '-%' ORDER BY outbox_id`, prefix, at)
		if err != nil {
			t.Fatal(err)
		}
		out, err = pgx.CollectRows(rs, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	one, many := read("one"), read("many")
	if len(many) != 2 || strings.Join(one, "\n") != strings.Join(many, "\n") {
		t.Fatalf("QueueInsertMany wrote\n%v\nQueueInsert wrote\n%v", many, one)
	}

	dup := rows("dup")
	dup[1].TaskID, dup[1].Version, dup[1].Type = "many-task-1", 2, "TaskCompleted" // the unique (task, version, type) of an existing row
	b = pgx.Batch{}
	outbox.QueueInsertMany(&b, dup)
	if err := db.Pool.SendBatch(ctx, &b).Close(); err == nil {
		t.Fatal("a row of an existing (task, version, type) was accepted")
	}
	if got := read("dup"); len(got) != 0 {
		t.Fatalf("after the failed statement: %v, want no row", got)
	}
}
