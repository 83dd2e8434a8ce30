package reconciler

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/testenv"
)

// The retention scan (issue 13, seed 3.3) removes an idempotency record
// only when it is past expires_at AND its task is settled (terminal, every
// outbox event published or decided, no effect started/unknown/
// compensation_required), or when it belongs to a failed request; and a
// published outbox row only past OutboxRetention, with its inbox rows that
// are not processing. Everything else —
// inside the window, task not terminal, event unpublished, effect unknown,
// parked and undecided, in_progress — stays.
func TestRetentionRemovesOnlySettledExpiredRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, Config{})
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := b.db.Pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	fp := strings.Repeat("f", 64)
	record := func(key, state, taskID, expires string) {
		t.Helper()
		var task any
		if taskID != "" {
			task = taskID
		}
		exec(`INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, locked_until, expires_at)
VALUES ('s', $1, $2, $3, $4, CASE WHEN $3 = 'succeeded' THEN 201 END, CASE WHEN $3 = 'succeeded' THEN '{}'::jsonb END,
        now() + interval '1 hour', now() + $5::interval)`, key, fp, state, task, expires)
	}
	settledTask := func(doc string) string {
		t.Helper()
		c := testenv.MustCreateTask(t, b.db.Pool, []byte(doc))
		exec(`UPDATE task SET status = 'completed', artifact_sha256 = repeat('a', 64), artifact_size = 1, completed_at = now() WHERE task_id = $1`, c.Task.TaskID)
		exec(`UPDATE outbox_event SET published_at = now() WHERE aggregate_id = $1`, c.Task.TaskID)
		return c.Task.TaskID
	}

	// Outbox rows: old and published (removed), young and published, old
	// and parked undecided (kept), old and discarded (removed). Written
	// first: an unpublished row (the task "unpublished" below) holds the
	// scan's watermark, and rows above it are not purged until it moves.
	old := "now() - interval '8 days'"
	exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, published_at)
VALUES ('old-published', 'x1', 1, 'TaskCreated', '{}', $1, `+old+`, now()),
       ('young-published', 'x2', 1, 'TaskCreated', '{}', $1, now(), now())`, fp)
	exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, parked_at, last_error_code)
VALUES ('old-parked', 'x3', 1, 'TaskCreated', '{}', $1, `+old+`, now(), 'MESSAGE_TOO_LARGE'),
       ('old-discarded', 'x4', 1, 'TaskCreated', '{}', $1, `+old+`, now(), 'MESSAGE_TOO_LARGE')`, fp)
	exec(`UPDATE outbox_event SET decision = 'discarded', decided_at = now(), decided_by = 'ops', decision_reason = 'test' WHERE outbox_id = 'old-discarded'`)
	// Inbox rows of those messages: of a removed outbox row they go too
	// (both consumers), unless processing; of a kept one they stay.
	exec(`INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, completed_at)
VALUES ('converge-worker', 'old-published', $1, 'completed', now()), ('other', 'old-published', $1, 'failed', now()),
       ('converge-worker', 'old-discarded', $1, 'processing', NULL), ('converge-worker', 'young-published', $1, 'completed', now()),
       ('converge-worker', 'old-parked', $1, 'failed', now())`, fp)

	gone := settledTask(`{"k":"gone"}`)
	record("expired-settled", "succeeded", gone, "-1 minute")
	record("expired-failed-request", "failed_final", "", "-1 minute")
	record("inside-window", "succeeded", settledTask(`{"k":"window"}`), "1 hour")
	record("in-progress", "in_progress", "", "-1 minute")

	queued := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"queued"}`)).Task.TaskID
	exec(`UPDATE outbox_event SET published_at = now() WHERE aggregate_id = $1`, queued)
	record("task-not-terminal", "succeeded", queued, "-1 minute")

	unpublished := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"unpublished"}`)).Task.TaskID
	exec(`UPDATE task SET status = 'completed', artifact_sha256 = repeat('a', 64), artifact_size = 1, completed_at = now() WHERE task_id = $1`, unpublished)
	record("event-unpublished", "succeeded", unpublished, "-1 minute")

	c := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"unknown"}`))
	running := testenv.MustStartTask(t, b.db.Pool, c.Task.TaskID)
	testenv.MustPlanEffect(t, b.db.Pool, running, ledger.Unknown, []byte("x"), 0)
	exec(`UPDATE task SET status = 'completed', artifact_sha256 = repeat('a', 64), artifact_size = 1, completed_at = now() WHERE task_id = $1`, c.Task.TaskID)
	exec(`UPDATE outbox_event SET published_at = now() WHERE aggregate_id = $1`, c.Task.TaskID)
	record("effect-unknown", "succeeded", c.Task.TaskID, "-1 minute")

	var expired, purged, inboxPurged int
	testenv.Eventually(t, 20*time.Second, "retention done (the watermark passes the rows once no older transaction runs)", func() bool {
		res, err := b.r.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		expired += res.IdempotencyExpired
		purged += res.OutboxPurged
		inboxPurged += res.InboxPurged
		return expired >= 2 && purged >= 2
	})
	if expired != 2 || purged != 2 || inboxPurged != 2 {
		t.Fatalf("removed %d idempotency records, %d outbox rows and %d inbox rows; want 2, 2 and 2", expired, purged, inboxPurged)
	}
	var inboxLeft []string
	rows, err := b.db.Pool.Query(ctx, `SELECT message_id || '/' || consumer_name FROM inbox_message ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		inboxLeft = append(inboxLeft, k)
	}
	if want := "old-discarded/converge-worker old-parked/converge-worker young-published/converge-worker"; strings.Join(inboxLeft, " ") != want {
		t.Fatalf("inbox rows kept: %v; want %s", inboxLeft, want)
	}
	var keys []string
	rows, err = b.db.Pool.Query(ctx, `SELECT idempotency_key FROM idempotency_record ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
	}
	if want := "effect-unknown event-unpublished in-progress inside-window task-not-terminal"; strings.Join(keys, " ") != want {
		t.Fatalf("records kept: %v; want %s", keys, want)
	}
	var outbox []string
	rows, err = b.db.Pool.Query(ctx, `SELECT outbox_id FROM outbox_event WHERE outbox_id IN ('old-published', 'young-published', 'old-parked', 'old-discarded') ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		outbox = append(outbox, id)
	}
	if strings.Join(outbox, " ") != "old-parked young-published" {
		t.Fatalf("outbox rows kept: %v; want old-parked, young-published", outbox)
	}
}
