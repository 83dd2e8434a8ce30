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
	"golang.org/x/sync/errgroup"

	"github.com/converge-run/converge/internal/artifact"
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
	// Concurrency is how many partitions of one poll are processed at once;
	// records of one partition are always processed in order. Defaults to 4.
	Concurrency int
	// MaxPollRecords bounds the records of one poll (one commit batch).
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
	if w.pool == nil {
		pool, err := pgxpool.New(context.Background(), cfg.DatabaseURL)
		if err != nil {
			return nil, fmt.Errorf("worker: open database pool: %w", err)
		}
		w.pool, w.ownPool = pool, true
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
	c := &consumer{w: w, marked: map[string]map[int32]kgo.EpochOffset{}}
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
	for {
		fetches := cl.PollRecords(ctx, w.cfg.MaxPollRecords)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			break
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			w.log.WarnContext(ctx, "fetch error", slog.String("topic", topic), slog.Int("partition", int(partition)), slog.Any("err", err))
		})
		c.processBatch(ctx, fetches)
		cl.AllowRebalance()
	}
	// Shutdown: commit what is durable, then leave the group. The revoke
	// callback of the leave commits again (a no-op once marked is empty).
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	c.commit(cctx, "shutdown")
	cancel()
	cl.AllowRebalance()
	cl.Close()
	w.log.Info("worker stopped", slog.String("group", w.cfg.Group))
	return nil
}

// consumer is the state of one Run: the client and the offsets of records
// whose outcome is durable but not yet committed.
type consumer struct {
	w      *Worker
	cl     *kgo.Client
	mu     sync.Mutex
	marked map[string]map[int32]kgo.EpochOffset
}

// processBatch processes one poll: partitions concurrently (at most
// Concurrency at once), each partition's records in order; then it commits
// the offsets of the records whose outcome is durable.
func (c *consumer) processBatch(ctx context.Context, fetches kgo.Fetches) {
	type tp struct {
		topic     string
		partition int32
	}
	var order []tp
	byPart := map[tp][]*kgo.Record{}
	fetches.EachRecord(func(r *kgo.Record) {
		k := tp{r.Topic, r.Partition}
		if _, ok := byPart[k]; !ok {
			order = append(order, k)
		}
		byPart[k] = append(byPart[k], r)
	})
	if len(order) == 0 {
		return
	}
	done := make([]*kgo.Record, len(order))
	var g errgroup.Group
	g.SetLimit(c.w.cfg.Concurrency)
	for i, k := range order {
		recs := byPart[k]
		g.Go(func() error {
			done[i] = c.w.processPartition(ctx, c.cl, recs)
			return nil
		})
	}
	_ = g.Wait()
	durable := false
	for _, r := range done {
		durable = durable || r != nil
	}
	if !durable {
		return
	}
	// The outcomes are durable; the offsets are not committed yet. An
	// injected error here is a lost acknowledgement: the offsets are
	// forgotten, so the records come again after a restart or rebalance and
	// must be harmless duplicates (seed 14).
	if err := c.w.faults.Err(fault.WorkerBeforeOffsetCommit); err != nil {
		c.w.log.WarnContext(ctx, "offset commit skipped", slog.Any("err", err))
		return
	}
	c.mu.Lock()
	for _, r := range done {
		if r == nil {
			continue
		}
		if c.marked[r.Topic] == nil {
			c.marked[r.Topic] = map[int32]kgo.EpochOffset{}
		}
		c.marked[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
	}
	c.mu.Unlock()
	c.commit(ctx, "batch")
}

// commit commits the marked offsets synchronously and forgets those that
// were committed. A failed commit keeps them for the next attempt.
func (c *consumer) commit(ctx context.Context, why string) {
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

// onRevoked commits before partitions move to another member (franz-go:
// with manual commits, commit in OnPartitionsRevoked), then forgets them.
func (c *consumer) onRevoked(ctx context.Context, _ *kgo.Client, revoked map[string][]int32) {
	c.commit(ctx, "revoke")
	c.forget(revoked)
}

// onLost forgets partitions that were lost: committing them is not possible.
func (c *consumer) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
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

// processPartition processes records of one partition in order and returns
// the last one whose outcome is durable (nil if none). It stops early when
// ctx is cancelled.
func (w *Worker) processPartition(ctx context.Context, cl *kgo.Client, recs []*kgo.Record) *kgo.Record {
	var last *kgo.Record
	for _, r := range recs {
		if ctx.Err() != nil || !w.processRecord(ctx, cl, r) {
			return last
		}
		last = r
	}
	return last
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
