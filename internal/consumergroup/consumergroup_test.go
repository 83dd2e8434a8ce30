package consumergroup_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/converge-run/converge/internal/consumergroup"
	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// committed reads the group's committed offsets of the topic.
func committed(t *testing.T, k *testenv.Kafka, group string) map[int32]int64 {
	t.Helper()
	adm := kadm.NewClient(k.Client(t))
	offs, err := adm.FetchOffsets(context.Background(), group)
	if err != nil {
		return nil // the group does not exist yet
	}
	out := map[int32]int64{}
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Topic == k.Topic && o.Err == nil {
			out[o.Partition] = o.At
		}
	})
	return out
}

func produce(t *testing.T, k *testenv.Kafka, n int) {
	t.Helper()
	cl := k.Client(t, kgo.DefaultProduceTopic(k.Topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for i := range n {
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Partition: int32(i % testenv.Partitions), Value: []byte{byte(i)}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// run starts a member with cfg and h; stop cancels it and fails the test
// when Run returns an error.
func run(t *testing.T, cfg consumergroup.Config, h consumergroup.Handler) (stop func()) {
	t.Helper()
	c, err := consumergroup.New(cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	return func() {
		t.Helper()
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// Only offsets of records the handler reports durable are committed: a
// handler that makes only the first record of each batch durable, then
// stops, leaves the committed offset right after that record.
func TestCommitsOnlyDurableOffsets(t *testing.T) {
	t.Parallel()
	k := testenv.NewKafka(t)
	produce(t, k, 4*testenv.Partitions)
	var handled atomic.Int64
	h := consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		handled.Add(int64(len(b.Records)))
		<-ctx.Done() // processing of the rest never finishes
		return 1
	})
	stop := run(t, consumergroup.Config{Brokers: k.Brokers, Group: "g-durable", Topics: []string{k.Topic}}, h)
	testenv.Eventually(t, 20*time.Second, "every record handed out", func() bool { return handled.Load() == 4*testenv.Partitions })
	stop()
	got := committed(t, k, "g-durable")
	for p := int32(0); p < testenv.Partitions; p++ {
		if got[p] != 1 {
			t.Errorf("partition %d committed at %d, want 1 (after the only durable record)", p, got[p])
		}
	}
}

// Records of one partition reach the handler in order, never two batches of
// a partition at once, and a second member joining takes over partitions
// after the first commits them: every record is handled, and each partition
// ends committed at its end.
func TestOrderAndRebalance(t *testing.T) {
	t.Parallel()
	k := testenv.NewKafka(t)
	produce(t, k, 40*testenv.Partitions)
	var mu sync.Mutex
	last := map[int32]int64{}
	inFlight := map[int32]bool{}
	total := atomic.Int64{}
	h := consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		mu.Lock()
		if inFlight[b.Partition] {
			t.Errorf("partition %d handled twice at once", b.Partition)
		}
		inFlight[b.Partition] = true
		mu.Unlock()
		for _, r := range b.Records {
			mu.Lock()
			// Within a batch, offsets increase (a redelivery after a
			// rebalance starts a new batch at the committed offset).
			if prev, ok := last[r.Partition]; ok && r != b.Records[0] && r.Offset <= prev {
				t.Errorf("partition %d: offset %d after %d in one batch", r.Partition, r.Offset, prev)
			}
			last[r.Partition] = r.Offset
			mu.Unlock()
			time.Sleep(time.Millisecond)
		}
		mu.Lock()
		inFlight[b.Partition] = false
		mu.Unlock()
		total.Add(int64(len(b.Records)))
		return len(b.Records)
	})
	start := func() (context.CancelFunc, chan error) {
		c, err := consumergroup.New(consumergroup.Config{Brokers: k.Brokers, Group: "g-order", Topics: []string{k.Topic}}, h)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		return cancel, done
	}
	cancel1, done1 := start()
	cancel2, done2 := start()
	testenv.Eventually(t, 30*time.Second, "every partition committed at its end", func() bool {
		got := committed(t, k, "g-order")
		for p := int32(0); p < testenv.Partitions; p++ {
			if got[p] != 40 {
				return false
			}
		}
		return true
	})
	cancel1()
	cancel2()
	if err := <-done1; err != nil {
		t.Fatal(err)
	}
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
	if total.Load() < 40*testenv.Partitions {
		t.Fatalf("%d records handled, want at least %d", total.Load(), 40*testenv.Partitions)
	}
}

// While partitions are processed, commits are at least CommitInterval
// apart: offsets marked meanwhile join the next commit, and the last one is
// committed at shutdown.
func TestCommitInterval(t *testing.T) {
	t.Parallel()
	k := testenv.NewKafka(t)
	const n = 120
	produce(t, k, n)
	var commits atomic.Int64
	k.Cluster.ControlKey(int16(kmsg.OffsetCommit), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		commits.Add(1)
		return nil, nil, false
	})
	var batches, handled atomic.Int64
	h := consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		batches.Add(1)
		time.Sleep(5 * time.Millisecond)
		handled.Add(int64(len(b.Records)))
		return len(b.Records)
	})
	start := time.Now()
	stop := run(t, consumergroup.Config{Brokers: k.Brokers, Group: "g-interval", Topics: []string{k.Topic},
		MaxPollRecords: 1, CommitInterval: 250 * time.Millisecond}, h)
	testenv.Eventually(t, 20*time.Second, "every record handled", func() bool { return handled.Load() == n })
	elapsed := time.Since(start)
	stop()
	// One commit per started interval, plus the shutdown's and revoke's.
	if limit := int64(elapsed/(250*time.Millisecond)) + 3; commits.Load() > limit || commits.Load() >= batches.Load() {
		t.Errorf("%d commits for %d batches in %v, want at most %d", commits.Load(), batches.Load(), elapsed, limit)
	}
	got := committed(t, k, "g-interval")
	sum := int64(0)
	for _, o := range got {
		sum += o
	}
	if sum != n {
		t.Errorf("committed offsets %v sum to %d, want %d", got, sum, n)
	}
}

// Fetches ask the broker to hold them at most FetchMaxWait (250ms by
// default, not franz-go's 5s): a partition resumed after its queue drained
// joins the next fetch only, and while the other partitions have nothing
// new the fetch in flight is held that long (the worker stage of make
// bench stalled 4.1s of 8.1s on one resume; BENCHMARKS.md).
func TestFetchesAreHeldAtMostFetchMaxWait(t *testing.T) {
	t.Parallel()
	k := testenv.NewKafka(t)
	produce(t, k, 2*testenv.Partitions)
	var fetches, longest atomic.Int64
	k.Cluster.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		fetches.Add(1)
		if w := int64(req.(*kmsg.FetchRequest).MaxWaitMillis); w > longest.Load() {
			longest.Store(w)
		}
		return nil, nil, false
	})
	var handled atomic.Int64
	h := consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		handled.Add(int64(len(b.Records)))
		return len(b.Records)
	})
	stop := run(t, consumergroup.Config{Brokers: k.Brokers, Group: "g-fetch-wait", Topics: []string{k.Topic}}, h)
	testenv.Eventually(t, 20*time.Second, "every record handled and an idle fetch sent", func() bool {
		return handled.Load() == 2*testenv.Partitions && fetches.Load() >= 2
	})
	stop()
	if got, want := longest.Load(), consumergroup.DefaultFetchMaxWait.Milliseconds(); got != want {
		t.Errorf("fetches held up to %dms, want %dms", got, want)
	}
}
