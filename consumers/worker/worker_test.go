package worker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/corpus"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

const waitFor = 20 * time.Second

// testBundle is one test's world: its own database, kfake cluster and
// artifact store directory.
type testBundle struct {
	db       *testenv.DB
	kafka    *testenv.Kafka
	dir      string
	store    *artifact.Store
	producer *kgo.Client
	admin    *kadm.Client
	// maxAttempts of the workers started; 0: 1000.
	maxAttempts int
	// visibilityTimeout of the workers started; 0: 300ms (a task that is
	// not found is dead-lettered soon).
	visibilityTimeout time.Duration
	// afterStartMissed is the workers' Worker.afterStartMissed hook.
	afterStartMissed func()
}

// setup creates the bundle; storeFaults are armed in the artifact store.
func setup(t *testing.T, storeFaults *fault.Set) *testBundle {
	t.Helper()
	b := &testBundle{db: testenv.NewDB(t), kafka: testenv.NewKafka(t), dir: t.TempDir()}
	var err error
	b.store, err = artifact.Open(b.dir, storeFaults)
	if err != nil {
		t.Fatal(err)
	}
	b.producer = b.kafka.Client(t)
	b.admin = kadm.NewClient(b.producer)
	return b
}

// runningWorker is a worker started by a test.
type runningWorker struct {
	w      *Worker
	cancel context.CancelFunc
	done   chan error
}

// start runs a worker with faults (nil: none) until stop or the test's end.
func (b *testBundle) start(t *testing.T, faults *fault.Set, opts ...kgo.Opt) *runningWorker {
	t.Helper()
	maxAttempts := b.maxAttempts
	if maxAttempts == 0 {
		maxAttempts = 1000 // tests of in-place retries never dead-letter
	}
	visibility := b.visibilityTimeout
	if visibility == 0 {
		visibility = 300 * time.Millisecond
	}
	w, err := New(Config{
		MaxAttempts: maxAttempts, VisibilityTimeout: visibility,
		Pool: b.db.Pool, Brokers: b.kafka.Brokers, ArtifactStore: b.store, Faults: faults, KafkaOpts: opts,
		Logger:          slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})),
		Registerer:      prometheus.NewRegistry(),
		RetryBackoffMin: 10 * time.Millisecond, RetryBackoffMax: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	w.afterStartMissed = b.afterStartMissed
	ctx, cancel := context.WithCancel(context.Background())
	rw := &runningWorker{w: w, cancel: cancel, done: make(chan error, 1)}
	go func() { rw.done <- w.Run(ctx) }()
	t.Cleanup(func() { rw.stop(t) })
	return rw
}

// stop cancels the worker and waits for Run to return nil.
func (rw *runningWorker) stop(t *testing.T) {
	t.Helper()
	rw.cancel()
	select {
	case err, ok := <-rw.done:
		if ok && err != nil {
			t.Errorf("Run returned %v, want nil", err)
		}
		if ok {
			close(rw.done)
		}
	case <-time.After(waitFor):
		t.Fatal("worker did not stop")
	}
}

func (rw *runningWorker) count(outcome string) float64 {
	return counterValue(rw.w.m.messages.WithLabelValues(outcome))
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// created is a task inserted the way the API does it, with its TaskCreated
// record.
type created struct {
	taskID string
	ev     taskevent.Event
	value  []byte
	sum    string
}

// createTask inserts task + task_input + the TaskCreated outbox row in one
// transaction, as the API does, and returns the record to produce.
func createTask(t *testing.T, pool *pgxpool.Pool, doc []byte) created {
	t.Helper()
	var c created
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		var err error
		c, err = createTaskIn(tx, doc)
		return err
	})
	if err != nil {
		t.Fatalf("create task: %v", err)
	}
	return c
}

// createTaskIn writes what createTask does in tx, which the caller commits
// (the row factory, testenv.CreateTask).
func createTaskIn(tx pgx.Tx, doc []byte) (created, error) {
	c, err := testenv.CreateTask(context.Background(), tx, doc)
	if err != nil {
		return created{}, err
	}
	return created{taskID: c.Task.TaskID, ev: c.Event, value: c.Value, sum: c.SHA256}, nil
}

// record builds a task-events record with the contract's headers.
func record(key string, value []byte, ev *taskevent.Event, sum string) *kgo.Record {
	r := &kgo.Record{Topic: taskevent.DefaultTopic, Key: []byte(key), Value: value}
	if ev != nil {
		for _, h := range taskevent.Headers(ev.EventID, ev.EventType, ev.TaskVersion, sum, ev.Task.TenantID) {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
		}
	}
	return r
}

func (c created) record() *kgo.Record { return record(c.taskID, c.value, &c.ev, c.sum) }

func (b *testBundle) produce(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	for _, r := range recs {
		if err := b.producer.ProduceSync(context.Background(), r).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
}

func (b *testBundle) task(t *testing.T, id string) taskevent.Task {
	t.Helper()
	task, found, err := task.Get(context.Background(), b.db.Pool, id)
	if err != nil || !found {
		t.Fatalf("read task %s: found=%v err=%v", id, found, err)
	}
	return task
}

func (b *testBundle) status(id string) string {
	var s string
	_ = b.db.Pool.QueryRow(context.Background(), `SELECT status FROM task WHERE task_id = $1`, id).Scan(&s)
	return s
}

func (b *testBundle) scalar(t *testing.T, sql string, args ...any) any {
	t.Helper()
	var v any
	if err := b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func (b *testBundle) effect(t *testing.T, kind ledger.Kind, token string) ledger.Effect {
	t.Helper()
	e, found, err := ledger.Get(context.Background(), b.db.Pool, kind, token)
	if err != nil || !found {
		t.Fatalf("read effect %s %s: found=%v err=%v", kind, token, found, err)
	}
	return e
}

// objects counts the committed objects of a task in the store directory.
func (b *testBundle) objects(t *testing.T, taskID string) int {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(b.dir, "objects", taskID+".*.obj"))
	if err != nil {
		t.Fatal(err)
	}
	return len(m)
}

// offsets returns the group's committed offsets and the topic's end offsets.
func (b *testBundle) offsets(t *testing.T) (committed, end map[int32]int64) {
	t.Helper()
	ctx := context.Background()
	committed, end = map[int32]int64{}, map[int32]int64{}
	co, err := b.admin.FetchOffsets(ctx, DefaultGroup)
	if err != nil {
		t.Fatalf("fetch offsets: %v", err)
	}
	co.Each(func(o kadm.OffsetResponse) {
		if o.Err == nil && o.Topic == b.kafka.Topic && o.At >= 0 {
			committed[o.Partition] = o.At
		}
	})
	eo, err := b.admin.ListEndOffsets(ctx, b.kafka.Topic)
	if err != nil {
		t.Fatalf("list end offsets: %v", err)
	}
	eo.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			end[o.Partition] = o.Offset
		}
	})
	return committed, end
}

// allCommitted reports whether every partition with records has its end
// offset committed.
func (b *testBundle) allCommitted(t *testing.T) bool {
	committed, end := b.offsets(t)
	for p, e := range end {
		if committed[p] != e {
			return false
		}
	}
	return len(end) > 0
}

func (b *testBundle) committedTotal(t *testing.T) int64 {
	committed, _ := b.offsets(t)
	var n int64
	for _, o := range committed {
		n += o
	}
	return n
}

func TestHappyPath(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	inputs := corpus.Files(t, "jcs/input/*.json", 1)
	var tasks []created
	want := map[string][]byte{}
	for _, in := range inputs {
		doc, err := os.ReadFile(in)
		if err != nil {
			t.Fatal(err)
		}
		out, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(in)), "output", filepath.Base(in)))
		if err != nil {
			t.Fatal(err)
		}
		c := createTask(t, b.db.Pool, doc)
		tasks = append(tasks, c)
		want[c.taskID] = out
		b.produce(t, c.record())
	}
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "all tasks completed", func() bool {
		return b.scalar(t, `SELECT count(*) FROM task WHERE status = 'completed'`).(int64) == int64(len(tasks))
	})
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := b.committedTotal(t); got != int64(len(tasks)) {
		t.Errorf("committed offsets sum to %d, want %d", got, len(tasks))
	}
	for _, c := range tasks {
		task := b.task(t, c.taskID)
		token := artifact.Token(c.taskID, 1)
		if task.Version != 2 || task.Attempt != 1 || task.ArtifactSHA256 == nil || task.CompletedAt == nil {
			t.Errorf("task %s: %+v, want completed v2 attempt 1 with artifact", c.taskID, task)
			continue
		}
		r, meta, err := b.store.Open(token)
		if err != nil {
			t.Fatalf("open artifact %s: %v", token, err)
		}
		got, _ := io.ReadAll(r)
		r.Close()
		if !bytes.Equal(got, want[c.taskID]) {
			t.Errorf("task %s artifact:\n got %q\nwant %q", c.taskID, got, want[c.taskID])
		}
		if meta.SHA256 != *task.ArtifactSHA256 || meta.Size != *task.ArtifactSize {
			t.Errorf("task %s: artifact meta %+v, task sha %s size %d", c.taskID, meta, *task.ArtifactSHA256, *task.ArtifactSize)
		}
		e := b.effect(t, ledger.KindArtifactPut, token)
		if e.State != ledger.Verified || e.ObservedSHA256 == nil || *e.ObservedSHA256 != e.RequestSHA256 {
			t.Errorf("task %s effect: %+v, want verified with observed == request", c.taskID, e)
		}
		if s := b.scalar(t, `SELECT state FROM inbox_message WHERE consumer_name = $1 AND message_id = $2`, DefaultGroup, c.ev.EventID); s != string(inbox.Completed) {
			t.Errorf("task %s inbox state %v, want completed", c.taskID, s)
		}
		var payload, sum string
		err = b.db.Pool.QueryRow(context.Background(), `
SELECT payload::text, payload_sha256 FROM outbox_event
WHERE aggregate_id = $1 AND event_type = 'TaskCompleted' AND aggregate_version = 2`, c.taskID).Scan(&payload, &sum)
		if err != nil {
			t.Fatalf("task %s: TaskCompleted outbox row: %v", c.taskID, err)
		}
		value, gotSum, err := taskevent.Canonical([]byte(payload))
		if err != nil || gotSum != sum {
			t.Errorf("task %s: outbox payload hash %s, column %s (%v)", c.taskID, gotSum, sum, err)
		}
		ev, err := taskevent.Decode(value)
		if err != nil || ev.Task.Status != taskevent.StatusCompleted || ev.TaskVersion != 2 || *ev.Task.ArtifactSHA256 != *task.ArtifactSHA256 {
			t.Errorf("task %s: TaskCompleted event %+v (%v)", c.taskID, ev, err)
		}
	}
	if got := rw.count(OutcomeProcessed); got != float64(len(tasks)) {
		t.Errorf("processed = %v, want %d", got, len(tasks))
	}
	if got := counterValue(rw.w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Verified))); got != float64(len(tasks)) {
		t.Errorf("verified transitions = %v, want %d", got, len(tasks))
	}
}

func TestRedeliveryIsDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"b":2,"a":1}`))
	b.produce(t, c.record(), c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "duplicate counted", func() bool { return rw.count(OutcomeDuplicate) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := rw.count(OutcomeProcessed); got != 1 {
		t.Errorf("processed = %v, want 1", got)
	}
	if task := b.task(t, c.taskID); task.Status != taskevent.StatusCompleted || task.Version != 2 {
		t.Errorf("task %s/v%d, want completed/v2", task.Status, task.Version)
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d artifact objects, want 1", n)
	}
	if d := b.scalar(t, `SELECT deliveries FROM inbox_message WHERE message_id = $1`, c.ev.EventID); d != int32(2) {
		t.Errorf("inbox deliveries = %v, want 2", d)
	}
	if n := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskCompleted'`, c.taskID); n != int64(1) {
		t.Errorf("%v TaskCompleted rows, want 1", n)
	}
}

func TestSameEventIDDifferentPayloadIsConflict(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"x":[1,2,3]}`))
	forged := c.ev
	forged.OccurredAt = forged.OccurredAt.Add(time.Second)
	value, sum, err := taskevent.Encode(&forged)
	if err != nil {
		t.Fatal(err)
	}
	b.produce(t, c.record(), record(c.taskID, value, &forged, sum))
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "conflict counted", func() bool { return rw.count(OutcomeConflict) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	var stored, payload string
	var offset int64
	err = b.db.Pool.QueryRow(context.Background(), `
SELECT stored_sha256, payload_sha256, kafka_offset FROM inbox_conflict WHERE consumer_name = $1 AND message_id = $2`,
		DefaultGroup, c.ev.EventID).Scan(&stored, &payload, &offset)
	if err != nil {
		t.Fatalf("inbox_conflict row: %v", err)
	}
	if stored != c.sum || payload != sum || offset != 1 {
		t.Errorf("conflict stored=%s payload=%s offset=%d, want %s %s 1", stored, payload, offset, c.sum, sum)
	}
	if task := b.task(t, c.taskID); task.Status != taskevent.StatusCompleted || task.Version != 2 {
		t.Errorf("task %s/v%d, want completed/v2 (untouched by the conflicting record)", task.Status, task.Version)
	}
	if d := b.scalar(t, `SELECT deliveries FROM inbox_message WHERE message_id = $1`, c.ev.EventID); d != int32(1) {
		t.Errorf("inbox deliveries = %v, want 1", d)
	}
}

// A crash between the artifact write and the completion transaction: the
// attempt fails (every time while the fault is armed), the offset is not
// committed; a new worker instance resumes and completes the task with the
// one object written before.
func TestCrashAfterArtifactWriteNewInstance(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"z":"last","a":"first"}`))
	b.produce(t, c.record())
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	a := b.start(t, faults)
	testenv.Eventually(t, waitFor, "fault fired twice", func() bool { return faults.Fired(fault.WorkerAfterArtifactWrite) >= 2 })
	token := artifact.Token(c.taskID, 1)
	first, err := b.store.Head(token)
	if err != nil {
		t.Fatalf("artifact after first attempt: %v", err)
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects after retries, want 1", n)
	}
	if b.status(c.taskID) != taskevent.StatusRunning {
		t.Errorf("task %s, want running", b.status(c.taskID))
	}
	a.stop(t)
	if n := b.committedTotal(t); n != 0 {
		t.Fatalf("committed offsets sum to %d while the outcome was not durable, want 0", n)
	}
	if a.count(OutcomeRetried) < 1 {
		t.Errorf("retried = %v, want >= 1", a.count(OutcomeRetried))
	}

	w2 := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
	again, err := b.store.Head(token)
	if err != nil || !again.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("object rewritten: first %v, now %v (%v)", first.CreatedAt, again.CreatedAt, err)
	}
	if e := b.effect(t, ledger.KindArtifactPut, token); e.State != ledger.Verified {
		t.Errorf("effect %s, want verified", e.State)
	}
	if task := b.task(t, c.taskID); task.Version != 2 || task.Attempt != 1 {
		t.Errorf("task v%d attempt %d, want v2 attempt 1", task.Version, task.Attempt)
	}
	if got := w2.count(OutcomeProcessed); got != 1 {
		t.Errorf("second instance processed = %v, want 1", got)
	}
}

// The same crash, once: the worker retries the record in place.
func TestCrashAfterArtifactWriteRetriedInPlace(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`[3,2,1]`))
	b.produce(t, c.record())
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 1); err != nil {
		t.Fatal(err)
	}
	rw := b.start(t, faults)
	testenv.Eventually(t, waitFor, "task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if faults.Fired(fault.WorkerAfterArtifactWrite) != 1 {
		t.Errorf("fault fired %d times, want 1", faults.Fired(fault.WorkerAfterArtifactWrite))
	}
	if rw.count(OutcomeRetried) != 1 || rw.count(OutcomeProcessed) != 1 {
		t.Errorf("retried=%v processed=%v, want 1 and 1", rw.count(OutcomeRetried), rw.count(OutcomeProcessed))
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
	if e := b.effect(t, ledger.KindArtifactPut, artifact.Token(c.taskID, 1)); e.State != ledger.Verified {
		t.Errorf("effect %s, want verified", e.State)
	}
}

func TestStoreTimeoutResolvedByObservation(t *testing.T) {
	t.Parallel()
	storeFaults := &fault.Set{}
	if err := storeFaults.Arm(fault.ArtifactPutTimeoutAfterCommit, fault.ActionError, 1); err != nil {
		t.Fatal(err)
	}
	b := setup(t, storeFaults)
	c := createTask(t, b.db.Pool, []byte(`{"n":1.5e3}`))
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	if storeFaults.Fired(fault.ArtifactPutTimeoutAfterCommit) != 1 {
		t.Fatalf("timeout fault fired %d times, want 1", storeFaults.Fired(fault.ArtifactPutTimeoutAfterCommit))
	}
	if got := counterValue(rw.w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Unknown))); got != 1 {
		t.Errorf("transitions to unknown = %v, want 1", got)
	}
	e := b.effect(t, ledger.KindArtifactPut, artifact.Token(c.taskID, 1))
	if e.State != ledger.Verified || e.ObservedSHA256 == nil || *e.ObservedSHA256 != e.RequestSHA256 {
		t.Errorf("effect %+v, want verified by observation", e)
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
	if rw.count(OutcomeRetried) != 0 {
		t.Errorf("retried = %v, want 0 (resolved by observation, not by retrying)", rw.count(OutcomeRetried))
	}
}

func TestCorruptArtifactFailsTaskAndCompensates(t *testing.T) {
	t.Parallel()
	storeFaults := &fault.Set{}
	if err := storeFaults.Arm(fault.ArtifactCorruptAfterWrite, fault.ActionCorrupt, 0); err != nil {
		t.Fatal(err)
	}
	b := setup(t, storeFaults)
	c := createTask(t, b.db.Pool, []byte(`{"k":"v"}`))
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task failed", func() bool { return b.status(c.taskID) == taskevent.StatusFailed })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	task := b.task(t, c.taskID)
	if task.TerminalErrorCode == nil || *task.TerminalErrorCode != CodeArtifactVerificationFailed || task.Version != 2 {
		t.Errorf("task %+v, want failed/v2 with %s", task, CodeArtifactVerificationFailed)
	}
	token := artifact.Token(c.taskID, 1)
	testenv.Eventually(t, waitFor, "effect compensated", func() bool { return b.effect(t, ledger.KindArtifactPut, token).State == ledger.Compensated })
	e := b.effect(t, ledger.KindArtifactPut, token)
	if e.ErrorCode == nil || *e.ErrorCode != CodeArtifactVerificationFailed || e.ObservedSHA256 == nil || *e.ObservedSHA256 == e.RequestSHA256 {
		t.Errorf("effect %+v, want error code and a different observed hash", e)
	}
	if h := b.effect(t, ledger.KindArtifactHide, "compensation-for-"+token); h.State != ledger.Verified {
		t.Errorf("hide effect %s, want verified", h.State)
	}
	if _, err := b.store.Head(token); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("head after compensation: %v, want ErrNotFound", err)
	}
	if s := b.scalar(t, `SELECT result_json->>'error_code' FROM inbox_message WHERE message_id = $1 AND state = 'failed'`, c.ev.EventID); s != CodeArtifactVerificationFailed {
		t.Errorf("inbox error code %v", s)
	}
	if n := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskFailed' AND aggregate_version = 2`, c.taskID); n != int64(1) {
		t.Errorf("%v TaskFailed rows, want 1", n)
	}
	if rw.count(OutcomeFailed) != 1 || rw.count(OutcomeRetried) != 0 {
		t.Errorf("failed=%v retried=%v, want 1 and 0", rw.count(OutcomeFailed), rw.count(OutcomeRetried))
	}
}

// The completion committed, the offset commit is lost: a new instance gets
// the record again and it is a harmless duplicate.
func TestAckLostRedeliveryIsDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"ack":"lost"}`))
	b.produce(t, c.record())
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerBeforeOffsetCommit, fault.ActionError, 1); err != nil {
		t.Fatal(err)
	}
	a := b.start(t, faults)
	testenv.Eventually(t, waitFor, "task completed and ack lost", func() bool {
		return b.status(c.taskID) == taskevent.StatusCompleted && faults.Fired(fault.WorkerBeforeOffsetCommit) == 1
	})
	a.stop(t)
	if n := b.committedTotal(t); n != 0 {
		t.Fatalf("committed offsets sum to %d after a lost ack, want 0", n)
	}
	before := b.task(t, c.taskID)

	w2 := b.start(t, nil)
	testenv.Eventually(t, waitFor, "duplicate counted", func() bool { return w2.count(OutcomeDuplicate) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	after := b.task(t, c.taskID)
	if after.Version != before.Version || after.Status != taskevent.StatusCompleted || !after.UpdatedAt.Equal(before.UpdatedAt) {
		t.Errorf("task changed by the duplicate: before %+v after %+v", before, after)
	}
	if w2.count(OutcomeProcessed) != 0 {
		t.Errorf("second instance processed = %v, want 0", w2.count(OutcomeProcessed))
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
	if n := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskCompleted'`, c.taskID); n != int64(1) {
		t.Errorf("%v TaskCompleted rows, want 1", n)
	}
}

// Poison records are recorded, counted and committed, and do not block the
// records after them in the same partition.
func TestPoisonRecordsDoNotBlockPartition(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"after":"poison"}`))
	key := c.taskID // same key: same partition, before the valid record

	garbage := record(key, []byte("\x00not json"), nil, "")
	undecodable := []byte(`{"event_id":"poison-1"}`)
	sum := sha256.Sum256(undecodable)
	withID := record(key, undecodable, &taskevent.Event{EventID: "poison-1", EventType: taskevent.TypeTaskCreated}, hex.EncodeToString(sum[:]))
	ghostEv := c.ev
	ghostEv.EventID, ghostEv.TaskID = uuid.NewString(), "ghost-"+uuid.NewString()
	ghostEv.Task.TaskID = ghostEv.TaskID
	gv, gsum, err := taskevent.Encode(&ghostEv)
	if err != nil {
		t.Fatal(err)
	}
	ghost := record(key, gv, &ghostEv, gsum) // key != task id
	completedEv := taskevent.Event{EventID: uuid.NewString(), EventType: taskevent.TypeTaskCompleted, TaskVersion: 2}
	other := record(key, []byte(`{}`), &completedEv, "whatever")

	b.produce(t, garbage, withID, ghost, other, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "valid task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if rw.count(OutcomeDeadLettered) != 3 || rw.count(OutcomeIgnored) != 1 || rw.count(OutcomeProcessed) != 1 || rw.count(OutcomeRetried) != 0 {
		t.Errorf("dead_lettered=%v ignored=%v processed=%v retried=%v, want 3 1 1 0",
			rw.count(OutcomeDeadLettered), rw.count(OutcomeIgnored), rw.count(OutcomeProcessed), rw.count(OutcomeRetried))
	}
	if got := len(b.deadLetters(t, 3)); got != 3 {
		t.Errorf("%d dead-letter records, want 3", got)
	}
	for id, code := range map[string]string{"poison-1": CodeInvalidEvent, ghostEv.EventID: CodeKeyMismatch} {
		if s := b.scalar(t, `SELECT state || ' ' || (result_json->>'error_code') FROM inbox_message WHERE message_id = $1`, id); s != "failed "+code {
			t.Errorf("inbox %s: %v, want failed %s", id, s, code)
		}
	}
}

// A TaskCreated for a task that does not exist is a deterministic error.
func TestUnknownTaskIsRecordedAsFailed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	id := "ghost-" + uuid.NewString()
	ev := taskevent.Event{EventID: uuid.NewString(), EventType: taskevent.TypeTaskCreated, SchemaVersion: taskevent.SchemaVersion,
		TaskID: id, Task: taskevent.Task{TaskID: id, Status: taskevent.StatusQueued}}
	value, sum, err := taskevent.Encode(&ev)
	if err != nil {
		t.Fatal(err)
	}
	b.produce(t, record(id, value, &ev, sum))
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "failure recorded", func() bool { return rw.count(OutcomeDeadLettered) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if s := b.scalar(t, `SELECT result_json->>'error_code' FROM inbox_message WHERE message_id = $1 AND state = 'failed'`, ev.EventID); s != CodeTaskNotFound {
		t.Errorf("inbox error code %v, want %s", s, CodeTaskNotFound)
	}
}

// A document the transform rejects fails the task with the canon code.
func TestTransformErrorFailsTask(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"a":1,"a":2}`))
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task failed", func() bool { return b.status(c.taskID) == taskevent.StatusFailed })
	task := b.task(t, c.taskID)
	if task.TerminalErrorCode == nil || *task.TerminalErrorCode != "DUPLICATE_MEMBER_NAME" {
		t.Errorf("terminal code %v, want DUPLICATE_MEMBER_NAME", task.TerminalErrorCode)
	}
	if n := b.scalar(t, `SELECT count(*) FROM effect_ledger WHERE task_id = $1`, c.taskID); n != int64(0) {
		t.Errorf("%v effects for a task that never reached the store", n)
	}
	testenv.Eventually(t, waitFor, "failed counted", func() bool { return rw.count(OutcomeFailed) == 1 })
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]Config{
		"no database": {Brokers: []string{"x"}, ArtifactStore: store},
		"no brokers":  {DatabaseURL: "postgres://x/y", ArtifactStore: store},
		"no store":    {DatabaseURL: "postgres://x/y", Brokers: []string{"x"}},
		"backoff":     {DatabaseURL: "postgres://x/y", Brokers: []string{"x"}, ArtifactStore: store, RetryBackoffMin: time.Second, RetryBackoffMax: time.Millisecond},
		"lease":       {DatabaseURL: "postgres://x/y", Brokers: []string{"x"}, ArtifactStore: store, AttemptTimeout: time.Minute, InboxLease: time.Second},
	} {
		if _, err := New(cfg); err == nil || !strings.HasPrefix(err.Error(), "worker:") {
			t.Errorf("%s: New error %v, want a worker: validation error", name, err)
		}
	}
	reg := prometheus.NewRegistry()
	cfg := Config{Pool: new(pgxpool.Pool), Brokers: []string{"x"}, ArtifactStore: store, Registerer: reg}
	if _, err := New(cfg); err != nil {
		t.Fatalf("New: %v", err)
	}
	if _, err := New(cfg); err == nil {
		t.Error("second New on the same registerer: want a duplicate registration error")
	}
}

// A delivery that crashed after the intake transaction, before the write,
// leaves the task running, the inbox processing and the effect started; the
// reconciler then marks the effect planned (absent in the store). The
// redelivery resumes: same attempt, same token, one write.
func TestResumeFromPlannedEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	doc := []byte(`{"resume":true}`)
	c := createTask(t, b.db.Pool, doc)
	ctx := context.Background()
	token := artifact.Token(c.taskID, 1)
	_, err := b.db.Pool.Exec(ctx, `UPDATE task SET status = 'running', version = 1, attempt = 1 WHERE task_id = $1`, c.taskID)
	if err == nil {
		_, err = b.db.Pool.Exec(ctx, `INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state) VALUES ($1, $2, $3, 'processing')`,
			DefaultGroup, c.ev.EventID, c.sum)
	}
	if err == nil {
		_, err = b.db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, 1, 'artifact.put', $1, 'artifact://' || $1, 'planned', $3, $4)`, token, c.taskID, canonSum(t, doc), len(`{"resume":true}`))
	}
	if err != nil {
		t.Fatal(err)
	}
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	if task := b.task(t, c.taskID); task.Version != 2 || task.Attempt != 1 {
		t.Errorf("task v%d attempt %d, want v2 attempt 1", task.Version, task.Attempt)
	}
	if e := b.effect(t, ledger.KindArtifactPut, token); e.State != ledger.Verified {
		t.Errorf("effect %s, want verified", e.State)
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
	testenv.Eventually(t, waitFor, "processed counted", func() bool { return rw.count(OutcomeProcessed) == 1 })
	if d := b.scalar(t, `SELECT deliveries FROM inbox_message WHERE message_id = $1`, c.ev.EventID); d != int32(2) {
		t.Errorf("inbox deliveries = %v, want 2", d)
	}
}

func canonSum(t *testing.T, doc []byte) string {
	t.Helper()
	out, err := canon.Transform(doc)
	if err != nil {
		t.Fatal(err)
	}
	return canon.SHA256Hex(out)
}

// Two members of the group share the partitions through a rebalance; every
// task completes once, with one object, and every offset is committed.
func TestRebalanceBetweenTwoWorkers(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n = 40
	var tasks []created
	for i := 0; i < n; i++ {
		c := createTask(t, b.db.Pool, []byte(`{"i":`+testenv.Itoa(i)+`,"pad":"`+strings.Repeat("x", i)+`"}`))
		tasks = append(tasks, c)
	}
	for _, c := range tasks[:n/2] {
		b.produce(t, c.record())
	}
	fast := kgo.HeartbeatInterval(50 * time.Millisecond)
	a := b.start(t, nil, fast)
	testenv.Eventually(t, waitFor, "first worker busy", func() bool { return a.count(OutcomeProcessed) > 0 })
	var assigned atomic.Int32
	w2 := b.start(t, nil, fast, kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
		assigned.Add(int32(len(ps[taskevent.DefaultTopic])))
	}))
	testenv.Eventually(t, waitFor, "second worker assigned partitions", func() bool { return assigned.Load() > 0 })
	for _, c := range tasks[n/2:] {
		b.produce(t, c.record())
	}
	testenv.Eventually(t, waitFor, "all tasks completed", func() bool {
		return b.scalar(t, `SELECT count(*) FROM task WHERE status = 'completed'`).(int64) == n
	})
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if a.count(OutcomeProcessed) == 0 || w2.count(OutcomeProcessed) == 0 {
		t.Errorf("processed: first %v, second %v; want both > 0", a.count(OutcomeProcessed), w2.count(OutcomeProcessed))
	}
	if got := a.count(OutcomeProcessed) + w2.count(OutcomeProcessed); got != n {
		t.Errorf("processed %v in total, want %d", got, n)
	}
	if got := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE event_type = 'TaskCompleted'`); got != int64(n) {
		t.Errorf("%v TaskCompleted rows, want %d", got, n)
	}
	m, _ := filepath.Glob(filepath.Join(b.dir, "objects", "*.obj"))
	if len(m) != n {
		t.Errorf("%d objects, want %d", len(m), n)
	}
}

// A re-opened task (a dead-letter replay: failed -> queued at a higher
// version) whose attempt-1 artifact was verified after the task failed is
// completed with that artifact: the new attempt resumes the task's effect
// instead of writing a second artifact under a new token.
func TestReopenedTaskCompletesWithVerifiedEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	doc := []byte(`{"reopened":[1,2]}`)
	c := createTask(t, b.db.Pool, doc)
	ctx := context.Background()
	token := artifact.Token(c.taskID, 1)
	out, err := canon.Transform(doc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Put(token, c.taskID, 1, out); err != nil {
		t.Fatal(err)
	}
	_, err = b.db.Pool.Exec(ctx, `UPDATE task SET status = 'queued', version = 3, attempt = 1 WHERE task_id = $1`, c.taskID)
	if err == nil {
		_, err = b.db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size, observed_result_sha256)
VALUES ($1, $2, 1, 'artifact.put', $1, 'artifact://' || $1, 'verified', $3, $4, $3)`, token, c.taskID, canon.SHA256Hex(out), len(out))
	}
	if err != nil {
		t.Fatal(err)
	}
	b.produce(t, c.record())
	b.start(t, nil)
	testenv.Eventually(t, waitFor, "task completed", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	task := b.task(t, c.taskID)
	if task.Version != 5 || task.Attempt != 2 || task.ArtifactSHA256 == nil || *task.ArtifactSHA256 != canon.SHA256Hex(out) {
		t.Errorf("task %+v, want completed v5 attempt 2 with the verified artifact", task)
	}
	if n := b.scalar(t, `SELECT count(*) FROM effect_ledger WHERE task_id = $1`, c.taskID); n != int64(1) {
		t.Errorf("%v effects, want the one verified", n)
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d objects, want 1", n)
	}
}

// A record that cannot finish (its task row is locked) holds up only its own
// partition: records of other partitions polled after it are processed, and
// it completes once the lock is released.
func TestSlowPartitionDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	slow := createTask(t, b.db.Pool, []byte(`{"slow":true}`))
	tx, err := b.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM task WHERE task_id = $1 FOR UPDATE`, slow.taskID); err != nil {
		t.Fatal(err)
	}
	sr := slow.record()
	b.produce(t, sr)
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "slow record in process", func() bool {
		return b.scalar(t, `SELECT count(*) FROM inbox_message WHERE message_id = $1`, slow.ev.EventID) == int64(0) &&
			b.scalar(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).(int64) > 0
	})
	var others []created
	// More records than a partition's share, so that the slow partition
	// gets several behind its stuck record.
	for i := 0; i < 16; i++ {
		c := createTask(t, b.db.Pool, []byte(`{"other":`+testenv.Itoa(i)+`}`))
		r := c.record()
		b.produce(t, r)
		if r.Partition != sr.Partition {
			others = append(others, c)
		}
	}
	if len(others) == 0 {
		t.Fatal("no record landed on another partition")
	}
	testenv.Eventually(t, waitFor, "other partitions processed", func() bool {
		for _, c := range others {
			if b.status(c.taskID) != taskevent.StatusCompleted {
				return false
			}
		}
		return true
	})
	if s := b.status(slow.taskID); s != taskevent.StatusQueued {
		t.Fatalf("slow task %s while its row is locked, want queued", s)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitFor, "slow task completed", func() bool { return b.status(slow.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if rw.count(OutcomeRetried) != 0 {
		t.Errorf("retried = %v, want 0", rw.count(OutcomeRetried))
	}
}

// A task cancelled while queued is never started: its TaskCreated record
// finds it terminal, the outcome is cancelled, no effect is planned and no
// artifact written.
func TestCancelledTaskIsNotStarted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"cancel":"me"}`))
	if ch, err := task.CancelIfQueued(context.Background(), b.db.Pool, c.taskID, 0); err != nil || !ch.Applied {
		t.Fatalf("cancel: %+v %v", ch, err)
	}
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "cancelled outcome counted", func() bool { return rw.count(OutcomeCancelled) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if tk := b.task(t, c.taskID); tk.Status != taskevent.StatusCancelled || tk.Version != 1 || tk.Attempt != 0 {
		t.Errorf("task %s/v%d attempt %d, want cancelled/v1 attempt 0", tk.Status, tk.Version, tk.Attempt)
	}
	if n := b.scalar(t, `SELECT count(*) FROM effect_ledger WHERE task_id = $1`, c.taskID); n != int64(0) {
		t.Errorf("%v effects for a cancelled task", n)
	}
	if n := b.objects(t, c.taskID); n != 0 {
		t.Errorf("%d artifacts for a cancelled task", n)
	}
}
