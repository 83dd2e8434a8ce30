package deadletter

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

const waitFor = 20 * time.Second

// testBundle is one test's world: its own database and kfake cluster, and
// a Service replaying into that cluster.
type testBundle struct {
	db       *testenv.DB
	kafka    *testenv.Kafka
	producer *kgo.Client
	admin    *kadm.Client
	svc      *Service
	// nextOffset is the origin offset of the next record failedTask makes.
	nextOffset int64
}

// setup creates the bundle; opts adjust the Service's Config.
func setup(t *testing.T, opts ...func(*Config)) *testBundle {
	t.Helper()
	b := &testBundle{db: testenv.NewDB(t), kafka: testenv.NewKafka(t)}
	b.producer = b.kafka.Client(t)
	b.admin = kadm.NewClient(b.producer)
	cfg := Config{Pool: b.db.Pool, Producer: b.producer, Registerer: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, o := range opts {
		o(&cfg)
	}
	var err error
	if b.svc, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	return b
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// failedTask inserts a task created at version 0 and failed by the worker
// at version 1 with code (as worker.recordDeadLetter does), its input, its
// TaskCreated outbox row and the worker's inbox row of that event in state
// failed. It returns the task id and the original record as the worker
// consumed it (topic, partition 0, an origin offset of its own).
func (b *testBundle) failedTask(t *testing.T, code string) (string, *kgo.Record) {
	t.Helper()
	return b.task(t, taskevent.StatusFailed, code, []byte(`{"doc":"`+uuid.NewString()+`"}`))
}

// task inserts a task in status (failed or completed with code, or queued
// when status is queued) with its TaskCreated row, and, for a failed task,
// the inbox row failed with code.
func (b *testBundle) task(t *testing.T, status, code string, doc []byte) (string, *kgo.Record) {
	t.Helper()
	ctx := context.Background()
	taskID := "task-" + uuid.NewString()
	now := time.Now().UTC().Truncate(time.Microsecond)
	created := taskevent.Task{TaskID: taskID, Status: taskevent.StatusQueued, OutputFormat: "jcs", InputSHA256: sum(doc),
		InputSize: int64(len(doc)), CreatedAt: now, UpdatedAt: now}
	ev := taskevent.Event{EventID: uuid.Must(uuid.NewV7()).String(), EventType: taskevent.TypeTaskCreated, SchemaVersion: taskevent.SchemaVersion,
		TaskID: taskID, OccurredAt: now, Task: created}
	value, vsum, err := taskevent.Encode(&ev)
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, b.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `
INSERT INTO task (task_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at)
VALUES ($1, $2, 'queued', 0, 0, 'jcs', $2, $3, $4, $4)`, taskID, sum(doc), len(doc), now); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO task_input (task_id, document) VALUES ($1, $2)`, taskID, doc); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, published_at)
VALUES ($1, $2, 0, 'TaskCreated', $3, $4, now())`, ev.EventID, taskID, string(value), vsum); err != nil {
			return err
		}
		switch status {
		case taskevent.StatusFailed:
			if _, err := tx.Exec(ctx, `UPDATE task SET status = 'failed', version = 1, terminal_error_code = $2 WHERE task_id = $1`, taskID, code); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, result_json, completed_at)
VALUES ($1, $2, $3, 'failed', jsonb_build_object('error_code', $4::text), now())`, taskevent.DefaultWorkerGroup, ev.EventID, vsum, code)
			return err
		case taskevent.StatusCompleted:
			_, err := tx.Exec(ctx, `
UPDATE task SET status = 'completed', version = 2, attempt = 1, artifact_sha256 = $2, artifact_size = 1, completed_at = now()
WHERE task_id = $1`, taskID, sum([]byte("x")))
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert task: %v", err)
	}
	r := &kgo.Record{Topic: b.kafka.Topic, Partition: 0, Offset: b.nextOffset, Key: []byte(taskID), Value: value, Timestamp: now}
	b.nextOffset++
	for _, h := range taskevent.Headers(ev.EventID, ev.EventType, ev.TaskVersion, vsum, ev.Task.TenantID) {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
	}
	return taskID, r
}

// park records the dead letter of orig as the worker produces it and the
// reconciler's intake records it, and returns its id.
func (b *testBundle) park(t *testing.T, orig *kgo.Record, code string) int64 {
	t.Helper()
	now := time.Now().UTC()
	rec := taskevent.DeadLetterRecord(orig, taskevent.DeadLetter{Topic: taskevent.DeadLetterTopic(b.kafka.Topic), Group: taskevent.DefaultWorkerGroup,
		Class: taskevent.ClassDeterministic, Code: code, Message: "processing failed", Attempts: 1, ProcessorVersion: worker.DefaultProcessorVersion, First: now, Last: now})
	rec.Partition, rec.Offset, rec.Timestamp = orig.Partition, orig.Offset, now
	d := FromRecord(rec)
	inserted, err := b.svc.Store().Insert(context.Background(), d)
	if err != nil || !inserted {
		t.Fatalf("insert dead letter: inserted=%v err=%v", inserted, err)
	}
	var id int64
	if err := b.db.Pool.QueryRow(context.Background(), `
SELECT dead_letter_id FROM dead_letter WHERE origin_topic = $1 AND origin_partition = $2 AND origin_offset = $3`,
		d.OriginTopic, d.OriginPartition, d.OriginOffset).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func (b *testBundle) scalar(t *testing.T, sql string, args ...any) any {
	t.Helper()
	var v any
	if err := b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

// published is the number of records in the task-events topic.
func (b *testBundle) published(t *testing.T) int64 {
	t.Helper()
	eo, err := b.admin.ListEndOffsets(context.Background(), b.kafka.Topic)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	eo.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n
}

// records reads n records of the task-events topic from the start.
func (b *testBundle) records(t *testing.T, n int) []*kgo.Record {
	t.Helper()
	cl := b.kafka.Client(t, kgo.ConsumeTopics(b.kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	var out []*kgo.Record
	deadline := time.Now().Add(waitFor)
	for len(out) < n && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) { out = append(out, r) })
		cancel()
	}
	if len(out) < n {
		t.Fatalf("%d records in %s, want %d", len(out), b.kafka.Topic, n)
	}
	return out
}

func (b *testBundle) replays(outcome string) float64 {
	var m dto.Metric
	if err := b.svc.replays.WithLabelValues(outcome).Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

func sameRecord(t *testing.T, got, want *kgo.Record) {
	t.Helper()
	if got.Topic != want.Topic || !bytes.Equal(got.Key, want.Key) || !bytes.Equal(got.Value, want.Value) {
		t.Errorf("replayed record %s key %q differs from the original %s key %q (or its value)", got.Topic, got.Key, want.Topic, want.Key)
	}
	if len(got.Headers) != len(want.Headers) {
		t.Fatalf("replayed record has %d headers, want the original's %d: %v", len(got.Headers), len(want.Headers), got.Headers)
	}
	for i, h := range want.Headers {
		if got.Headers[i].Key != h.Key || !bytes.Equal(got.Headers[i].Value, h.Value) {
			t.Errorf("header %d: %s=%q, want %s=%q", i, got.Headers[i].Key, got.Headers[i].Value, h.Key, h.Value)
		}
	}
}

// The intake records a dead-letter record once per origin offset: the same
// record consumed twice (the intake's offsets were not committed, or the
// worker dead-lettered it twice after a crash) is one row.
func TestInsertIsIdempotent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	now := time.Now().UTC()
	rec := taskevent.DeadLetterRecord(orig, taskevent.DeadLetter{Topic: taskevent.DeadLetterTopic(b.kafka.Topic), Group: taskevent.DefaultWorkerGroup,
		Class: taskevent.ClassDeterministic, Code: worker.CodeInjectedProcessingError, Message: "boom", Attempts: 1, ProcessorVersion: worker.DefaultProcessorVersion, First: now, Last: now})
	for i, want := range []bool{true, false} {
		rec.Offset = int64(10 + i) // a second dead-lettering lands at another dlq offset
		inserted, err := b.svc.Store().Insert(context.Background(), FromRecord(rec))
		if err != nil || inserted != want {
			t.Fatalf("insert %d: inserted=%v err=%v, want %v", i, inserted, err, want)
		}
	}
	if n := b.scalar(t, `SELECT count(*) FROM dead_letter`); n != int64(1) {
		t.Fatalf("%v dead letters, want 1", n)
	}
	list, err := b.svc.List(context.Background(), Filter{})
	if err != nil || len(list) != 1 {
		t.Fatalf("list: %v (%d)", err, len(list))
	}
	d := list[0]
	if d.State != StateParked || d.ReplayCount != 0 || d.OriginTopic != b.kafka.Topic || d.OriginOffset != orig.Offset ||
		d.ErrorCode != worker.CodeInjectedProcessingError || d.ConsumerGroup != taskevent.DefaultWorkerGroup || d.DLQOffset != 10 ||
		d.MessageID == nil || d.TaskID == nil || *d.TaskID != string(orig.Key) {
		t.Errorf("dead letter %+v", d)
	}
	for _, h := range d.Headers {
		if strings.HasPrefix(h.Key, taskevent.HeaderDLQPrefix) {
			t.Errorf("stored original headers include %s", h.Key)
		}
	}

	// A record without the dlq-* headers is recorded under its own position.
	bare := &kgo.Record{Topic: taskevent.DeadLetterTopic(b.kafka.Topic), Partition: 1, Offset: 3, Value: []byte("x"), Timestamp: now}
	for range 2 {
		if _, err := b.svc.Store().Insert(context.Background(), FromRecord(bare)); err != nil {
			t.Fatal(err)
		}
	}
	got, err := b.svc.List(context.Background(), Filter{Code: CodeHeadersMissing})
	if err != nil || len(got) != 1 || got[0].OriginTopic != bare.Topic || got[0].OriginOffset != 3 {
		t.Fatalf("headerless dead letter: %v %+v", err, got)
	}
}

func TestListFiltersAndGet(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	taskA, a := b.failedTask(t, "CODE_A")
	_, a2 := b.failedTask(t, "CODE_A")
	_, c := b.failedTask(t, "CODE_B")
	idA, idA2, idB := b.park(t, a, "CODE_A"), b.park(t, a2, "CODE_A"), b.park(t, c, "CODE_B")
	if _, err := b.db.Pool.Exec(ctx, `UPDATE dead_letter SET state = 'resolved', last_replay_at = now() WHERE dead_letter_id = $1`, idA2); err != nil {
		t.Fatal(err)
	}
	ids := func(ds []DeadLetter) []int64 {
		out := []int64{}
		for _, d := range ds {
			out = append(out, d.ID)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		f    Filter
		want []int64
	}{
		{"all, oldest first", Filter{}, []int64{idA, idA2, idB}},
		{"code", Filter{Code: "CODE_A"}, []int64{idA, idA2}},
		{"code and state", Filter{Code: "CODE_A", States: []string{StateParked}}, []int64{idA}},
		{"states", Filter{States: []string{StateResolved, StateRefused}}, []int64{idA2}},
		{"task", Filter{TaskID: taskA}, []int64{idA}},
		{"limit", Filter{Limit: 2}, []int64{idA, idA2}},
		{"unknown code", Filter{Code: "NOPE"}, []int64{}},
	} {
		got, err := b.svc.List(ctx, tc.f)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if g := ids(got); len(g) != len(tc.want) || (len(g) > 0 && !equal(g, tc.want)) {
			t.Errorf("%s: ids %v, want %v", tc.name, g, tc.want)
		}
	}
	d, err := b.svc.Get(ctx, idB)
	if err != nil || d.ID != idB || d.ErrorCode != "CODE_B" || !bytes.Equal(d.Value, c.Value) {
		t.Fatalf("get %d: %v %+v", idB, err, d)
	}
	if _, err := b.svc.Get(ctx, idB+100); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get unknown id: %v, want ErrNotFound", err)
	}
}

func equal(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A replay of a dead letter whose task failed because of it re-opens the
// task (failed -> queued, version+1, by compare-and-set), writes its
// TaskRedriveRequested event, resets the worker's inbox row and re-publishes
// the original record unchanged; who, when and why are recorded.
func TestReplayReopensTaskAndRepublishesOriginal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	taskID, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	id := b.park(t, orig, worker.CodeInjectedProcessingError)
	before := time.Now().Add(-time.Second)

	res, err := b.svc.Replay(ctx, id, Request{Reason: "fixed the parser", By: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Outcome != OutcomeReplayed || res.State != StateReplayed || res.ReplayCount != 1 || !res.TaskReopened || !strings.Contains(res.Message, "re-opened") {
		t.Fatalf("result %+v", res)
	}
	var status string
	var version int64
	var code *string
	if err := b.db.Pool.QueryRow(ctx, `SELECT status, version, terminal_error_code FROM task WHERE task_id = $1`, taskID).Scan(&status, &version, &code); err != nil {
		t.Fatal(err)
	}
	if status != taskevent.StatusQueued || version != 2 || code != nil {
		t.Errorf("task %s v%d code %v, want queued v2 without code", status, version, code)
	}
	eventID, _ := headerValue(orig, taskevent.HeaderEventID)
	if s := b.scalar(t, `SELECT state FROM inbox_message WHERE consumer_name = $1 AND message_id = $2`, taskevent.DefaultWorkerGroup, eventID); s != "processing" {
		t.Errorf("inbox row %v, want processing", s)
	}
	// The re-open is an event: the projector replaces the failed view.
	var payload []byte
	if err := b.db.Pool.QueryRow(ctx, `
SELECT payload::text FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskRedriveRequested' AND aggregate_version = 2`, taskID).Scan(&payload); err != nil {
		t.Fatalf("TaskRedriveRequested of v2: %v", err)
	}
	ev, err := taskevent.Decode(payload)
	if err != nil || ev.Task.Status != taskevent.StatusQueued || ev.TaskVersion != 2 || ev.Task.Version != 2 || ev.Task.TerminalErrorCode != nil {
		t.Errorf("re-drive event %v %+v", err, ev)
	}
	recs := b.records(t, 1)
	if len(recs) != 1 {
		t.Fatalf("%d records", len(recs))
	}
	sameRecord(t, recs[0], &kgo.Record{Topic: orig.Topic, Key: orig.Key, Value: orig.Value, Headers: orig.Headers})
	if got, _ := headerValue(recs[0], taskevent.HeaderEventID); got != eventID {
		t.Errorf("event id %q, want %q", got, eventID)
	}
	d, err := b.svc.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if d.State != StateReplayed || d.ReplayCount != 1 || d.LastReplayBy == nil || *d.LastReplayBy != "alice" ||
		d.LastReplayReason == nil || *d.LastReplayReason != "fixed the parser" || d.LastReplayAt == nil || d.LastReplayAt.Before(before) ||
		d.LastReplayOutcome == nil || *d.LastReplayOutcome != res.Message {
		t.Errorf("dead letter after replay: %+v", d)
	}
	if v := b.replays(OutcomeReplayed); v != 1 {
		t.Errorf("converge_deadletter_replays_total{outcome=replayed} = %v, want 1", v)
	}
}

func headerValue(r *kgo.Record, key string) (string, bool) {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

// MaxReplays bounds the replays of one message: a redelivery that failed
// again is parked as a new dead letter, and replaying that one past the
// limit marks it refused and publishes nothing.
func TestReplayPastLimitIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxReplays = 1 })
	ctx := context.Background()
	taskID, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	first := b.park(t, orig, worker.CodeInjectedProcessingError)
	if res, err := b.svc.Replay(ctx, first, Request{Reason: "try 1", By: "bob"}); err != nil || res.Outcome != OutcomeReplayed {
		t.Fatalf("first replay: %+v %v", res, err)
	}
	// The redelivery fails again: the worker fails the task with the same
	// code and dead-letters the record from its new offset.
	if _, err := b.db.Pool.Exec(ctx, `UPDATE task SET status = 'failed', version = version + 2, terminal_error_code = $2 WHERE task_id = $1`,
		taskID, worker.CodeInjectedProcessingError); err != nil {
		t.Fatal(err)
	}
	again := *orig
	again.Offset = 1000
	second := b.park(t, &again, worker.CodeInjectedProcessingError)
	n := b.published(t)

	res, err := b.svc.Replay(ctx, second, Request{Reason: "try 2", By: "bob"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Outcome != OutcomeRefused || res.State != StateRefused || res.TaskReopened || !strings.Contains(res.Message, "limit 1") {
		t.Fatalf("result %+v, want refused", res)
	}
	if got := b.published(t); got != n {
		t.Errorf("%d records published by a refused replay", got-n)
	}
	if s := b.scalar(t, `SELECT status FROM task WHERE task_id = $1`, taskID); s != taskevent.StatusFailed {
		t.Errorf("task %v after a refused replay, want failed", s)
	}
	d, _ := b.svc.Get(ctx, second)
	if d.State != StateRefused || d.ReplayCount != 0 || d.LastReplayBy == nil || *d.LastReplayBy != "bob" || d.LastReplayReason == nil || *d.LastReplayReason != "try 2" {
		t.Errorf("refused dead letter %+v", d)
	}
	// Asking again keeps it refused.
	if res, err := b.svc.Replay(ctx, second, Request{Reason: "try 3"}); err != nil || res.Outcome != OutcomeRefused {
		t.Errorf("replay of a refused dead letter: %+v %v", res, err)
	}
	if b.replays(OutcomeRefused) != 2 {
		t.Errorf("refused counted %v times, want 2", b.replays(OutcomeRefused))
	}
}

func TestReplayAllByCode(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var want []int64
	for range 2 {
		_, r := b.failedTask(t, "CODE_A")
		want = append(want, b.park(t, r, "CODE_A"))
	}
	_, other := b.failedTask(t, "CODE_B")
	otherID := b.park(t, other, "CODE_B")

	if _, err := b.svc.ReplayAll(ctx, "CODE_A", 0, Request{}); !errors.Is(err, ErrReasonRequired) {
		t.Fatalf("ReplayAll without a reason: %v", err)
	}
	results, err := b.svc.ReplayAll(ctx, "CODE_A", 0, Request{Reason: "fixed A", By: "carol"})
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != 2 {
		t.Fatalf("%d results, want 2: %+v", len(results), results)
	}
	for i, r := range results {
		if r.ID != want[i] || r.Outcome != OutcomeReplayed || !r.TaskReopened {
			t.Errorf("result %d: %+v", i, r)
		}
	}
	if d, _ := b.svc.Get(ctx, otherID); d.State != StateParked {
		t.Errorf("CODE_B dead letter %s, want parked", d.State)
	}
	if n := b.published(t); n != 2 {
		t.Errorf("%d records published, want 2", n)
	}
	// Nothing parked of CODE_A is left: a second bulk replay does nothing.
	if results, err := b.svc.ReplayAll(ctx, "CODE_A", 0, Request{Reason: "again"}); err != nil || len(results) != 0 {
		t.Errorf("second ReplayAll: %v %+v", err, results)
	}
}

// A replay of a message whose task is completed, or failed for another
// reason, is a no-op (resolved) with a message saying why.
func TestReplayOfTerminalTaskIsNoop(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, done := b.task(t, taskevent.StatusCompleted, "", []byte(`{"done":true}`))
	doneID := b.park(t, done, worker.CodeRetriesExhausted)
	otherTask, other := b.failedTask(t, worker.CodeArtifactVerificationFailed)
	otherID := b.park(t, other, worker.CodeRetriesExhausted)

	for _, tc := range []struct {
		id   int64
		want string
	}{{doneID, "is already completed; nothing to replay"},
		{otherID, "failed with " + worker.CodeArtifactVerificationFailed + ", not because of this dead letter; nothing to replay"}} {
		res, err := b.svc.Replay(ctx, tc.id, Request{Reason: "check", By: "dave"})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != OutcomeNoop || res.State != StateResolved || res.TaskReopened || !strings.Contains(res.Message, tc.want) {
			t.Errorf("dead letter %d: %+v, want noop resolved %q", tc.id, res, tc.want)
		}
		d, _ := b.svc.Get(ctx, tc.id)
		if d.State != StateResolved || d.ReplayCount != 0 || d.LastReplayBy == nil || *d.LastReplayBy != "dave" {
			t.Errorf("dead letter %d after no-op: %+v", tc.id, d)
		}
		// Asked again: still a no-op.
		if res, err := b.svc.Replay(ctx, tc.id, Request{Reason: "again"}); err != nil || res.Outcome != OutcomeNoop {
			t.Errorf("second request: %+v %v", res, err)
		}
	}
	if n := b.published(t); n != 0 {
		t.Errorf("%d records published by no-op replays", n)
	}
	if s := b.scalar(t, `SELECT status || ' ' || version FROM task WHERE task_id = $1`, otherTask); s != "failed 1" {
		t.Errorf("task %v, want failed 1 (untouched)", s)
	}
}

// Concurrent replay requests for one dead letter publish once: the row
// lock serialises them and the later ones find it replayed.
func TestConcurrentReplaysPublishOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	taskID, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	id := b.park(t, orig, worker.CodeInjectedProcessingError)
	const n = 8
	var wg sync.WaitGroup
	results := make([]Result, n)
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = b.svc.Replay(ctx, id, Request{Reason: "race", By: "op-" + testenv.Itoa(i)})
		}()
	}
	close(start)
	wg.Wait()
	replayed := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("replay %d: %v", i, errs[i])
		}
		switch results[i].Outcome {
		case OutcomeReplayed:
			replayed++
		case OutcomeNoop:
			if !strings.Contains(results[i].Message, "already replayed") {
				t.Errorf("no-op message %q", results[i].Message)
			}
		default:
			t.Errorf("replay %d: %+v", i, results[i])
		}
	}
	if replayed != 1 {
		t.Fatalf("%d replays published, want 1", replayed)
	}
	if got := b.published(t); got != 1 {
		t.Errorf("%d records in the topic, want 1", got)
	}
	if s := b.scalar(t, `SELECT status || ' ' || version FROM task WHERE task_id = $1`, taskID); s != "queued 2" {
		t.Errorf("task %v, want queued 2 (re-opened once)", s)
	}
	if c := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskRedriveRequested'`, taskID); c != int64(1) {
		t.Errorf("%v re-drive events, want 1", c)
	}
	if d, _ := b.svc.Get(ctx, id); d.ReplayCount != 1 || d.State != StateReplayed {
		t.Errorf("dead letter %+v", d)
	}
}

func TestReplayErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	id := b.park(t, orig, worker.CodeInjectedProcessingError)
	if _, err := b.svc.Replay(ctx, id, Request{Reason: "  "}); !errors.Is(err, ErrReasonRequired) {
		t.Errorf("blank reason: %v", err)
	}
	if _, err := b.svc.Replay(ctx, id+1000, Request{Reason: "x"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown id: %v", err)
	}
	noKafka, err := New(Config{Pool: b.db.Pool})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := noKafka.Replay(ctx, id, Request{Reason: "x"}); !errors.Is(err, ErrNoProducer) {
		t.Errorf("no producer: %v", err)
	}
	if d, _ := b.svc.Get(ctx, id); d.State != StateParked || d.LastReplayAt != nil {
		t.Errorf("dead letter changed by refused requests: %+v", d)
	}
}

// A dead letter the worker parked without its value (too large for the
// dead-letter topic: dlq-value-omitted) says so in its error message and
// is never replayed: publishing it would produce an empty record and use
// up one of the task's replays (issue 13 review).
func TestReplayOfDeadLetterWithoutValueIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, orig := b.failedTask(t, worker.CodeInjectedProcessingError)
	now := time.Now().UTC()
	rec := taskevent.DeadLetterRecord(orig, taskevent.DeadLetter{Topic: taskevent.DeadLetterTopic(b.kafka.Topic), Group: taskevent.DefaultWorkerGroup,
		Class: taskevent.ClassDeterministic, Code: worker.CodeInjectedProcessingError, Message: "processing failed", Attempts: 1,
		ProcessorVersion: worker.DefaultProcessorVersion, First: now, Last: now})
	rec.Value = nil
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: taskevent.HeaderDLQValueOmitted, Value: []byte("MESSAGE_TOO_LARGE: 2000000 bytes")})
	rec.Partition, rec.Offset, rec.Timestamp = orig.Partition, orig.Offset, now
	d := FromRecord(rec)
	if !strings.Contains(d.ErrorMessage, "value not kept: MESSAGE_TOO_LARGE: 2000000 bytes") {
		t.Fatalf("error message %q does not say the value was not kept", d.ErrorMessage)
	}
	if _, err := b.svc.Store().Insert(ctx, d); err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := b.db.Pool.QueryRow(ctx, `SELECT dead_letter_id FROM dead_letter WHERE origin_offset = $1 AND origin_partition = $2`, orig.Offset, orig.Partition).Scan(&id); err != nil {
		t.Fatal(err)
	}
	n := b.published(t)
	res, err := b.svc.Replay(ctx, id, Request{Reason: "try", By: "bob"})
	if err != nil || res.Outcome != OutcomeRefused || !strings.Contains(res.Message, "keeps no value") {
		t.Fatalf("replay = %+v, %v; want refused, nothing to replay", res, err)
	}
	if got := b.published(t); got != n {
		t.Fatalf("%d records published", got-n)
	}
	if got, _ := b.svc.Get(ctx, id); got.ReplayCount != 0 {
		t.Fatalf("replay count %d, want 0", got.ReplayCount)
	}
}
