package testenv

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
)

// The row factory of the tests (River's testfactory is the model): rows are
// written through the aggregates' owners (task, outbox, ledger), as the
// components write them, instead of hand-written INSERTs.

// Created is a task the factory created, with its TaskCreated event.
type Created struct {
	Task  taskevent.Task
	Event taskevent.Event
	// Value and SHA256 are the event's canonical bytes and their hash.
	Value  []byte
	SHA256 string
}

// Record returns the TaskCreated record the relay would produce for c.
func (c Created) Record() *kgo.Record { return EventRecord(&c.Event, c.Value, c.SHA256) }

// EventRecord builds the task-events record of ev (value and its SHA-256)
// with the contract's headers (taskevent.Headers).
func EventRecord(ev *taskevent.Event, value []byte, sum string) *kgo.Record {
	r := &kgo.Record{Topic: taskevent.DefaultTopic, Key: []byte(ev.TaskID), Value: value}
	for _, h := range taskevent.Headers(ev.EventID, ev.EventType, ev.TaskVersion, sum, ev.Task.TenantID) {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
	}
	return r
}

// CreateTask creates, in q (a transaction the caller commits, or a pool), a
// queued task at version 0 with document doc and its TaskCreated outbox row,
// as the API's create transaction does (without the idempotency record).
//
// doc is stored as given, as the API stored documents before it stored
// their canonical form, and input_sha256 and input_size are those of its
// RFC 8785 form (seed 3): a canonical doc is what today's API stores, any
// other valid one what an earlier release stored (task.CanonicalInput takes
// both). A doc outside I-JSON, which no API stores, gets an input_sha256 no
// stored bytes hash to, so the worker canonicalizes it and fails the task.
func CreateTask(ctx context.Context, q dbpool.Querier, doc []byte) (Created, error) {
	in := sha256.Sum256(append([]byte("not canonicalizable:"), doc...))
	size := int64(len(doc))
	if c, err := canon.Transform(doc); err == nil {
		in, size = sha256.Sum256(c), int64(len(c))
	}
	fp := sha256.Sum256(append([]byte("document-transform:"), doc...))
	now := time.Now().UTC().Truncate(time.Microsecond)
	t := taskevent.Task{TaskID: "task-" + uuid.NewString(), Status: taskevent.StatusQueued, OutputFormat: "jcs",
		InputSHA256: hex.EncodeToString(in[:]), InputSize: size, CreatedAt: now, UpdatedAt: now}
	b := &pgx.Batch{}
	task.QueueCreate(b, t, hex.EncodeToString(fp[:]), doc)
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		return Created{}, err
	}
	ev, err := outbox.Insert(ctx, q, taskevent.TypeTaskCreated, t)
	if err != nil {
		return Created{}, err
	}
	value, sum, err := taskevent.Encode(&ev)
	if err != nil {
		return Created{}, err
	}
	return Created{Task: t, Event: ev, Value: value, SHA256: sum}, nil
}

// MustCreateTask is CreateTask on pool, failing t on error.
func MustCreateTask(t testing.TB, q dbpool.Querier, doc []byte) Created {
	t.Helper()
	c, err := CreateTask(context.Background(), q, doc)
	if err != nil {
		t.Fatalf("create task: %v", err)
	}
	return c
}

// MustStartTask moves a created task queued -> running (version 1, attempt
// 1), as the worker's intake does, and returns the running snapshot.
func MustStartTask(t testing.TB, q dbpool.Querier, id string) taskevent.Task {
	t.Helper()
	c, err := task.StartIfQueued(context.Background(), q, id, 0)
	if err != nil || !c.Applied {
		t.Fatalf("start task %s: applied=%v err=%v", id, c.Applied, err)
	}
	return c.Task
}

// MustPlanEffect writes the artifact.put effect of attempt 1 of running
// task tk with data as its request, in state, last updated age ago, and
// returns it. The state and the age are set directly: a test places an
// effect where a crashed worker would have left it.
func MustPlanEffect(t testing.TB, q dbpool.Querier, tk taskevent.Task, state ledger.State, data []byte, age time.Duration) ledger.Effect {
	t.Helper()
	ctx := context.Background()
	s := sha256.Sum256(data)
	e, _, err := ledger.Plan(ctx, q, ledger.NewPut(tk.TaskID, tk.Attempt, hex.EncodeToString(s[:]), int64(len(data))))
	if err != nil {
		t.Fatalf("plan effect: %v", err)
	}
	if _, err := q.Exec(ctx, `UPDATE effect_ledger SET state = $2, updated_at = now() - make_interval(secs => $3) WHERE effect_id = $1`,
		e.EffectID, state, age.Seconds()); err != nil {
		t.Fatalf("place effect %s in %s: %v", e.EffectID, state, err)
	}
	e.State = state
	return e
}

// RequireTaskStatus fails t unless task id is in status (read through package
// task).
func RequireTaskStatus(t testing.TB, q dbpool.Querier, id, status string) taskevent.Task {
	t.Helper()
	tk, found, err := task.Get(context.Background(), q, id)
	if err != nil || !found {
		t.Fatalf("read task %s: found=%v err=%v", id, found, err)
	}
	if tk.Status != status {
		t.Fatalf("task %s is %s (v%d), want %s", id, tk.Status, tk.Version, status)
	}
	return tk
}

// RequireEffect reads the effect (kind, token) through package ledger,
// failing t when it is not recorded.
func RequireEffect(t testing.TB, q dbpool.Querier, kind ledger.Kind, token string) ledger.Effect {
	t.Helper()
	e, found, err := ledger.Get(context.Background(), q, kind, token)
	if err != nil || !found {
		t.Fatalf("read effect %s %s: found=%v err=%v", kind, token, found, err)
	}
	return e
}

// MetricSum returns the sum of the values of metric name in reg over its
// series whose labels include every pair of labels (nil: every series):
// counters, gauges and untyped metrics.
func MetricSum(t testing.TB, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue() + m.GetUntyped().GetValue()
		}
	}
	return sum
}
