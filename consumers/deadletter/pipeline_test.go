package deadletter

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/projections/taskview"
)

// relay produces the outbox rows of a task of type eventType as the CDC
// relay does (key task id, value the payload, the contract's headers).
func (b *testBundle) relay(t *testing.T, taskID, eventType string) string {
	t.Helper()
	var id, sum string
	var version int64
	var payload []byte
	if err := b.db.Pool.QueryRow(context.Background(), `
SELECT outbox_id, aggregate_version, payload::text, payload_sha256 FROM outbox_event
WHERE aggregate_id = $1 AND event_type = $2 ORDER BY aggregate_version DESC LIMIT 1`, taskID, eventType).Scan(&id, &version, &payload, &sum); err != nil {
		t.Fatalf("read %s outbox row: %v", eventType, err)
	}
	// The relay publishes the canonical form the outbox row was written
	// from; re-encode the decoded event to get those exact bytes.
	ev, err := taskevent.Decode(payload)
	if err != nil {
		t.Fatal(err)
	}
	value, vsum, err := taskevent.Encode(ev)
	if err != nil || vsum != sum {
		t.Fatalf("re-encode %s: %v (sha %s, row says %s)", eventType, err, vsum, sum)
	}
	r := &kgo.Record{Topic: b.kafka.Topic, Key: []byte(taskID), Value: value}
	for _, h := range taskevent.Headers(id, eventType, version, sum, "") {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
	}
	b.produce(t, r)
	return id
}

func (b *testBundle) produce(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	for _, r := range recs {
		if err := b.producer.ProduceSync(context.Background(), r).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
}

// run starts fn until the test ends or stop is called; stop waits for it.
func run(t *testing.T, fn func(context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run returned %v", err)
			}
		case <-time.After(waitFor):
			t.Error("component did not stop")
		}
	}
	t.Cleanup(stop)
	return stop
}

// A re-opened task is visible in the Redis view: the replay's
// TaskRedriveRequested event (version+1, queued) replaces the failed view,
// while the re-published original (version 0) is stale for the projector.
func TestReplayReopenedTaskViewIsQueued(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	taskID, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	id := b.park(t, orig, worker.CodeInjectedProcessingError)
	p, err := taskview.New(taskview.Config{Brokers: b.kafka.Brokers, Topic: b.kafka.Topic, Redis: rdb,
		Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	// The view as the TaskFailed event left it.
	var failed taskevent.Task
	var payload []byte
	if err := b.db.Pool.QueryRow(ctx, `SELECT payload::text FROM outbox_event WHERE aggregate_id = $1`, taskID).Scan(&payload); err != nil {
		t.Fatal(err)
	}
	ev, _ := taskevent.Decode(payload)
	failed = ev.Task
	code := worker.CodeInjectedProcessingError
	failed.Status, failed.Version, failed.TerminalErrorCode = taskevent.StatusFailed, 1, &code
	if ok, err := p.Cache().Put(ctx, failed); err != nil || !ok {
		t.Fatalf("seed failed view: %v %v", ok, err)
	}
	run(t, p.Run)

	if res, err := b.svc.Replay(ctx, id, Request{Reason: "fixed", By: "erin"}); err != nil || !res.TaskReopened {
		t.Fatalf("replay: %+v %v", res, err)
	}
	b.relay(t, taskID, taskevent.TypeTaskRedriveRequested)
	testenv.Eventually(t, waitFor, "the view shows the re-opened task queued at version 2", func() bool {
		v, ok, err := p.Cache().Get(ctx, taskID)
		return err == nil && ok && v.Status == taskevent.StatusQueued && v.Version == 2 && v.TerminalErrorCode == nil
	})
}

// A task whose artifact effect was written but not completed before its
// retries ran out (RETRIES_EXHAUSTED) is replayed: the worker resumes the
// unfinished effect of attempt 1 with its own token instead of writing a
// second artifact, the re-published original and the replay's
// TaskRedriveRequested produce the work once, and the task ends completed
// with exactly one verified artifact.
func TestReplayResumesUnfinishedEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	dir := t.TempDir()
	store, err := artifact.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	startWorker := func(faults *fault.Set) func() {
		w, err := worker.New(worker.Config{Pool: b.db.Pool, Brokers: b.kafka.Brokers, Topic: b.kafka.Topic, ArtifactStore: store,
			Faults: faults, MaxAttempts: 2, RetryBackoffMin: 5 * time.Millisecond, RetryBackoffMax: 20 * time.Millisecond,
			Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		return run(t, w.Run)
	}
	taskID, created := b.task(t, taskevent.StatusQueued, "", []byte(`{"b":[2,1.0],"a":"x"}`))
	b.produce(t, &kgo.Record{Topic: created.Topic, Key: created.Key, Value: created.Value, Headers: created.Headers})

	// Every attempt writes the artifact, then fails before completing.
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	stop := startWorker(faults)
	testenv.Eventually(t, waitFor, "task failed with RETRIES_EXHAUSTED", func() bool {
		var s string
		_ = b.db.Pool.QueryRow(ctx, `SELECT status || ' ' || COALESCE(terminal_error_code, '') FROM task WHERE task_id = $1`, taskID).Scan(&s)
		return s == "failed "+worker.CodeRetriesExhausted
	})
	stop()
	token1 := artifact.Token(taskID, 1)
	if s := b.scalar(t, `SELECT string_agg(idempotency_token || '=' || state, ',') FROM effect_ledger WHERE task_id = $1`, taskID); s != token1+"=started" {
		t.Fatalf("effects %v, want %s=started", s, token1)
	}

	// The reconciler's intake records the dead letter; a person replays it.
	cl := b.kafka.Client(t, kgo.ConsumeTopics(taskevent.DeadLetterTopic(b.kafka.Topic)), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	var dlq *kgo.Record
	testenv.Eventually(t, waitFor, "dead-letter record", func() bool {
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) { dlq = r })
		return dlq != nil
	})
	if _, err := b.svc.Store().Insert(ctx, FromRecord(dlq)); err != nil {
		t.Fatal(err)
	}
	list, err := b.svc.List(ctx, Filter{TaskID: taskID})
	if err != nil || len(list) != 1 || list[0].ErrorCode != worker.CodeRetriesExhausted {
		t.Fatalf("dead letters: %v %+v", err, list)
	}
	res, err := b.svc.Replay(ctx, list[0].ID, Request{Reason: "store fixed", By: "frank"})
	if err != nil || res.Outcome != OutcomeReplayed || !res.TaskReopened {
		t.Fatalf("replay: %+v %v", res, err)
	}
	redrive := b.relay(t, taskID, taskevent.TypeTaskRedriveRequested)

	startWorker(nil)
	eventID, _ := headerValue(created, taskevent.HeaderEventID)
	testenv.Eventually(t, waitFor, "task completed and both deliveries finished", func() bool {
		var s string
		_ = b.db.Pool.QueryRow(ctx, `
SELECT (SELECT status FROM task WHERE task_id = $1) || ' ' ||
  (SELECT string_agg(state, ',' ORDER BY message_id = $3) FROM inbox_message WHERE message_id IN ($2, $3))`, taskID, eventID, redrive).Scan(&s)
		return s == "completed completed,completed"
	})
	if s := b.scalar(t, `SELECT string_agg(idempotency_token || '=' || state || '@' || attempt, ',') FROM effect_ledger WHERE task_id = $1 AND effect_kind = 'artifact.put'`, taskID); s != token1+"=verified@1" {
		t.Errorf("artifact effects %v, want only %s=verified@1 (resumed, not a second token)", s, token1)
	}
	if a := b.scalar(t, `SELECT attempt FROM task WHERE task_id = $1`, taskID); a != int32(2) {
		t.Errorf("task attempt %v, want 2", a)
	}
	metas, err := filepath.Glob(filepath.Join(dir, "objects", taskID+".*.obj"))
	if err != nil || len(metas) != 1 {
		t.Errorf("%d artifacts in the store (%v), want 1: %v", len(metas), err, metas)
	}
	if s := b.scalar(t, `SELECT result_json->>'task_status' FROM inbox_message WHERE message_id = $1`, redrive); s != taskevent.StatusCompleted {
		t.Errorf("the second record's inbox result %v, want a duplicate of the completed task", s)
	}
}
