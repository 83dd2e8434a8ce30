package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/taskevent"
)

// DefaultGroup is the consumer group (and inbox consumer_name) of the worker.
const DefaultGroup = "converge-worker"

// Outcomes of one record, the outcome label of
// converge_worker_messages_total.
const (
	// OutcomeProcessed: the task completed through this delivery.
	OutcomeProcessed = "processed"
	// OutcomeDuplicate: the message id was already handled with the same
	// payload hash, or the task was already terminal (seed 6, 13.3, 14).
	OutcomeDuplicate = "duplicate"
	// OutcomeConflict: the message id was handled with another payload hash;
	// an inbox_conflict row was written and the record not processed (seed
	// 13.4).
	OutcomeConflict = "conflict"
	// OutcomeIgnored: not a TaskCreated event (the worker's own
	// TaskCompleted/TaskFailed events share the topic).
	OutcomeIgnored = "ignored"
	// OutcomeFailed: the delivery ended in a durable failure: the task
	// failed (artifact verification, transform error) or a deterministic
	// record error (undecodable value, hash mismatch, unknown task, ...) was
	// recorded and the record skipped.
	OutcomeFailed = "failed"
	// OutcomeRetried: one attempt failed with a retryable error and the
	// record is retried in place after a backoff.
	OutcomeRetried = "retried"
	// OutcomeDeadLettered: the record failed deterministically, or with
	// retryable errors MaxAttempts times, and was parked on the dead-letter
	// topic (seed 13.5).
	OutcomeDeadLettered = "dead_lettered"
)

// DefaultProcessorVersion identifies this processing code in dead letters
// (header dlq-processor-version); a fix that changes how records are
// processed bumps it.
const DefaultProcessorVersion = "converge-worker/2"

// Config configures a Worker. Zero values take the defaults noted.
type Config struct {
	// DatabaseURL of PostgreSQL, used when Pool is nil; the worker then owns
	// the pool and closes it when Run returns. One of DatabaseURL and Pool
	// is required.
	DatabaseURL string
	// Pool to use; the worker does not close it.
	Pool *pgxpool.Pool
	// Brokers are the Kafka bootstrap addresses. Required.
	Brokers []string
	// Topic of the task events. Defaults to taskevent.DefaultTopic.
	Topic string
	// Group is the consumer group and the inbox consumer_name (seed 6).
	// Defaults to DefaultGroup ("converge-worker").
	Group string
	// ArtifactStore receives the artifacts. Required.
	ArtifactStore *artifact.Store
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the converge_worker_* metrics. Defaults to a new
	// prometheus.NewRegistry() (metrics then go nowhere).
	Registerer prometheus.Registerer
	// Faults are the armed fault points (fault.WorkerAfterArtifactWrite,
	// fault.WorkerBeforeOffsetCommit). Defaults to nil: none.
	Faults *fault.Set
	// KafkaOpts are appended to the client options the worker sets (seed
	// brokers, group, topic, manual commits, BlockRebalanceOnPoll, revoke
	// and lost callbacks); use them for TLS, SASL or timeouts. Defaults to
	// none.
	KafkaOpts []kgo.Opt
	// Concurrency is how many records (of different partitions) are
	// processed at once; records of one partition are always processed in
	// order, one at a time. Defaults to 4.
	Concurrency int
	// MaxPollRecords bounds the records of one poll; a partition's share of
	// a poll is one batch of its goroutine (one offset mark).
	// Defaults to 500.
	MaxPollRecords int
	// RetryBackoffMin is the first delay before a record that failed with a
	// retryable error is retried in place; each further attempt doubles it,
	// up to RetryBackoffMax, with jitter (a uniform draw in [d/2, d]).
	// Defaults to 100ms.
	RetryBackoffMin time.Duration
	// RetryBackoffMax caps the retry delay. Defaults to 10s.
	RetryBackoffMax time.Duration
	// MaxAttempts bounds the attempts on a record that fails with retryable
	// errors; after the last one the record is dead-lettered (class
	// retryable, code RETRIES_EXHAUSTED). With the default backoff, 10
	// attempts span about 30s: an outage of PostgreSQL or the store longer
	// than that dead-letters the records that meet it, and `converge dlq
	// replay` brings them back. Defaults to 10.
	MaxAttempts int
	// DeadLetterTopic receives the parked records. Defaults to Topic +
	// ".dlq"; created (DeadLetterPartitions partitions) when missing.
	DeadLetterTopic string
	// DeadLetterPartitions is the partition count used when the worker
	// creates DeadLetterTopic. Defaults to 1.
	DeadLetterPartitions int32
	// ProcessorVersion is written in header dlq-processor-version.
	// Defaults to DefaultProcessorVersion.
	ProcessorVersion string
	// AttemptTimeout bounds one processing attempt of one record (database
	// statements and store calls). An attempt in flight when Run's context
	// is cancelled runs to its end within this bound. Defaults to 30s.
	AttemptTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.Group == "" {
		c.Group = DefaultGroup
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 4
	}
	if c.MaxPollRecords <= 0 {
		c.MaxPollRecords = 500
	}
	if c.RetryBackoffMin <= 0 {
		c.RetryBackoffMin = 100 * time.Millisecond
	}
	if c.RetryBackoffMax <= 0 {
		c.RetryBackoffMax = 10 * time.Second
	}
	if c.AttemptTimeout <= 0 {
		c.AttemptTimeout = 30 * time.Second
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 10
	}
	if c.DeadLetterTopic == "" {
		c.DeadLetterTopic = taskevent.DeadLetterTopic(c.Topic)
	}
	if c.DeadLetterPartitions <= 0 {
		c.DeadLetterPartitions = 1
	}
	if c.ProcessorVersion == "" {
		c.ProcessorVersion = DefaultProcessorVersion
	}
}

// Validate reports a missing or inconsistent field.
func (c *Config) Validate() error {
	switch {
	case c.Pool == nil && c.DatabaseURL == "":
		return errors.New("worker: one of Pool and DatabaseURL is required")
	case len(c.Brokers) == 0:
		return errors.New("worker: Brokers is required")
	case c.ArtifactStore == nil:
		return errors.New("worker: ArtifactStore is required")
	case c.DeadLetterTopic == c.Topic:
		return fmt.Errorf("worker: DeadLetterTopic must differ from Topic %q", c.Topic)
	case c.RetryBackoffMax < c.RetryBackoffMin:
		return fmt.Errorf("worker: RetryBackoffMax %s is below RetryBackoffMin %s", c.RetryBackoffMax, c.RetryBackoffMin)
	}
	return nil
}

// Worker is the task-events consumer that converts documents (see the
// package doc). Create it with New and start it with Run.
type Worker struct {
	cfg     Config
	log     *slog.Logger
	pool    *pgxpool.Pool
	ownPool bool
	store   *artifact.Store
	faults  *fault.Set
	m       *metrics
}

// New validates cfg and returns a Worker. It registers the worker's metrics
// on cfg.Registerer (an error if they are already registered there) and,
// with DatabaseURL, creates a pool (connections are made on first use).
func New(cfg Config) (*Worker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	w := &Worker{cfg: cfg, log: cfg.Logger, pool: cfg.Pool, store: cfg.ArtifactStore, faults: cfg.Faults, m: m}
	if w.pool, w.ownPool, err = dbpool.Use(w.pool, cfg.DatabaseURL, "worker"); err != nil {
		return nil, err
	}
	return w, nil
}

// Run joins the consumer group and processes records until ctx is
// cancelled. Then it finishes the records in flight (each within
// AttemptTimeout), commits the offsets of every record whose outcome is
// durable, leaves the group and returns nil. It returns an error only when
// the Kafka client cannot be created. Run must not be called twice at once.
func (w *Worker) Run(ctx context.Context) error {
	if w.ownPool {
		defer w.pool.Close()
	}
	c := newConsumer(w)
	opts := []kgo.Opt{
		kgo.SeedBrokers(w.cfg.Brokers...),
		kgo.ConsumerGroup(w.cfg.Group),
		kgo.ConsumeTopics(w.cfg.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(c.onRevoked),
		kgo.OnPartitionsLost(c.onLost),
		kgo.WithLogger(kgoLogger{w.log}),
	}
	cl, err := kgo.NewClient(append(opts, w.cfg.KafkaOpts...)...)
	if err != nil {
		return fmt.Errorf("worker: create kafka client: %w", err)
	}
	c.cl = cl
	ectx, cancel := context.WithTimeout(ctx, 10*time.Second)
	if err := kafkatopic.Ensure(ectx, cl, w.cfg.DeadLetterPartitions, w.cfg.DeadLetterTopic); err != nil {
		w.log.WarnContext(ctx, "dead-letter topic not ensured; producing to it may fail", slog.String("topic", w.cfg.DeadLetterTopic), slog.Any("err", err))
	}
	cancel()
	w.log.InfoContext(ctx, "worker started", slog.String("topic", w.cfg.Topic), slog.String("group", w.cfg.Group))
	stopCommitter := make(chan struct{})
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		c.committer(ctx, stopCommitter)
	}()
	for {
		fetches := cl.PollRecords(ctx, w.cfg.MaxPollRecords)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			break
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			w.log.WarnContext(ctx, "fetch error", slog.String("topic", topic), slog.Int("partition", int(partition)), slog.Any("err", err))
		})
		// Each partition's records go to its own goroutine: the next poll
		// does not wait for the slowest partition of this one.
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				c.dispatch(ctx, p.Topic, p.Partition, p.Records)
			}
		})
		cl.AllowRebalance()
	}
	// Shutdown: let the records in process finish, commit what is durable,
	// then leave the group. The revoke callback of the leave commits again
	// (a no-op once marked is empty).
	c.stopPartitions(nil)
	close(stopCommitter)
	<-committerDone
	c.commit(ctx, "shutdown")
	cl.AllowRebalance()
	cl.Close()
	w.log.Info("worker stopped", slog.String("group", w.cfg.Group))
	return nil
}

// consumer is the state of one Run: the client, a goroutine per assigned
// partition (created on the partition's first records), and the offsets of
// records whose outcome is durable but not yet committed.
type consumer struct {
	w   *Worker
	cl  *kgo.Client
	sem chan struct{} // Concurrency: records in process at once

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

// partition is the goroutine processing one partition's records in order,
// and its queue of polled batches.
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

func newConsumer(w *Worker) *consumer {
	return &consumer{
		w:      w,
		sem:    make(chan struct{}, w.cfg.Concurrency),
		parts:  map[topicPartition]*partition{},
		marked: map[string]map[int32]kgo.EpochOffset{},
		kick:   make(chan struct{}, 1),
	}
}

// dispatch queues the records of one partition of a poll for the
// partition's goroutine, starting it on the partition's first records. It
// never waits: when the partition's queue holds 2 × MaxPollRecords records
// or more, fetching the partition is paused (the client drops what it
// buffered for it and fetches it again after the resume) until its
// goroutine takes the queue below MaxPollRecords. It runs between
// PollRecords and AllowRebalance (BlockRebalanceOnPoll), when the partition
// is owned.
func (c *consumer) dispatch(ctx context.Context, topic string, part int32, recs []*kgo.Record) {
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
	if !p.paused && p.queued >= 2*c.w.cfg.MaxPollRecords {
		p.paused = true
		c.cl.PauseFetchPartitions(map[string][]int32{topic: {part}})
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// next takes the partition's oldest queued batch (nil when there is none)
// and resumes fetching the partition when the queue got short again.
func (c *consumer) next(p *partition) []*kgo.Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.batches) == 0 {
		return nil
	}
	recs := p.batches[0]
	p.batches[0] = nil
	p.batches = p.batches[1:]
	p.queued -= len(recs)
	if p.paused && p.queued < c.w.cfg.MaxPollRecords {
		c.resumeLocked(p)
	}
	return recs
}

func (c *consumer) resumeLocked(p *partition) {
	p.paused = false
	c.cl.ResumeFetchPartitions(map[string][]int32{p.tp.topic: {p.tp.partition}})
}

// runPartition processes the partition's batches in order until ctx is
// cancelled (revoke, loss, shutdown); after each batch it marks the offset
// of the last record whose outcome is durable and asks for a commit.
func (c *consumer) runPartition(ctx context.Context, p *partition) {
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
		last := c.processPartition(ctx, recs)
		if last != nil {
			c.markDurable(ctx, last)
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// processPartition processes records of one partition in order, at most
// Concurrency records of all partitions at once, and returns the last one
// whose outcome is durable (nil if none). It stops early when ctx is
// cancelled.
func (c *consumer) processPartition(ctx context.Context, recs []*kgo.Record) *kgo.Record {
	var last *kgo.Record
	for _, r := range recs {
		select {
		case c.sem <- struct{}{}:
		case <-ctx.Done():
			return last
		}
		ok := ctx.Err() == nil && c.w.processRecord(ctx, c.cl, r)
		<-c.sem
		if !ok {
			return last
		}
		last = r
	}
	return last
}

// markDurable records that the outcomes of a partition's records up to r
// are durable and asks the committer for a commit.
func (c *consumer) markDurable(ctx context.Context, r *kgo.Record) {
	// The outcomes are durable; the offsets are not committed yet. An
	// injected error here is a lost acknowledgement: the offsets are
	// forgotten, so the records come again after a restart or rebalance and
	// must be harmless duplicates (seed 14).
	if err := c.w.faults.Err(fault.WorkerBeforeOffsetCommit); err != nil {
		c.w.log.WarnContext(ctx, "offset commit skipped", slog.Any("err", err))
		return
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
// commit at a time (requests made during a commit are served by one more),
// until stop is closed.
func (c *consumer) committer(ctx context.Context, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-c.kick:
			c.commit(ctx, "batch")
		}
	}
}

// stopPartitions cancels the goroutines of parts (all when parts is nil)
// and waits until they have returned: a record in process finishes its
// attempt (within AttemptTimeout) and is marked when its outcome is durable.
func (c *consumer) stopPartitions(parts map[string][]int32) {
	var stopped []*partition
	c.pmu.Lock()
	for k, p := range c.parts {
		if parts != nil && !containsPartition(parts[k.topic], k.partition) {
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

func containsPartition(ps []int32, p int32) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// commit commits the marked offsets synchronously and forgets those that
// were committed. A failed commit keeps them for the next attempt.
func (c *consumer) commit(ctx context.Context, why string) {
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
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var cerr error
	c.cl.CommitOffsetsSync(cctx, offs, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			cerr = err
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
					cerr = fmt.Errorf("partition %d: %w", p.Partition, err)
				}
			}
		}
	})
	if cerr != nil {
		c.w.log.WarnContext(ctx, "offset commit failed", slog.String("why", why), slog.Any("err", cerr))
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
// record in process), commits before the partitions move to another member
// (franz-go: with manual commits, commit in OnPartitionsRevoked), then
// forgets them.
func (c *consumer) onRevoked(ctx context.Context, _ *kgo.Client, revoked map[string][]int32) {
	c.stopPartitions(revoked)
	c.commit(ctx, "revoke")
	c.forget(revoked)
}

// onLost stops the lost partitions' goroutines and forgets their offsets:
// committing them is not possible.
func (c *consumer) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	c.stopPartitions(lost)
	c.forget(lost)
}

func (c *consumer) forget(parts map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, ps := range parts {
		for _, p := range ps {
			delete(c.marked[t], p)
		}
	}
}

// processRecord handles one record until its outcome is durable, retrying
// retryable errors in place with backoff at most MaxAttempts times, and
// dead-lettering the record after a deterministic error or the last
// attempt. It returns false only when ctx was cancelled before the outcome
// became durable.
func (w *Worker) processRecord(ctx context.Context, cl *kgo.Client, r *kgo.Record) bool {
	start := time.Now()
	log := w.log.With(slog.String("topic", r.Topic), slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset))
	var first time.Time
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		outcome, err := w.handle(actx, r)
		cancel()
		if err != nil {
			now := time.Now()
			if first.IsZero() {
				first = now
			}
			f := failure{class: ClassRetryable, code: CodeRetriesExhausted, err: err, attempts: attempt + 1, first: first, last: now}
			if !Retryable(err) {
				f.class, f.code = ClassDeterministic, ErrorCode(err)
			}
			if f.class == ClassDeterministic || f.attempts >= w.cfg.MaxAttempts {
				if !w.deadLetter(ctx, cl, r, f, log) {
					return false
				}
				w.m.messages.WithLabelValues(OutcomeDeadLettered).Inc()
				w.m.processing.Observe(time.Since(start).Seconds())
				return true
			}
		}
		if err == nil {
			w.m.messages.WithLabelValues(outcome).Inc()
			w.m.processing.Observe(time.Since(start).Seconds())
			log.DebugContext(ctx, "record handled", slog.String("outcome", outcome))
			return true
		}
		w.m.messages.WithLabelValues(OutcomeRetried).Inc()
		d := backoff(w.cfg.RetryBackoffMin, w.cfg.RetryBackoffMax, attempt)
		log.WarnContext(ctx, "retrying record", slog.Int("attempt", attempt+1), slog.Duration("backoff", d), slog.Any("err", err))
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// backoff returns the delay before retry attempt n (0-based): min doubled n
// times, capped at max, drawn uniformly from [d/2, d].
func backoff(min, max time.Duration, n int) time.Duration {
	d := max
	if n < 32 {
		if v := min << n; v > 0 && v < max {
			d = v
		}
	}
	half := d / 2
	return half + rand.N(d-half+1)
}

// metrics are the converge_worker_* collectors (listed in doc.go).
type metrics struct {
	messages     *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	effects      *prometheus.CounterVec
	processing   prometheus.Histogram
	endToEnd     prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_worker_messages_total",
			Help: "Task-event records handled by the worker, by outcome (processed, duplicate, conflict, ignored, failed, retried, dead_lettered).",
		}, []string{"outcome"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_deadletter_published_total",
			Help: "Records the worker parked on the dead-letter topic (acknowledged by the broker and recorded), by error code.",
		}, []string{"error_code"}),
		effects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_worker_effect_transitions_total",
			Help: "Effect ledger state transitions made by the worker, by effect kind and new state.",
		}, []string{"kind", "state"}),
		processing: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_worker_processing_seconds",
			Help:    "Time from the first attempt on a record to its durable outcome, retries included.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}),
		endToEnd: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_worker_task_end_to_end_seconds",
			Help:    "Time from task creation (task.created_at) to completion (task.completed_at).",
			Buckets: prometheus.ExponentialBuckets(0.005, 2.5, 14),
		}),
	}
	for _, o := range []string{OutcomeProcessed, OutcomeDuplicate, OutcomeConflict, OutcomeIgnored, OutcomeFailed, OutcomeRetried, OutcomeDeadLettered} {
		m.messages.WithLabelValues(o)
	}
	for _, c := range []prometheus.Collector{m.messages, m.deadLettered, m.effects, m.processing, m.endToEnd} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("worker: register metrics: %w", err)
		}
	}
	return m, nil
}

// kgoLogger forwards franz-go's warnings and errors to slog.
type kgoLogger struct{ l *slog.Logger }

var _ kgo.Logger = kgoLogger{}

func (k kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (k kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lv := slog.LevelDebug
	switch level {
	case kgo.LogLevelError:
		lv = slog.LevelError
	case kgo.LogLevelWarn:
		lv = slog.LevelWarn
	case kgo.LogLevelInfo:
		lv = slog.LevelInfo
	}
	k.l.Log(context.Background(), lv, "kafka: "+msg, keyvals...)
}
