package reconciler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// The consumers whose inbox rows the tests write: retention removes the
// rows of every consumer of a message.
var consumers = []string{"converge-worker", "other-consumer"}

// settled is a completed task as the pipeline leaves it: artifact stored
// under its verified artifact.put (attempt 1), both events published, each
// consumer's inbox row of each event completed.
type settled struct {
	id, token string
	outbox    []string
}

func (b *testBundle) exec(t *testing.T, q string, args ...any) {
	t.Helper()
	if _, err := b.db.Pool.Exec(context.Background(), q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// settledTask creates a settled task whose artifact is doc's bytes; with
// aged, its last update is 31 days old (past the default TaskRetention).
func (b *testBundle) settledTask(t *testing.T, doc string, aged bool) settled {
	t.Helper()
	ctx := context.Background()
	data := []byte(doc)
	c := testenv.MustCreateTask(t, b.db.Pool, data)
	running := testenv.MustStartTask(t, b.db.Pool, c.Task.TaskID)
	put := testenv.MustPlanEffect(t, b.db.Pool, running, ledger.Verified, data, 0)
	if _, err := b.store.Put(put.Token, put.TaskID, put.Attempt, data); err != nil {
		t.Fatal(err)
	}
	done, err := task.CompleteIfRunning(ctx, b.db.Pool, running.TaskID, running.Version, put.RequestSHA256, put.RequestSize)
	if err != nil || !done.Applied {
		t.Fatalf("complete: %v %v", done, err)
	}
	ev, err := outbox.Insert(ctx, b.db.Pool, taskevent.TypeTaskCompleted, done.Task)
	if err != nil {
		t.Fatal(err)
	}
	return b.settle(t, settled{id: c.Task.TaskID, token: put.Token, outbox: []string{c.Event.EventID, ev.EventID}}, aged)
}

// failedTask creates a task failed with error code X (no artifact), its
// events published and consumed, its last update 31 days old.
func (b *testBundle) failedTask(t *testing.T, doc string) settled {
	t.Helper()
	ctx := context.Background()
	c := testenv.MustCreateTask(t, b.db.Pool, []byte(doc))
	running := testenv.MustStartTask(t, b.db.Pool, c.Task.TaskID)
	failed, err := task.FailIfRunning(ctx, b.db.Pool, running.TaskID, running.Version, "X")
	if err != nil || !failed.Applied {
		t.Fatalf("fail: %v %v", failed, err)
	}
	ev, err := outbox.Insert(ctx, b.db.Pool, taskevent.TypeTaskFailed, failed.Task)
	if err != nil {
		t.Fatal(err)
	}
	return b.settle(t, settled{id: c.Task.TaskID, outbox: []string{c.Event.EventID, ev.EventID}}, true)
}

// settle publishes s's events and completes each consumer's inbox row of
// each; with aged, it ages the task.
func (b *testBundle) settle(t *testing.T, s settled, aged bool) settled {
	t.Helper()
	b.exec(t, `UPDATE outbox_event SET published_at = now() WHERE aggregate_id = $1`, s.id)
	for _, msg := range s.outbox {
		for _, cons := range consumers {
			b.inboxRow(t, cons, msg, inbox.Completed)
		}
	}
	if aged {
		b.age(t, s.id)
	}
	return s
}

// age moves task id's creation and last update 31 days back.
func (b *testBundle) age(t *testing.T, id string) {
	t.Helper()
	b.exec(t, `UPDATE task SET created_at = now() - interval '31 days', updated_at = now() - interval '31 days' WHERE task_id = $1`, id)
}

func (b *testBundle) inboxRow(t *testing.T, consumer, msg string, state inbox.State) {
	t.Helper()
	ctx := context.Background()
	if _, err := inbox.Register(ctx, b.db.Pool, consumer, msg, strings.Repeat("a", 64), inbox.Lease{Owner: "test", For: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if state != inbox.Processing {
		if ok, err := inbox.Finish(ctx, b.db.Pool, consumer, msg, state, map[string]string{"test": "yes"}); err != nil || !ok {
			t.Fatalf("finish inbox row: %v %v", ok, err)
		}
	}
}

func (b *testBundle) deadLetter(t *testing.T, taskID, state string, offset int) {
	t.Helper()
	b.exec(t, `
INSERT INTO dead_letter (origin_topic, origin_partition, origin_offset, consumer_group, task_id, error_class, error_code,
  attempts, processor_version, first_failure_at, last_failure_at, dlq_partition, dlq_offset, state, last_replay_at)
VALUES ('t', 0, $2, 'converge-worker', $1, 'deterministic', 'X', 1, 'test', now(), now(), 0, $2, $3,
        CASE WHEN $3 = 'parked' THEN NULL ELSE now() END)`, taskID, offset, state)
}

// rows counts what is left of task s in every table retention removes.
func (b *testBundle) rows(t *testing.T, s settled) map[string]int {
	t.Helper()
	out := map[string]int{}
	for table, q := range map[string]string{
		"task":         `SELECT count(*) FROM task WHERE task_id = $1`,
		"task_input":   `SELECT count(*) FROM task_input WHERE task_id = $1`,
		"effect":       `SELECT count(*) FROM effect_ledger WHERE task_id = $1`,
		"outbox":       `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1`,
		"dead_letter":  `SELECT count(*) FROM dead_letter WHERE task_id = $1`,
		"idempotency":  `SELECT count(*) FROM idempotency_record WHERE task_id = $1`,
		"inbox":        `SELECT count(*) FROM inbox_message WHERE message_id = ANY($1)`,
		"inbox_all_of": `SELECT count(DISTINCT consumer_name) FROM inbox_message WHERE message_id = ANY($1)`,
	} {
		var n int
		var arg any = s.id
		if strings.Contains(table, "inbox") {
			arg = s.outbox
		}
		if err := b.db.Pool.QueryRow(context.Background(), q, arg).Scan(&n); err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		out[table] = n
	}
	return out
}

func (b *testBundle) gone(t *testing.T, token string) bool {
	t.Helper()
	g, err := b.store.Gone(token)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func (b *testBundle) idempotencyRecord(t *testing.T, key, taskID, expires string) {
	t.Helper()
	b.exec(t, `INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, locked_until, expires_at)
VALUES ('s', $1, repeat('f', 64), 'succeeded', $2, 202, '{}'::jsonb, now(), now() + $3::interval)`, key, taskID, expires)
}

// The whole lifecycle (issue 13, seed 3.3): a settled task past the task
// window loses its artifacts first — the verified one of attempt 2 and
// the hidden one of a compensated attempt 1, each through its own
// artifact.delete ledger entry — then, in one pass, its expired
// idempotency record, every row of it (input, effects, outbox rows, the
// inbox rows of both consumers, its resolved and replayed dead letters)
// and the task. A
// young task's artifact, whose token the old one's is a prefix of, is not
// touched.
func TestRetentionRemovesSettledTaskAndArtifacts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, Config{})
	old := b.settledTask(t, `{"k":"old"}`, false)

	// Attempt 1 was superseded and compensated (object hidden, hide
	// verified); attempt 2 is the verified one.
	b.exec(t, `UPDATE effect_ledger SET attempt = 2, effect_id = $2, idempotency_token = $2, target_identity = 'artifact://' || $2 WHERE task_id = $1`,
		old.id, ledger.PutToken(old.id, 2))
	if err := b.store.Delete(old.token); err != nil {
		t.Fatal(err)
	}
	v2 := ledger.PutToken(old.id, 2)
	if _, err := b.store.Put(v2, old.id, 2, []byte(`{"k":"old"}`)); err != nil {
		t.Fatal(err)
	}
	first := []byte(`{"k":"old","attempt":1}`)
	sum := sha256.Sum256(first)
	p1, _, err := ledger.Plan(ctx, b.db.Pool, ledger.NewPut(old.id, 1, hex.EncodeToString(sum[:]), int64(len(first))))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Put(p1.Token, old.id, 1, first); err != nil {
		t.Fatal(err)
	}
	b.exec(t, `UPDATE effect_ledger SET state = 'compensation_required' WHERE effect_id = $1`, p1.EffectID)
	p1.State = ledger.CompensationRequired
	if c, err := ledger.Compensate(ctx, b.db.Pool, b.store, p1, p1.RequestSize); err != nil || !c.Applied {
		t.Fatalf("compensate: %+v %v", c, err)
	}
	b.deadLetter(t, old.id, "resolved", 1)
	b.deadLetter(t, old.id, "replayed", 2)
	// The replay delivered its message after the outbox window had removed
	// the message's outbox row: the inbox row it left is found through the
	// dead letter.
	b.exec(t, `UPDATE dead_letter SET message_id = 'replayed-late' WHERE task_id = $1 AND state = 'replayed'`, old.id)
	b.inboxRow(t, consumers[0], "replayed-late", inbox.Completed)
	b.idempotencyRecord(t, "old-key", old.id, "-1 minute")
	b.age(t, old.id)

	young := b.settledTask(t, `{"k":"young"}`, false)

	if left := b.rows(t, old); left["inbox_all_of"] != len(consumers) || left["effect"] != 3 {
		t.Fatalf("before: %v", left)
	}
	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.TasksPurged != 1 || res.ArtifactsDeleted != 2 || res.IdempotencyExpired != 1 || res.InboxPurged != 5 {
		t.Fatalf("pass: %+v; want 1 task purged, 2 artifacts deleted, 1 record expired, 5 inbox rows", res)
	}
	var late int
	if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_message WHERE message_id = 'replayed-late'`).Scan(&late); err != nil || late != 0 {
		t.Errorf("%d inbox rows of the late replay left (%v)", late, err)
	}
	for table, n := range b.rows(t, old) {
		if n != 0 {
			t.Errorf("%s: %d rows of the removed task left", table, n)
		}
	}
	for _, tok := range []string{p1.Token, v2} {
		if !b.gone(t, tok) {
			t.Errorf("artifact %s still in the store", tok)
		}
	}
	if _, err := b.store.Head(young.token); err != nil {
		t.Errorf("the young task's artifact: %v", err)
	}
	if left := b.rows(t, young); left["task"] != 1 || left["inbox"] != 4 || left["effect"] != 1 {
		t.Errorf("young task's rows: %v", left)
	}
	if got, want := b.actions(ActionTaskPurged), 1.0; got != want {
		t.Errorf("task_purged = %v, want %v", got, want)
	}
	if got, want := b.actions(ActionArtifactDeleted), 2.0; got != want {
		t.Errorf("artifact_deleted = %v, want %v", got, want)
	}
	again, err := b.r.Pass(ctx)
	if err != nil || again.TasksPurged != 0 || again.ArtifactsDeleted != 0 {
		t.Fatalf("second pass: %+v %v", again, err)
	}
}

// A task inside the window, not terminal, with an unpublished event, an
// undecided dead letter, an unresolved effect, an inbox row processing or
// a live idempotency record is never removed, nor is its artifact touched.
// Each is kept for its own reason (task.Hold), and once the reason goes,
// the next pass removes it.
func TestRetentionKeepsTasksSomethingNeeds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, Config{})

	type keep struct {
		name, reason string
		s            settled
		release      func() // removes the reason
	}
	var cases []keep
	add := func(name, reason string, place func(s settled), release func(s settled)) {
		var s settled
		if strings.Contains(name, "dead-letter") {
			// A failed task: a replay of its dead letter could re-open it.
			// (A completed task's parked dead letters are resolved by the
			// pass itself, deadletter.Store.ResolveCompleted.)
			s = b.failedTask(t, `{"k":"`+name+`"}`)
		} else {
			s = b.settledTask(t, `{"k":"`+name+`"}`, true)
		}
		place(s)
		cases = append(cases, keep{name: name, reason: reason, s: s, release: func() { release(s) }})
	}
	add("inside-window", task.HoldInsideWindow,
		func(s settled) {
			b.exec(t, `UPDATE task SET updated_at = now() - interval '29 days' WHERE task_id = $1`, s.id)
		},
		func(s settled) { b.age(t, s.id) })
	add("unpublished-event", task.HoldUnpublishedEvent,
		func(s settled) {
			b.exec(t, `UPDATE outbox_event SET published_at = NULL WHERE outbox_id = $1`, s.outbox[1])
		},
		func(s settled) {
			b.exec(t, `UPDATE outbox_event SET published_at = now() WHERE outbox_id = $1`, s.outbox[1])
		})
	add("parked-dead-letter", task.HoldDeadLetter,
		func(s settled) { b.deadLetter(t, s.id, "parked", 10) },
		func(s settled) {
			b.exec(t, `UPDATE dead_letter SET state = 'resolved', last_replay_at = now() WHERE task_id = $1`, s.id)
		})
	add("refused-dead-letter", task.HoldDeadLetter,
		func(s settled) { b.deadLetter(t, s.id, "refused", 11) },
		func(s settled) { b.exec(t, `UPDATE dead_letter SET state = 'resolved' WHERE task_id = $1`, s.id) })
	add("unknown-effect", task.HoldEffect,
		func(s settled) {
			if _, _, err := ledger.Plan(ctx, b.db.Pool, ledger.NewPut(s.id, 2, strings.Repeat("b", 64), 1)); err != nil {
				t.Fatal(err)
			}
			b.exec(t, `UPDATE effect_ledger SET state = 'unknown' WHERE effect_id = $1`, ledger.PutToken(s.id, 2))
		},
		func(s settled) {
			b.exec(t, `UPDATE effect_ledger SET state = 'planned' WHERE effect_id = $1`, ledger.PutToken(s.id, 2))
			b.exec(t, `UPDATE effect_ledger SET state = 'failed' WHERE effect_id = $1`, ledger.PutToken(s.id, 2))
		})
	add("inbox-processing", holdInboxProcessing,
		func(s settled) {
			b.exec(t, `UPDATE inbox_message SET state = 'processing', completed_at = NULL WHERE consumer_name = $1 AND message_id = $2`,
				consumers[1], s.outbox[1])
		},
		func(s settled) {
			b.exec(t, `UPDATE inbox_message SET state = 'completed', completed_at = now() WHERE message_id = $1`, s.outbox[1])
		})
	// A replay after the outbox window: its message's inbox row is found
	// through the dead letter, before any artifact is touched.
	add("replayed-message-processing", holdInboxProcessing,
		func(s settled) {
			b.deadLetter(t, s.id, "replayed", 12)
			b.exec(t, `UPDATE dead_letter SET message_id = 'late-replay-' || task_id WHERE task_id = $1`, s.id)
			b.inboxRow(t, consumers[0], "late-replay-"+s.id, inbox.Processing)
		},
		func(s settled) {
			b.exec(t, `UPDATE inbox_message SET state = 'completed', completed_at = now() WHERE message_id = $1`, "late-replay-"+s.id)
		})
	add("live-idempotency-record", task.HoldIdempotencyRecord,
		func(s settled) { b.idempotencyRecord(t, "live-"+s.id, s.id, "1 hour") },
		func(s settled) {
			b.exec(t, `UPDATE idempotency_record SET expires_at = now() - interval '1 minute' WHERE task_id = $1`, s.id)
		})

	// Not terminal: a running task last updated 31 days ago (the re-drive
	// scan's business, not retention's).
	c := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"running"}`))
	running := testenv.MustStartTask(t, b.db.Pool, c.Task.TaskID)
	b.age(t, running.TaskID)
	if reason, _, err := task.Hold(ctx, b.db.Pool, running.TaskID, DefaultTaskRetention); err != nil || reason != task.HoldNotTerminal {
		t.Fatalf("running task: hold %q, %v", reason, err)
	}

	for _, k := range cases {
		reason, _, err := task.Hold(ctx, b.db.Pool, k.s.id, DefaultTaskRetention)
		if k.reason == holdInboxProcessing {
			if reason != task.HoldArtifact {
				t.Errorf("%s: task.Hold = %q, want %q (the inbox judges its rows)", k.name, reason, task.HoldArtifact)
			}
		} else if err != nil || reason != k.reason {
			t.Errorf("%s: task.Hold = %q, %v; want %q", k.name, reason, err, k.reason)
		}
	}
	for range 3 {
		res, err := b.r.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if res.TasksPurged != 0 || res.ArtifactsDeleted != 0 {
			t.Fatalf("pass removed a task that is needed: %+v", res)
		}
	}
	for _, k := range cases {
		if left := b.rows(t, k.s); left["task"] != 1 || left["task_input"] != 1 || left["outbox"] != 2 || left["inbox"] != 4 ||
			(k.s.token != "" && left["effect"] == 0) || (strings.Contains(k.name, "dead-letter") && left["dead_letter"] != 1) {
			t.Errorf("%s: rows %v", k.name, left)
		}
		if _, err := b.store.Head(k.s.token); k.s.token != "" && err != nil {
			t.Errorf("%s: artifact touched: %v", k.name, err)
		}
		var deletions int
		if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM effect_ledger WHERE task_id = $1 AND effect_kind = 'artifact.delete'`, k.s.id).Scan(&deletions); err != nil || deletions != 0 {
			t.Errorf("%s: %d deletions planned (%v)", k.name, deletions, err)
		}
	}
	if left := b.rows(t, settled{id: running.TaskID}); left["task"] != 1 {
		t.Errorf("running task removed: %v", left)
	}

	for _, k := range cases {
		k.release()
	}
	purged := 0
	testenv.Eventually(t, 10*time.Second, "every released task removed", func() bool {
		res, err := b.r.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		purged += res.TasksPurged
		return purged >= len(cases)
	})
	for _, k := range cases {
		if left := b.rows(t, k.s); left["task"] != 0 || (k.s.token != "" && !b.gone(t, k.s.token)) {
			t.Errorf("%s released: rows %v", k.name, left)
		}
	}
	if left := b.rows(t, settled{id: running.TaskID}); left["task"] != 1 {
		t.Errorf("running task removed: %v", left)
	}
}

// A crash between writing the artifact.delete ledger row and removing the
// file, or between removing it and verifying the deletion, leaves the
// deletion started and the task in place; the next pass resumes it under
// the same token and converges (seed 7: the ledger row first, observe
// instead of assuming). Another task of the same batch, whose deletion
// went through, is removed in the first pass.
func TestRetentionResumesAfterCrash(t *testing.T) {
	t.Parallel()
	for _, point := range []string{fault.RetentionAfterDeletePlanned, fault.RetentionAfterArtifactDelete} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			faults := &fault.Set{}
			b := setup(t, Config{Faults: faults})
			s := b.settledTask(t, `{"k":"crash"}`, true)
			sibling := b.settledTask(t, `{"k":"sibling"}`, true)
			other := b.settledTask(t, `{"k":"other"}`, false)
			if err := faults.ArmKey(point, fault.ActionError, 1, s.id); err != nil {
				t.Fatal(err)
			}

			res, err := b.r.Pass(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if res.TasksPurged != 1 || res.ArtifactsDeleted != 1 || res.Errors != 1 || faults.Fired(point) != 1 {
				t.Fatalf("first pass: %+v, fired %d; want the sibling removed, the crashed one kept", res, faults.Fired(point))
			}
			if left := b.rows(t, sibling); left["task"] != 0 || !b.gone(t, sibling.token) {
				t.Fatalf("the sibling's rows after the first pass: %v (artifact gone: %v)", left, b.gone(t, sibling.token))
			}
			del := testenv.RequireEffect(t, b.db.Pool, ledger.KindArtifactDelete, ledger.DeleteToken(s.token))
			if del.State != ledger.Started || del.TaskID != s.id {
				t.Fatalf("deletion after the crash: %+v", del)
			}
			if wantGone := point == fault.RetentionAfterArtifactDelete; b.gone(t, s.token) != wantGone {
				t.Fatalf("artifact gone = %v after %s, want %v", !wantGone, point, wantGone)
			}
			if left := b.rows(t, s); left["task"] != 1 {
				t.Fatalf("task removed before its deletion was verified: %v", left)
			}

			res, err = b.r.Pass(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if res.TasksPurged != 1 || res.ArtifactsDeleted != 1 || res.Errors != 0 {
				t.Fatalf("second pass: %+v", res)
			}
			if left := b.rows(t, s); slices.ContainsFunc([]int{left["task"], left["effect"], left["outbox"], left["inbox"]}, func(n int) bool { return n != 0 }) {
				t.Fatalf("rows left: %v", left)
			}
			if !b.gone(t, s.token) {
				t.Fatal("artifact still in the store")
			}
			if _, err := b.store.Head(other.token); err != nil {
				t.Fatalf("another task's artifact: %v", err)
			}
		})
	}
}

// TaskRetention shorter than the idempotency window, or than the outbox
// window, is refused: a key must never outlive its task, nor a task's
// inbox rows its events in Kafka.
func TestTaskRetentionValidated(t *testing.T) {
	t.Parallel()
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, cfg := range []Config{
		{TaskRetention: 23 * time.Hour},
		{TaskRetention: 48 * time.Hour}, // OutboxRetention defaults to 168h
		{TaskRetention: 100 * time.Hour, OutboxRetention: 101 * time.Hour},
	} {
		cfg.DatabaseURL, cfg.ArtifactStore = "postgres://unused", store
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "TaskRetention") {
			t.Errorf("TaskRetention %s, OutboxRetention %s: New = %v, want refused", cfg.TaskRetention, cfg.OutboxRetention, err)
		}
	}
	cfg := Config{DatabaseURL: "postgres://unused", ArtifactStore: store, TaskRetention: 24 * time.Hour, OutboxRetention: 24 * time.Hour}
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("24h windows: %v", err)
	}
	r.pool.Close()
}

// Dead letters of no task (none named, or one that does not exist: a
// poison record, a forged event) are removed once settled (resolved,
// replayed) and older than TaskRetention; parked and refused ones, young
// ones and those of an existing task stay (issue 13: nothing grows forever).
func TestRetentionRemovesSettledOrphanDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, Config{})
	live := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"k":"live"}`)).Task.TaskID
	b.deadLetter(t, "no-such-task", "resolved", 1) // old, orphan: removed
	b.deadLetter(t, "no-such-task", "replayed", 2) // old, orphan: removed
	b.deadLetter(t, "no-such-task", "parked", 3)   // waits for a person
	b.deadLetter(t, "no-such-task", "refused", 4)  // waits for a person
	b.deadLetter(t, "young-orphan", "resolved", 5) // inside the window
	b.deadLetter(t, live, "resolved", 6)           // its task exists: goes with it
	b.exec(t, `INSERT INTO dead_letter (origin_topic, origin_partition, origin_offset, consumer_group, task_id, error_class, error_code,
  attempts, processor_version, first_failure_at, last_failure_at, dlq_partition, dlq_offset, state, last_replay_at)
VALUES ('t', 0, 7, 'converge-worker', NULL, 'deterministic', 'X', 1, 'test', now(), now(), 0, 7, 'resolved', now())`) // no task named: removed
	b.exec(t, `UPDATE dead_letter SET updated_at = now() - interval '31 days' WHERE origin_offset <> 5`)
	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.DeadLettersPurged != 3 {
		t.Errorf("pass removed %d orphan dead letters, want 3", res.DeadLettersPurged)
	}
	var left []int64
	rows, err := b.db.Pool.Query(ctx, `SELECT origin_offset FROM dead_letter ORDER BY origin_offset`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var o int64
		_ = rows.Scan(&o)
		left = append(left, o)
	}
	if fmt.Sprint(left) != "[3 4 5 6]" {
		t.Errorf("dead letters left at offsets %v, want [3 4 5 6]", left)
	}
}

// Retention keeps pace with the rate tasks are created at (issue 11): a
// pass takes batch after batch while they come back full, for up to
// RetentionBudget. One batch per pass was a ceiling of BatchSize per
// Interval (20 tasks/s at the defaults), so a deployment creating more
// grew its tables without end. With the budget spent after one batch,
// each step takes one batch, and later passes finish the work. (Outbox
// rows are purgeable only below the backlog's watermark, which other
// databases' open transactions on the shared cluster hold back: the test
// counts them over passes.)
func TestRetentionTakesBatchesWhileTheyComeBackFull(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		budget time.Duration
	}{{"one pass", 0}, {"budget spent after one batch", time.Nanosecond}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const n, batch = 5, 2
			b := setup(t, Config{BatchSize: batch, RetentionBudget: tc.budget})
			for i := range n {
				old := b.settledTask(t, fmt.Sprintf(`{"old":%d}`, i), true)
				b.idempotencyRecord(t, fmt.Sprintf("old-%d", i), old.id, "-1 minute")
				young := b.settledTask(t, fmt.Sprintf(`{"young":%d}`, i), false)
				b.exec(t, `UPDATE outbox_event SET created_at = now() - interval '8 days' WHERE aggregate_id = $1`, young.id)
			}
			var total Result
			for pass := 0; total.TasksPurged < n || total.OutboxPurged < 2*n; pass++ {
				if pass > 40 {
					t.Fatalf("after %d passes: %+v", pass, total)
				}
				if pass > 0 {
					time.Sleep(50 * time.Millisecond)
				}
				res, err := b.r.Pass(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if tc.budget > 0 && (res.IdempotencyExpired > batch || res.OutboxPurged > batch || res.TasksPurged > batch) {
					t.Fatalf("pass %d: %+v, want at most one batch of %d per step", pass, res, batch)
				}
				if tc.budget == 0 && pass == 0 && (res.IdempotencyExpired != n || res.TasksPurged != n || res.ArtifactsDeleted != n) {
					t.Fatalf("first pass: %+v, want all %d records expired and tasks purged with their artifacts", res, n)
				}
				total.IdempotencyExpired += res.IdempotencyExpired
				total.OutboxPurged += res.OutboxPurged
				total.TasksPurged += res.TasksPurged
			}
			if total.IdempotencyExpired != n || total.OutboxPurged != 2*n || total.TasksPurged != n {
				t.Errorf("%+v, want %d records expired, %d outbox rows and %d tasks purged", total, n, 2*n, n)
			}
			var tasks int
			if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM task`).Scan(&tasks); err != nil || tasks != n {
				t.Errorf("%d tasks left (%v), want the %d young ones", tasks, err, n)
			}
		})
	}
}

// converge_reconciler_expired_tasks says how many terminal tasks past the
// window are still present after a pass: the ones retention keeps (here:
// an idempotency record still names it) and the ones it has not reached
// (here: the budget spent after one batch of 2). It falls to the kept ones
// once retention caught up.
func TestExpiredTasksGauge(t *testing.T) {
	t.Parallel()
	const batch = 2
	b := setup(t, Config{BatchSize: batch, RetentionBudget: time.Nanosecond})
	kept := b.settledTask(t, `{"kept":true}`, true)
	b.idempotencyRecord(t, "kept-key", kept.id, "1 hour")
	for i := range 4 {
		b.settledTask(t, fmt.Sprintf(`{"old":%d}`, i), true)
	}
	b.settledTask(t, `{"young":true}`, false)
	gauge := func() float64 {
		var m dto.Metric
		if err := b.r.m.expiredTasks.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetGauge().GetValue()
	}
	if _, err := b.r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := gauge(); got < 2 || got > 4 {
		t.Errorf("after one batch: expired_tasks = %v, want 2 to 4 of the 5 expired left", got)
	}
	for range 5 {
		if _, err := b.r.Pass(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if got := gauge(); got != 1 {
		t.Errorf("once caught up: expired_tasks = %v, want 1 (the kept task)", got)
	}
}

// Two reconcilers share the walk over expired tasks: a task another
// reconciler has claimed (claimTasks, a session advisory lock) is passed
// over at once, neither waited for nor removed, and the others of the
// batch go; once the claim is given up, the next pass removes it. Before
// claims, the second reconciler read the same batch, waited for the first's
// row locks and found its batch gone: two removed no faster than one.
func TestRetentionPassesOverTasksClaimedElsewhere(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{})
	var tasks []settled
	for i := range 3 {
		tasks = append(tasks, b.settledTask(t, fmt.Sprintf(`{"claimed":%d}`, i), true))
	}
	other, err := claimTasks(context.Background(), b.db.Pool, []string{tasks[1].id})
	if err != nil || len(other.ids) != 1 {
		t.Fatalf("claim: %v %v", other.ids, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := b.r.Pass(ctx)
	if err != nil || res.TasksPurged != 2 || res.TasksKept != 0 {
		other.release()
		t.Fatalf("pass: %+v %v; want the 2 tasks not claimed elsewhere removed, none kept", res, err)
	}
	if left := b.rows(t, tasks[1]); left["task"] != 1 {
		t.Errorf("the claimed task's rows: %v", left)
	}
	if _, err := b.store.Head(tasks[1].token); err != nil {
		t.Errorf("the claimed task's artifact: %v", err)
	}
	// The pass gave up its own claims: the other reconciler can take them.
	again, err := claimTasks(context.Background(), b.db.Pool, []string{tasks[0].id, tasks[2].id})
	if err != nil || len(again.ids) != 2 {
		t.Errorf("the pass's claims were not given up: %v %v", again.ids, err)
	}
	again.release()
	other.release()
	if res, err = b.r.Pass(ctx); err != nil || res.TasksPurged != 1 {
		t.Fatalf("pass after the claim was given up: %+v %v; want the third task removed", res, err)
	}
}
