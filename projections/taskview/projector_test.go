package taskview

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

type projectorBundle struct {
	kafka    *testenv.Kafka
	producer *kgo.Client
	rdb      *redis.Client
	reg      *prometheus.Registry
	proj     *Projector
	group    string
}

// setupProjector starts a kfake cluster and a projector (running until the
// test ends) over rdb.
func setupProjector(t *testing.T, rdb *redis.Client) *projectorBundle {
	t.Helper()
	k := testenv.NewKafka(t)
	b := &projectorBundle{kafka: k, producer: k.Client(t), rdb: rdb, reg: prometheus.NewRegistry(), group: "projector-" + uuid.NewString()}
	p, err := New(Config{
		Brokers: k.Brokers, Group: b.group, Redis: rdb, Registerer: b.reg,
		RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		KafkaOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100 * time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	b.proj = p
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := p.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })
	return b
}

func (b *projectorBundle) produce(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	if err := b.producer.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

func eventRecord(t *testing.T, task taskevent.Task, eventType string) *kgo.Record {
	t.Helper()
	ev := &taskevent.Event{EventID: uuid.NewString(), EventType: eventType, SchemaVersion: taskevent.SchemaVersion,
		TaskID: task.TaskID, TaskVersion: task.Version, OccurredAt: task.UpdatedAt, Task: task}
	value, sum, err := taskevent.Encode(ev)
	if err != nil {
		t.Fatal(err)
	}
	r := &kgo.Record{Topic: taskevent.DefaultTopic, Key: []byte(task.TaskID), Value: value}
	for _, h := range taskevent.Headers(ev.EventID, eventType, task.Version, sum, task.TenantID) {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
	}
	return r
}

func (b *projectorBundle) committed(t *testing.T) int64 {
	t.Helper()
	adm := kadm.NewClient(b.producer)
	resp, err := adm.FetchOffsets(context.Background(), b.group)
	if err != nil {
		return -1
	}
	var total int64
	resp.Each(func(o kadm.OffsetResponse) {
		if o.Err == nil && o.At > 0 {
			total += o.At
		}
	})
	return total
}

func TestProjectorOrdersByVersion(t *testing.T) {
	t.Parallel()
	_, rdb := testenv.Redis(t)
	b := setupProjector(t, rdb)
	id := newTaskID(t)

	created := snapshot(id, 0, taskevent.StatusQueued)
	completed := snapshot(id, 2, taskevent.StatusCompleted)
	sum := "1111111111111111111111111111111111111111111111111111111111111111"
	size := int64(2)
	now := time.Now().UTC().Truncate(time.Microsecond)
	completed.ArtifactSHA256, completed.ArtifactSize, completed.CompletedAt = &sum, &size, &now

	createdRec := eventRecord(t, created, taskevent.TypeTaskCreated)
	// Undecodable records in the same partition must not block the rest.
	poison := &kgo.Record{Topic: taskevent.DefaultTopic, Key: []byte(id), Value: []byte("not json")}
	badHash := eventRecord(t, snapshot(id, 7, taskevent.StatusFailed), taskevent.TypeTaskFailed)
	badHash.Headers[3].Value = []byte("0000000000000000000000000000000000000000000000000000000000000000")
	late := *createdRec // the late duplicate of TaskCreated v0
	late.Headers = append([]kgo.RecordHeader(nil), createdRec.Headers...)

	b.produce(t, createdRec, poison, eventRecord(t, completed, taskevent.TypeTaskCompleted), badHash, &late)

	cache := b.proj.Cache()
	testenv.Eventually(t, 10*time.Second, "all five records handled", func() bool {
		return counterValue(t, b.reg, "converge_projector_events_total", map[string]string{"outcome": "stored"})+
			counterValue(t, b.reg, "converge_projector_events_total", map[string]string{"outcome": "stale"})+
			counterValue(t, b.reg, "converge_projector_events_total", map[string]string{"outcome": "invalid"}) == 5
	})
	got, ok, err := cache.Get(context.Background(), id)
	if err != nil || !ok {
		t.Fatalf("view missing: %v %v", ok, err)
	}
	if got.Version != 2 || got.Status != taskevent.StatusCompleted || got.ArtifactSHA256 == nil || *got.ArtifactSHA256 != sum {
		t.Fatalf("view = v%d %s, want v2 completed", got.Version, got.Status)
	}
	for outcome, want := range map[string]float64{"stored": 2, "stale": 1, "invalid": 2} {
		if n := counterValue(t, b.reg, "converge_projector_events_total", map[string]string{"outcome": outcome}); n != want {
			t.Errorf("events{outcome=%s} = %v, want %v", outcome, n, want)
		}
	}
	if n := counterValue(t, b.reg, "converge_cache_stale_writes_rejected_total", nil); n != 1 {
		t.Errorf("stale writes rejected = %v, want 1", n)
	}
	testenv.Eventually(t, 10*time.Second, "offsets of all five records committed", func() bool {
		return b.committed(t) == 5
	})
}

// failingLimiter makes every Redis command fail while broken is set.
type failingLimiter struct{ broken atomic.Bool }

func (l *failingLimiter) Allow() error {
	if l.broken.Load() {
		return errors.New("redis down (test)")
	}
	return nil
}
func (l *failingLimiter) ReportResult(error) {}

func TestProjectorRetriesWhileRedisDown(t *testing.T) {
	t.Parallel()
	url, _ := testenv.Redis(t)
	opt, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	lim := &failingLimiter{}
	lim.broken.Store(true)
	opt.Limiter = lim
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })

	b := setupProjector(t, rdb)
	id := newTaskID(t)
	b.produce(t, eventRecord(t, snapshot(id, 0, taskevent.StatusQueued), taskevent.TypeTaskCreated))

	testenv.Eventually(t, 10*time.Second, "redis write retried", func() bool {
		return counterValue(t, b.reg, "converge_projector_redis_errors_total", nil) >= 3
	})
	if n := b.committed(t); n > 0 {
		t.Fatalf("committed %d offsets while the record was not projected", n)
	}
	lim.broken.Store(false)
	testenv.Eventually(t, 10*time.Second, "view stored after redis recovered", func() bool {
		_, ok, _ := b.proj.Cache().Get(context.Background(), id)
		return ok
	})
	testenv.Eventually(t, 10*time.Second, "offset committed", func() bool { return b.committed(t) == 1 })
}

func TestProjectorConfig(t *testing.T) {
	t.Parallel()
	_, rdb := testenv.Redis(t)
	if _, err := New(Config{Redis: rdb}); err == nil {
		t.Error("missing Brokers accepted")
	}
	if _, err := New(Config{Brokers: []string{"127.0.0.1:1"}}); err == nil {
		t.Error("missing Redis accepted")
	}
	p, err := New(Config{Brokers: []string{"127.0.0.1:1"}, Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	if p.cfg.Topic != taskevent.DefaultTopic || p.cfg.Group != "converge-projector" {
		t.Errorf("defaults: topic %q group %q", p.cfg.Topic, p.cfg.Group)
	}
}
