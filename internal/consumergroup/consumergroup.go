// Package consumergroup is converge's one Kafka consumer-group engine: the
// worker, the projector and the reconciler's dead-letter intake are its
// handlers. It owns the rules every one of them must follow, once:
//
//   - Per-partition order: the records of a partition are handed to its own
//     goroutine (started on the partition's first records), in offset order,
//     one batch at a time: what the polls queued for the partition, up to
//     MaxPollRecords records (at least one poll's share); a slow
//     partition does not hold up the others, and the poll loop never waits
//     for a partition. When a partition's queue reaches 2 × MaxPollRecords
//     records its fetching is paused (the client drops what it buffered and
//     fetches again from the same offset) until the queue is below
//     MaxPollRecords.
//   - Durable offsets only: after each batch the engine marks the offset
//     after the last record the handler reports durable (its outcome's
//     transaction committed), and one committer commits the marked offsets
//     synchronously, one commit at a time. An offset is never committed
//     before its record's outcome is durable (DESIGN.md, Pitfalls).
//   - Rebalances: they are blocked only while a poll is handed out
//     (BlockRebalanceOnPoll). On revoke the partitions' goroutines are
//     stopped — each finishes the record in process — then the marked
//     offsets are committed and forgotten (franz-go: with manual commits,
//     commit in OnPartitionsRevoked); on loss they are stopped and forgotten
//     (committing is not possible). No record of a partition is processed
//     after the member gave it up, and a commit never covers a partition the
//     member no longer owns. Records still queued are dropped; the next owner
//     fetches them again from the committed offset.
//   - Shutdown: when ctx is cancelled the goroutines finish their record in
//     process, what is durable is committed, and the member leaves the
//     group.
//
// Delivery is at-least-once: a handler must make repeated records harmless
// (the worker's inbox, the projector's version guard, the intake's unique
// origin offset).
//
// franz-go's logs go to Config.Logger (internal/kafkalog).
package consumergroup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/converge-run/converge/internal/kafkalog"
)

// Batch is records of one partition, in offset order, handed to the Handler:
// what the polls queued for the partition, up to MaxPollRecords (at least
// one poll's share).
type Batch struct {
	// Client is the group's client (for producing, e.g. to a dead-letter
	// topic).
	Client    *kgo.Client
	Topic     string
	Partition int32
	// Records are in offset order.
	Records []*kgo.Record
}

// Handler processes the batches of the partitions assigned to this member.
type Handler interface {
	// Handle processes b.Records in order and returns how many of them,
	// from the first, have durable outcomes: their offsets may be
	// committed. It returns fewer than len(b.Records) only when ctx was
	// cancelled (the partition was revoked or lost, or the consumer stops);
	// the records after them are fetched again (by this member or the
	// partition's next owner). Handle is never called concurrently for one
	// partition; it is for different partitions.
	Handle(ctx context.Context, b Batch) int
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, b Batch) int

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, b Batch) int { return f(ctx, b) }

// Defaults of Config.
const (
	DefaultMaxPollRecords    = 500
	DefaultSessionTimeout    = 10 * time.Second
	DefaultHeartbeatInterval = time.Second
	DefaultRebalanceTimeout  = 30 * time.Second
	DefaultCommitTimeout     = 10 * time.Second
	DefaultCommitInterval    = 100 * time.Millisecond
	DefaultFetchMaxWait      = 250 * time.Millisecond
)

// Config configures a consumer. Zero values take the defaults noted.
type Config struct {
	// Brokers are the Kafka bootstrap addresses. Required.
	Brokers []string
	// Group is the consumer group. Required.
	Group string
	// Topics are consumed. Required.
	Topics []string
	// ClientID is the Kafka client id. Defaults to franz-go's ("kgo");
	// converge's consumers pass clientid.Process.
	ClientID string
	// Logger receives the engine's and franz-go's logs (kslog). Defaults to
	// slog.Default().
	Logger *slog.Logger
	// MaxPollRecords bounds the records of one poll and of one Batch (a
	// partition's queued polls are joined up to it; a batch is never less
	// than one poll's share). Defaults to 500.
	MaxPollRecords int
	// SessionTimeout is how long the group coordinator waits for a
	// heartbeat before it removes a member (a crashed process): the time
	// after which another member takes over the partitions of a member
	// that died. Shorter converges faster after a crash; longer tolerates
	// longer pauses (GC, a starved CPU, a network blip). Defaults to 10s
	// (franz-go's default is 45s), which real brokers accept at their
	// default group.min.session.timeout.ms (6s).
	SessionTimeout time.Duration
	// HeartbeatInterval is how often the member heartbeats; it must be
	// well below SessionTimeout. Defaults to 1s.
	HeartbeatInterval time.Duration
	// RebalanceTimeout bounds how long the coordinator waits for every
	// member to rejoin during a rebalance; a member's revoke (its goroutines
	// finishing their record in process, then a commit) must fit in it, or
	// the member is removed and rejoins (its records are processed again,
	// harmlessly). Defaults to 30s.
	RebalanceTimeout time.Duration
	// CommitInterval is the least time between two commits of durable
	// offsets while partitions are processed (revoke and shutdown commit at
	// once). Offsets marked meanwhile join the next commit, so a busy member
	// commits about 1/CommitInterval times per second instead of once per
	// batch; a crash then delivers again at most the records of one interval,
	// which the handlers' deduplication absorbs (seed section 6: at-least-once
	// delivery, an inbox per consumer). Each commit is a broker request and,
	// on a broker that syncs its group log (the embedded one), an fsync.
	// Defaults to 100ms; negative commits after every batch.
	CommitInterval time.Duration
	// FetchMaxWait is how long the broker may hold a fetch that finds no
	// new records (kgo.FetchMaxWait, Kafka's fetch.max.wait.ms). The client
	// has one fetch in flight per broker and a partition whose fetching is
	// resumed (its queue drained, see the package doc) joins the next one,
	// so while the other partitions have nothing new, a resumed partition
	// waits for the held fetch to end: up to franz-go's default of 5s (the
	// worker stage of make bench stalled 4.1s of its 8.1s on one such
	// resume; BENCHMARKS.md, session of 2026-12-06, second). Shorter costs
	// an idle member one fetch request per FetchMaxWait. Defaults to 250ms.
	FetchMaxWait time.Duration
	// ResetOffset is where a partition without a committed offset starts.
	// Defaults to the start of the partition.
	ResetOffset *kgo.Offset
	// BeforeMark, when set, runs after a batch's outcomes are durable and
	// before their offset is marked for commit. An error forgets the mark:
	// a lost acknowledgement (the records come again after a restart or a
	// rebalance, unless a later batch of the partition is committed first).
	// Fault injection uses it (fault.WorkerBeforeOffsetCommit).
	BeforeMark func(ctx context.Context) error
	// KafkaOpts are appended to the client options the engine sets (seed
	// brokers, client id, group, topics, manual commits,
	// BlockRebalanceOnPoll, revoke and lost callbacks, timeouts, logger);
	// use them for TLS, SASL or metrics (kprom). Defaults to none.
	KafkaOpts []kgo.Opt
}

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxPollRecords <= 0 {
		c.MaxPollRecords = DefaultMaxPollRecords
	}
	if c.SessionTimeout <= 0 {
		c.SessionTimeout = DefaultSessionTimeout
	}
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.RebalanceTimeout <= 0 {
		c.RebalanceTimeout = DefaultRebalanceTimeout
	}
	if c.FetchMaxWait <= 0 {
		c.FetchMaxWait = DefaultFetchMaxWait
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	if c.ResetOffset == nil {
		o := kgo.NewOffset().AtStart()
		c.ResetOffset = &o
	}
}

// Validate reports a missing or inconsistent field.
func (c *Config) Validate() error {
	switch {
	case len(c.Brokers) == 0:
		return errors.New("consumergroup: Brokers is required")
	case c.Group == "":
		return errors.New("consumergroup: Group is required")
	case len(c.Topics) == 0:
		return errors.New("consumergroup: Topics is required")
	case c.HeartbeatInterval >= c.SessionTimeout:
		return fmt.Errorf("consumergroup: HeartbeatInterval %s must be below SessionTimeout %s", c.HeartbeatInterval, c.SessionTimeout)
	}
	return nil
}

// Consumer is one member of a consumer group. Create it with New, then Run.
type Consumer struct {
	cfg Config
	h   Handler
	log *slog.Logger

	cl *kgo.Client

	pmu   sync.Mutex
	parts map[topicPartition]*partition

	// commitMu orders commits: the snapshot of marked and its commit are
	// one step, so a commit never rewinds one that was taken later.
	commitMu sync.Mutex
	mu       sync.Mutex
	marked   map[string]map[int32]kgo.EpochOffset
	kick     chan struct{} // asks the committer for a commit (capacity 1)
}

type topicPartition struct {
	topic     string
	partition int32
}

// partition is the goroutine processing one partition's batches in order,
// and its queue.
type partition struct {
	tp     topicPartition
	cancel context.CancelFunc
	done   chan struct{}
	wake   chan struct{} // a batch was queued (capacity 1)

	mu      sync.Mutex
	batches [][]*kgo.Record
	queued  int  // records in batches
	paused  bool // fetching of the partition is paused (the queue is full)
}

// New validates cfg and creates the member's Kafka client (it connects on
// first use).
func New(cfg Config, h Handler) (*Consumer, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Consumer{cfg: cfg, h: h, log: cfg.Logger.With(slog.String("group", cfg.Group)),
		parts: map[topicPartition]*partition{}, marked: map[string]map[int32]kgo.EpochOffset{}, kick: make(chan struct{}, 1)}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Topics...),
		kgo.ConsumeResetOffset(*cfg.ResetOffset),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(c.onRevoked),
		kgo.OnPartitionsLost(c.onLost),
		kgo.SessionTimeout(cfg.SessionTimeout),
		kgo.HeartbeatInterval(cfg.HeartbeatInterval),
		kgo.RebalanceTimeout(cfg.RebalanceTimeout),
		kgo.FetchMaxWait(cfg.FetchMaxWait),
		kgo.WithLogger(kafkalog.New(cfg.Logger)),
	}
	if cfg.ClientID != "" {
		opts = append(opts, kgo.ClientID(cfg.ClientID))
	}
	cl, err := kgo.NewClient(append(opts, cfg.KafkaOpts...)...)
	if err != nil {
		return nil, fmt.Errorf("consumergroup %s: create kafka client: %w", cfg.Group, err)
	}
	c.cl = cl
	return c, nil
}

// Client returns the member's Kafka client (for producing, or for admin
// requests before Run).
func (c *Consumer) Client() *kgo.Client { return c.cl }

// Run joins the group and hands batches to the handler until ctx is
// cancelled; then it lets the batches in process finish, commits the offsets
// of every record whose outcome is durable, leaves the group, closes the
// client and returns nil. Run must be called once.
func (c *Consumer) Run(ctx context.Context) error {
	stopCommitter := make(chan struct{})
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		c.committer(ctx, stopCommitter)
	}()
	for {
		fetches := c.cl.PollRecords(ctx, c.cfg.MaxPollRecords)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			break
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			c.log.WarnContext(ctx, "fetch error", slog.String("topic", topic), slog.Int("partition", int(partition)), slog.Any("err", err))
		})
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				c.dispatch(ctx, p.Topic, p.Partition, p.Records)
			}
		})
		c.cl.AllowRebalance()
	}
	// The revoke callback of the leave commits again (a no-op once marked
	// is empty).
	c.stopPartitions(nil)
	close(stopCommitter)
	<-committerDone
	c.commit(ctx, "shutdown")
	c.cl.AllowRebalance()
	c.cl.Close()
	return nil
}

// dispatch queues a partition's records of a poll for its goroutine,
// starting it on the partition's first records. It never waits (see the
// package doc for pausing). It runs between PollRecords and AllowRebalance,
// when the partition is owned.
func (c *Consumer) dispatch(ctx context.Context, topic string, part int32, recs []*kgo.Record) {
	k := topicPartition{topic, part}
	c.pmu.Lock()
	p := c.parts[k]
	if p == nil {
		pctx, cancel := context.WithCancel(ctx)
		p = &partition{tp: k, cancel: cancel, done: make(chan struct{}), wake: make(chan struct{}, 1)}
		c.parts[k] = p
		go c.runPartition(pctx, p)
	}
	c.pmu.Unlock()
	p.mu.Lock()
	p.batches = append(p.batches, recs)
	p.queued += len(recs)
	if !p.paused && p.queued >= 2*c.cfg.MaxPollRecords {
		p.paused = true
		c.cl.PauseFetchPartitions(map[string][]int32{topic: {part}})
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// next takes the partition's oldest queued poll's records and those of the
// polls queued after it, in order, while they fit in MaxPollRecords (nil
// when nothing is queued), and resumes fetching the partition when the
// queue got short again. A handler that fell behind thus gets its backlog
// in one batch, not one poll's few records at a time: under a steady
// trickle every poll brings a few records, and the worker's fixed cost per
// batch (two transactions, their commits and the artifact fsyncs) kept it
// behind at 607 of 750 tasks/s with batches of 2 (BENCHMARKS.md, session of
// 2026-12-06, second).
func (c *Consumer) next(p *partition) []*kgo.Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.batches) == 0 {
		return nil
	}
	k, n := 1, len(p.batches[0])
	for k < len(p.batches) && n+len(p.batches[k]) <= c.cfg.MaxPollRecords {
		n += len(p.batches[k])
		k++
	}
	recs := p.batches[0]
	if k > 1 {
		recs = make([]*kgo.Record, 0, n)
		for _, b := range p.batches[:k] {
			recs = append(recs, b...)
		}
	}
	clear(p.batches[:k])
	p.batches = p.batches[k:]
	p.queued -= len(recs)
	if p.paused && p.queued < c.cfg.MaxPollRecords {
		c.resumeLocked(p)
	}
	return recs
}

func (c *Consumer) resumeLocked(p *partition) {
	p.paused = false
	c.cl.ResumeFetchPartitions(map[string][]int32{p.tp.topic: {p.tp.partition}})
}

// runPartition hands the partition's batches to the handler in order until
// ctx is cancelled (revoke, loss, shutdown); after each batch it marks the
// offset after the last durable record and asks for a commit.
func (c *Consumer) runPartition(ctx context.Context, p *partition) {
	defer close(p.done)
	for {
		recs := c.next(p)
		if recs == nil {
			select {
			case <-ctx.Done():
				return
			case <-p.wake:
				continue
			}
		}
		n := 0
		if ctx.Err() == nil {
			n = c.h.Handle(ctx, Batch{Client: c.cl, Topic: p.tp.topic, Partition: p.tp.partition, Records: recs})
		}
		if n > 0 {
			c.markDurable(ctx, recs[min(n, len(recs))-1])
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// markDurable records that the outcomes of a partition's records up to r
// are durable and asks the committer for a commit.
func (c *Consumer) markDurable(ctx context.Context, r *kgo.Record) {
	if c.cfg.BeforeMark != nil {
		if err := c.cfg.BeforeMark(ctx); err != nil {
			c.log.WarnContext(ctx, "offset commit skipped", slog.Any("err", err))
			return
		}
	}
	c.mu.Lock()
	if c.marked[r.Topic] == nil {
		c.marked[r.Topic] = map[int32]kgo.EpochOffset{}
	}
	c.marked[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
	c.mu.Unlock()
	select {
	case c.kick <- struct{}{}:
	default: // a commit is already requested; it will include this offset
	}
}

// committer commits the marked offsets whenever a partition asks, one
// commit at a time, until stop is closed.
func (c *Consumer) committer(ctx context.Context, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-c.kick:
			c.commit(ctx, "batch")
		}
		if c.cfg.CommitInterval > 0 {
			t := time.NewTimer(c.cfg.CommitInterval)
			select {
			case <-stop:
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

// stopPartitions cancels the goroutines of parts (all when parts is nil)
// and waits until they have returned: a batch in process finishes its
// record in process and is marked when its outcomes are durable.
func (c *Consumer) stopPartitions(parts map[string][]int32) {
	var stopped []*partition
	c.pmu.Lock()
	for k, p := range c.parts {
		if parts != nil && !slices.Contains(parts[k.topic], k.partition) {
			continue
		}
		p.cancel()
		stopped = append(stopped, p)
		delete(c.parts, k)
	}
	c.pmu.Unlock()
	for _, p := range stopped {
		<-p.done
		// Its queued records are dropped; a paused partition is resumed so
		// that it is fetched again if it comes back to this member.
		p.mu.Lock()
		if p.paused {
			c.resumeLocked(p)
		}
		p.batches, p.queued = nil, 0
		p.mu.Unlock()
	}
}

// commit commits the marked offsets synchronously and forgets those that
// were committed. A failed commit keeps them for the next attempt.
func (c *Consumer) commit(ctx context.Context, why string) {
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	offs := map[string]map[int32]kgo.EpochOffset{}
	for t, ps := range c.marked {
		for p, o := range ps {
			if offs[t] == nil {
				offs[t] = map[int32]kgo.EpochOffset{}
			}
			offs[t][p] = o
		}
	}
	c.mu.Unlock()
	if len(offs) == 0 {
		return
	}
	// The outcomes are durable: commit them even when ctx was just
	// cancelled (shutdown), bounded by its own deadline.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultCommitTimeout)
	defer cancel()
	var cerr error
	c.cl.CommitOffsetsSync(cctx, offs, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		cerr = CommitError(resp, err)
	})
	if cerr != nil {
		c.log.WarnContext(ctx, "offset commit failed (the records will be processed again)", slog.String("why", why), slog.Any("err", cerr))
		return
	}
	c.mu.Lock()
	for t, ps := range offs {
		for p, o := range ps {
			if cur, ok := c.marked[t][p]; ok && cur == o {
				delete(c.marked[t], p)
			}
		}
	}
	c.mu.Unlock()
}

// onRevoked stops the revoked partitions' goroutines (each finishes the
// record in process), commits before the partitions move to another member,
// then forgets them.
func (c *Consumer) onRevoked(ctx context.Context, _ *kgo.Client, revoked map[string][]int32) {
	c.stopPartitions(revoked)
	c.commit(ctx, "revoke")
	c.forget(revoked)
}

// onLost stops the lost partitions' goroutines and forgets their offsets:
// committing them is not possible.
func (c *Consumer) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	c.stopPartitions(lost)
	c.forget(lost)
}

func (c *Consumer) forget(parts map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, ps := range parts {
		for _, p := range ps {
			delete(c.marked[t], p)
		}
	}
}

// CommitError returns the request error or the first partition error of an
// offset commit response.
func CommitError(resp *kmsg.OffsetCommitResponse, err error) error {
	if err != nil {
		return err
	}
	if resp == nil {
		return nil
	}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if perr := kerr.ErrorForCode(p.ErrorCode); perr != nil {
				return fmt.Errorf("commit %s[%d]: %w", t.Topic, p.Partition, perr)
			}
		}
	}
	return nil
}
