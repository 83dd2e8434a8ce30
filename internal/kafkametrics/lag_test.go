package kafkametrics

import (
	"context"
	"log/slog"
	"math"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/testenv"
)

type testBundle struct {
	kafka *testenv.Kafka
	cl    *kgo.Client
	reg   *prometheus.Registry
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	k := testenv.NewKafka(t)
	return &testBundle{kafka: k, cl: k.Client(t), reg: prometheus.NewRegistry()}
}

// start runs a sampler of cfg (brokers, registry, short interval filled
// in) until the test ends.
func (b *testBundle) start(t *testing.T, cfg LagConfig) *LagSampler {
	t.Helper()
	cfg.Brokers = b.kafka.Brokers
	cfg.Registerer = b.reg
	cfg.Interval = 20 * time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	s, err := NewLagSampler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	})
	return s
}

// produce writes one record per key (keys spread over partitions) with the
// given timestamp and returns how many went to each partition.
func (b *testBundle) produce(t *testing.T, n int, ts time.Time) map[int32]int64 {
	t.Helper()
	per := map[int32]int64{}
	for i := range n {
		r := &kgo.Record{Topic: b.kafka.Topic, Key: []byte("k" + strconv.Itoa(i)), Value: []byte("v"), Timestamp: ts}
		res := b.cl.ProduceSync(context.Background(), r)
		if err := res.FirstErr(); err != nil {
			t.Fatal(err)
		}
		per[res[0].Record.Partition]++
	}
	return per
}

// fresh waits for a sample started after the call and returns it by
// partition for group.
func fresh(t *testing.T, s *LagSampler, group, topic string) map[int32]PartitionLag {
	t.Helper()
	n := s.Samples()
	testenv.Eventually(t, 10*time.Second, "a new lag sample", func() bool { return s.Samples() >= n+2 })
	parts, _ := s.Last()
	out := map[int32]PartitionLag{}
	for _, pl := range parts {
		if pl.Group == group && pl.Topic == topic {
			out[pl.Partition] = pl
		}
	}
	return out
}

func gauge(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metrics
				}
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

func TestLagGrowsWhileNobodyConsumesAndDropsAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const group = "g-stopped"
	s := b.start(t, LagConfig{Groups: []Group{{Name: group, Topics: []string{b.kafka.Topic}}}})

	// Nothing produced: every partition is listed with lag 0.
	parts := fresh(t, s, group, b.kafka.Topic)
	if len(parts) != testenv.Partitions {
		t.Fatalf("%d partitions sampled, want %d", len(parts), testenv.Partitions)
	}
	for p, pl := range parts {
		if pl.Lag != 0 || pl.LagSeconds != 0 || pl.Committed != -1 {
			t.Fatalf("partition %d before any record: %+v", p, pl)
		}
	}

	// Records an hour old, no consumer: lag counts them from the log start
	// (no commit yet) and their age is about an hour.
	old := time.Now().Add(-time.Hour)
	per := b.produce(t, 20, old)
	parts = fresh(t, s, group, b.kafka.Topic)
	for p, pl := range parts {
		if pl.Lag != per[p] {
			t.Fatalf("partition %d: lag %d, want %d", p, pl.Lag, per[p])
		}
		if pl.Lag > 0 && (math.IsNaN(pl.LagSeconds) || pl.LagSeconds < 3599 || pl.LagSeconds > 3700) {
			t.Fatalf("partition %d: lag %v s, want about 3600", p, pl.LagSeconds)
		}
		v, ok := gauge(t, b.reg, "converge_kafka_consumergroup_lag",
			map[string]string{"consumergroup": group, "topic": b.kafka.Topic, "partition": strconv.Itoa(int(p))})
		if !ok || v != float64(pl.Lag) {
			t.Fatalf("gauge for partition %d = %v (present %v), want %d", p, v, ok, pl.Lag)
		}
	}

	// A consumer of the group reads everything and commits: lag 0.
	cons := b.kafka.Client(t, kgo.ConsumerGroup(group), kgo.ConsumeTopics(b.kafka.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for got := 0; got < 20; {
		fs := cons.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatal("consume: ", ctx.Err())
		}
		got += fs.NumRecords()
	}
	if err := cons.CommitUncommittedOffsets(ctx); err != nil {
		t.Fatal(err)
	}
	parts = fresh(t, s, group, b.kafka.Topic)
	for p, pl := range parts {
		if pl.Lag != 0 || pl.LagSeconds != 0 || pl.Committed != per[p] {
			t.Fatalf("partition %d after the commit: %+v, want lag 0 at offset %d", p, pl, per[p])
		}
	}

	// The consumer stops (no more polls): new records make the lag grow
	// again, counted from the committed offsets.
	per2 := b.produce(t, 12, time.Now().Add(-time.Minute))
	parts = fresh(t, s, group, b.kafka.Topic)
	for p, pl := range parts {
		if pl.Lag != per2[p] {
			t.Fatalf("partition %d: lag %d after the consumer stopped, want %d", p, pl.Lag, per2[p])
		}
		if pl.Lag > 0 && (pl.LagSeconds < 59 || pl.LagSeconds > 200) {
			t.Fatalf("partition %d: lag %v s, want about 60", p, pl.LagSeconds)
		}
	}
	if _, ok := gauge(t, b.reg, "converge_kafka_consumergroup_lag_sample_timestamp_seconds", nil); !ok {
		t.Fatal("no sample timestamp exported")
	}
}

func TestLagAllGroupsFindsCommittedGroups(t *testing.T) {
	t.Parallel()
	b := setup(t)
	per := b.produce(t, 8, time.Now())
	adm := kadm.NewClient(b.cl)
	var p0 int32 = -1
	for p, n := range per {
		if n > 0 {
			p0 = p
			break
		}
	}
	offs := kadm.Offsets{}
	offs.Add(kadm.Offset{Topic: b.kafka.Topic, Partition: p0, At: 0, LeaderEpoch: -1})
	if err := adm.CommitAllOffsets(context.Background(), "g-unconfigured", offs); err != nil {
		t.Fatal(err)
	}
	s := b.start(t, LagConfig{AllGroups: true})
	parts := fresh(t, s, "g-unconfigured", b.kafka.Topic)
	pl, ok := parts[p0]
	if !ok || pl.Lag != per[p0] || pl.Committed != 0 {
		t.Fatalf("g-unconfigured partition %d: %+v (found %v), want lag %d from offset 0", p0, pl, ok, per[p0])
	}
}

func TestLagConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  LagConfig
		ok   bool
	}{
		{"groups", LagConfig{Brokers: []string{"b:9092"}, Groups: []Group{{Name: "g", Topics: []string{"t"}}}}, true},
		{"all groups", LagConfig{Brokers: []string{"b:9092"}, AllGroups: true}, true},
		{"no brokers", LagConfig{AllGroups: true}, false},
		{"nothing to sample", LagConfig{Brokers: []string{"b:9092"}}, false},
		{"group without topics", LagConfig{Brokers: []string{"b:9092"}, Groups: []Group{{Name: "g"}}}, false},
		{"negative interval", LagConfig{Brokers: []string{"b:9092"}, AllGroups: true, Interval: -time.Second}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := NewLagSampler(tc.cfg)
			if (err == nil) != tc.ok {
				t.Fatalf("NewLagSampler = %v, want ok %v", err, tc.ok)
			}
		})
	}
}

func TestClientMetricsSeveralClientsOneRegistry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	relay := b.kafka.Client(t, ClientMetrics(reg, "relay"))
	worker := b.kafka.Client(t, ClientMetrics(reg, "worker"))
	if err := relay.ProduceSync(context.Background(), &kgo.Record{Topic: b.kafka.Topic, Value: []byte("x")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := worker.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	components := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() != "converge_kafka_client_connects_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "component" {
					components[l.GetValue()] = true
				}
			}
		}
	}
	if !components["relay"] || !components["worker"] {
		t.Fatalf("converge_kafka_client_connects_total components %v, want relay and worker", components)
	}
	// A component may create its client again after closing the first.
	relay.Close()
	again := b.kafka.Client(t, ClientMetrics(reg, "relay"))
	if err := again.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
}
