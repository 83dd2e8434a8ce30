package reconciler

import (
	"context"
	"fmt"
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
// published outbox row only past OutboxRetention, with its inbox rows,
// when none of them is processing. Everything else —
// inside the window, task not terminal, event unpublished, effect unknown,
// parked and undecided, in_progress, an inbox row processing — stays.
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
	// (both consumers); one processing keeps its outbox row (old-discarded),
	// and the inbox rows of a kept row stay.
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
		return expired >= 2 && purged >= 1
	})
	if expired != 2 || purged != 1 || inboxPurged != 2 {
		t.Fatalf("removed %d idempotency records, %d outbox rows and %d inbox rows; want 2, 1 and 2", expired, purged, inboxPurged)
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
	if strings.Join(outbox, " ") != "old-discarded old-parked young-published" {
		t.Fatalf("outbox rows kept: %v; want old-discarded (an inbox row processing), old-parked, young-published", outbox)
	}
}

// An inbox row processing keeps its outbox row past OutboxRetention: once
// the row was removed, the inbox scan could no longer find the message's
// task to release the row, and task retention could no longer find the row
// (it finds a task's inbox rows through its outbox rows), so the row stayed
// processing for ever. Once the scan has released it (its task terminal,
// its lease gone), both go in the same pass. A stale processing row whose
// message reaches no task any more (left by an earlier version, or
// registered by a delivery after its outbox row went) is removed; stale
// rows of tasks still running do not hide the others from the scan.
func TestProcessingInboxRowKeepsItsOutboxRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, Config{InboxLease: time.Minute, BatchSize: 2})
	s := b.settledTask(t, `{"k":"processing"}`, false)
	created := s.outbox[0]
	b.exec(t, `UPDATE outbox_event SET created_at = now() - interval '8 days' WHERE aggregate_id = $1`, s.id)
	b.exec(t, `UPDATE inbox_message SET state = 'processing', completed_at = NULL, locked_until = NULL WHERE consumer_name = $1 AND message_id = $2`,
		consumers[0], created)

	// Three stale processing rows of a running task, older than the rest:
	// a scan that read them first and skipped them saw nothing else.
	running := testenv.MustStartTask(t, b.db.Pool, testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"running"}`)).Task.TaskID)
	for i := range 3 {
		id := fmt.Sprintf("running-%d", i)
		b.exec(t, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, published_at)
VALUES ($1, $2, $3, 'TaskRedriveRequested', '{}', repeat('a', 64), now())`, id, running.TaskID, 10+i)
		b.exec(t, `INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, last_seen_at)
VALUES ('converge-worker', $1, repeat('a', 64), 'processing', now() - interval '3 hours')`, id)
	}
	b.exec(t, `INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, last_seen_at)
VALUES ('converge-worker', 'of-no-task', repeat('a', 64), 'processing', now() - interval '2 hours')`)

	state := func(msg string) string {
		var st string
		if err := b.db.Pool.QueryRow(ctx, `SELECT coalesce(min(state), 'gone') FROM inbox_message WHERE consumer_name = $1 AND message_id = $2`, consumers[0], msg).Scan(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	outboxLeft := func() int {
		var n int
		if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1`, s.id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// The delivery is live (seen now): its outbox row stays, the other
	// consumer's row of it and the other event's rows go.
	var res Result
	testenv.Eventually(t, 20*time.Second, "the completion event purged (the watermark passes it)", func() bool {
		r, err := b.r.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		res.OutboxPurged += r.OutboxPurged
		res.InboxPurged += r.InboxPurged
		return outboxLeft() == 1
	})
	if st := state(created); st != "processing" {
		t.Fatalf("the live delivery's inbox row is %s, want processing", st)
	}
	if res.InboxPurged != 1+2+1 || res.OutboxPurged != 1 {
		// The of-no-task row, both consumers' rows of the completion event
		// and the other consumer's row of the creation event.
		t.Fatalf("removed %d inbox rows and %d outbox rows; want 4 and 1", res.InboxPurged, res.OutboxPurged)
	}
	if st := state("of-no-task"); st != "gone" {
		t.Fatalf("the stale row of no task is %s, want removed", st)
	}

	// The delivery goes stale: the scan releases it, and retention removes
	// it with its outbox row.
	b.exec(t, `UPDATE inbox_message SET last_seen_at = now() - interval '1 hour' WHERE message_id = $1`, created)
	r, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.InboxReleased != 1 || r.OutboxPurged != 1 || r.InboxPurged != 1 || outboxLeft() != 0 || state(created) != "gone" {
		t.Fatalf("pass %+v, %d outbox rows left, inbox row %s; want it released, then removed with its outbox row", r, outboxLeft(), state(created))
	}
	for i := range 3 {
		if st := state(fmt.Sprintf("running-%d", i)); st != "processing" {
			t.Fatalf("a running task's stale row is %s, want processing (left to the re-drive)", st)
		}
	}
}
