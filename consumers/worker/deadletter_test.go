package worker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// deadLetters reads n records from the dead-letter topic.
func (b *testBundle) deadLetters(t *testing.T, n int) []*kgo.Record {
	t.Helper()
	cl := b.kafka.Client(t, kgo.ConsumeTopics(taskevent.DeadLetterTopic(b.kafka.Topic)), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	var out []*kgo.Record
	deadline := time.Now().Add(waitFor)
	for len(out) < n && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) { out = append(out, r) })
		cancel()
	}
	return out
}

func header(r *kgo.Record, key string) (string, int) {
	var v string
	n := 0
	for _, h := range r.Headers {
		if h.Key == key {
			v, n = string(h.Value), n+1
		}
	}
	return v, n
}

// A poison message (fault.WorkerProcessError for one task) is dead-lettered
// at once with the original record and the dlq-* headers, the task fails
// with the stable code, and the partition moves on.
func TestPoisonMessageIsDeadLettered(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	poison := createTask(t, b.db.Pool, []byte(`{"poison":true}`))
	healthy := createTask(t, b.db.Pool, []byte(`{"healthy":true}`))
	faults := &fault.Set{}
	if err := faults.ArmKey(fault.WorkerProcessError, fault.ActionError, 0, poison.ev.Task.InputSHA256); err != nil {
		t.Fatal(err)
	}
	orig := poison.record()
	b.produce(t, orig, healthy.record())
	rw := b.start(t, faults)
	testenv.Eventually(t, waitFor, "healthy completed, poison failed", func() bool {
		return b.status(healthy.taskID) == taskevent.StatusCompleted && b.status(poison.taskID) == taskevent.StatusFailed
	})
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	task := b.task(t, poison.taskID)
	if task.TerminalErrorCode == nil || *task.TerminalErrorCode != CodeInjectedProcessingError || task.Version != 1 {
		t.Errorf("poison task v%d code %v, want v1 %s", task.Version, task.TerminalErrorCode, CodeInjectedProcessingError)
	}
	if n := b.scalar(t, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskFailed'`, poison.taskID); n != int64(1) {
		t.Errorf("%v TaskFailed events, want 1", n)
	}
	if s := b.scalar(t, `SELECT state || ' ' || (result_json->>'error_code') FROM inbox_message WHERE message_id = $1`, poison.ev.EventID); s != "failed "+CodeInjectedProcessingError {
		t.Errorf("inbox %v", s)
	}
	if rw.count(OutcomeDeadLettered) != 1 || rw.count(OutcomeRetried) != 0 {
		t.Errorf("dead_lettered=%v retried=%v, want 1 0", rw.count(OutcomeDeadLettered), rw.count(OutcomeRetried))
	}
	if v := counterValue(rw.w.m.deadLettered.WithLabelValues(CodeInjectedProcessingError)); v != 1 {
		t.Errorf("converge_deadletter_published_total = %v, want 1", v)
	}
	recs := b.deadLetters(t, 1)
	if len(recs) != 1 {
		t.Fatalf("%d dead letters, want 1", len(recs))
	}
	d := recs[0]
	if string(d.Key) != string(orig.Key) || string(d.Value) != string(orig.Value) {
		t.Error("dead letter key/value differ from the original")
	}
	if got, _ := header(d, taskevent.HeaderEventID); got != poison.ev.EventID {
		t.Errorf("event-id header %q", got)
	}
	want := map[string]string{
		taskevent.HeaderDLQOriginalTopic: b.kafka.Topic, taskevent.HeaderDLQConsumerGroup: DefaultGroup, taskevent.HeaderDLQErrorClass: taskevent.ClassDeterministic,
		taskevent.HeaderDLQErrorCode: CodeInjectedProcessingError, taskevent.HeaderDLQAttempts: "1", taskevent.HeaderDLQProcessorVersion: DefaultProcessorVersion,
	}
	for k, v := range want {
		if got, n := header(d, k); got != v || n != 1 {
			t.Errorf("header %s = %q (%d times), want %q once", k, got, n, v)
		}
	}
	for _, k := range []string{taskevent.HeaderDLQOriginalPart, taskevent.HeaderDLQOriginalOffset, taskevent.HeaderDLQErrorMessage, taskevent.HeaderDLQFirstFailureAt, taskevent.HeaderDLQLastFailureAt} {
		if got, n := header(d, k); got == "" || n != 1 {
			t.Errorf("header %s = %q (%d times)", k, got, n)
		}
	}
}

// A retryable error that persists is retried MaxAttempts times, then
// dead-lettered with class retryable and RETRIES_EXHAUSTED.
func TestRetriesExhaustedAreDeadLettered(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.maxAttempts = 3
	c := createTask(t, b.db.Pool, []byte(`{"retry":"me"}`))
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	b.produce(t, c.record())
	rw := b.start(t, faults)
	testenv.Eventually(t, waitFor, "task failed", func() bool { return b.status(c.taskID) == taskevent.StatusFailed })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := faults.Fired(fault.WorkerAfterArtifactWrite); got != 3 {
		t.Errorf("fault fired %d times, want 3 (MaxAttempts)", got)
	}
	if rw.count(OutcomeRetried) != 2 || rw.count(OutcomeDeadLettered) != 1 {
		t.Errorf("retried=%v dead_lettered=%v, want 2 1", rw.count(OutcomeRetried), rw.count(OutcomeDeadLettered))
	}
	task := b.task(t, c.taskID)
	if task.TerminalErrorCode == nil || *task.TerminalErrorCode != CodeRetriesExhausted {
		t.Errorf("code %v, want %s", task.TerminalErrorCode, CodeRetriesExhausted)
	}
	recs := b.deadLetters(t, 1)
	if len(recs) != 1 {
		t.Fatalf("%d dead letters", len(recs))
	}
	if cl, _ := header(recs[0], taskevent.HeaderDLQErrorClass); cl != taskevent.ClassRetryable {
		t.Errorf("class %q", cl)
	}
	if a, _ := header(recs[0], taskevent.HeaderDLQAttempts); a != "3" {
		t.Errorf("attempts %q", a)
	}
}

// A poison record larger than the dead-letter topic accepts (here: the
// worker's producer limit of 16 KiB, like a record over 1 MiB at the
// defaults) is dead-lettered without its value, with dlq-value-omitted,
// and the partition moves on: retrying the produce forever wedged it
// (issue 13 review).
func TestDeadLetterTooLargeIsParkedWithoutValue(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	healthy := createTask(t, b.db.Pool, []byte(`{"healthy":true}`))
	// A record of its own (its own event id: the inbox must not see it as
	// the healthy record's id reused), its value replaced, so its
	// payload_sha256 header no longer matches.
	big := createTask(t, b.db.Pool, []byte(`{"big":true}`)).record()
	big.Value = []byte(`{"pad":"` + strings.Repeat("x", 32<<10) + `"}`)
	big.Key = []byte("task-big")
	b.produce(t, big, healthy.record())
	b.start(t, nil, kgo.ProducerBatchMaxBytes(16<<10))
	testenv.Eventually(t, waitFor, "healthy task completed", func() bool { return b.status(healthy.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	recs := b.deadLetters(t, 1)
	if len(recs) != 1 {
		t.Fatalf("%d dead letters, want 1", len(recs))
	}
	d := recs[0]
	omitted, n := header(d, taskevent.HeaderDLQValueOmitted)
	if len(d.Value) != 0 || n != 1 || !strings.HasPrefix(omitted, "MESSAGE_TOO_LARGE: ") || string(d.Key) != "task-big" {
		t.Fatalf("dead letter key %q, %d value bytes, %s=%q; want the key, no value, MESSAGE_TOO_LARGE", d.Key, len(d.Value), taskevent.HeaderDLQValueOmitted, omitted)
	}
	if code, _ := header(d, taskevent.HeaderDLQErrorCode); code == "" {
		t.Error("dead letter without its error code")
	}
}
