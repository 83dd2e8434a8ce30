package worker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/clientid"
	"github.com/converge-run/converge/internal/consumergroup"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/taskevent"
)

// DefaultGroup is the consumer group (and inbox consumer_name) of the worker.
const DefaultGroup = taskevent.DefaultWorkerGroup

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
	// OutcomeLeaseHeld: one attempt found the message processing under
	// another instance's live inbox lease (seed 6: not processed
	// concurrently); the record is tried again shortly, without counting
	// against MaxAttempts, until the holder finished it or its lease
	// expired (InboxLease).
	OutcomeLeaseHeld = "lease_held"
	// OutcomeCancelled: the task was cancelled while queued (a client's
	// version-guarded cancel won against the start): not started, nothing
	// performed.
	OutcomeCancelled = "cancelled"
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
	// KafkaOpts are appended to the client options the consumer-group
	// engine sets (internal/consumergroup); use them for TLS, SASL or
	// metrics. Defaults to none.
	KafkaOpts []kgo.Opt
	// Concurrency is how many records — or runs of records sharing their
	// transactions (MaxBatchRecords), waiting for a group or in one
	// (RunGroups) — of different partitions are processed at once, and how
	// many effects of one group are performed at once (they are of
	// distinct tasks). A partition's records are
	// processed in order: one record or run at a time, and a record's
	// outcome is durable before the next record's offset can be committed.
	// Defaults to 4.
	Concurrency int
	// MaxPollRecords bounds the records of one poll and of one batch of a
	// partition's goroutine (one offset mark): the polls queued for the
	// partition are joined up to it (internal/consumergroup).
	// Defaults to 500.
	MaxPollRecords int
	// MaxBatchRecords bounds a run of a batch's fresh records that share
	// one intake and one completion transaction (batch.go): larger runs
	// commit less per task, and a run's records wait for its slowest
	// effect. It also bounds a group of runs of different partitions
	// (RunGroups). 1 processes every record on its own. Defaults to 64.
	MaxBatchRecords int
	// RunGroups is how many groups of runs are processed at once
	// (groups.go): the runs that partitions submit while that many are
	// busy wait and are then processed together, in one intake and one
	// completion transaction. Defaults to 2 (BENCHMARKS.md, session of
	// 2026-12-07, twelfth).
	RunGroups int
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
	// SessionTimeout and RebalanceTimeout of the consumer group
	// (consumergroup.Config: how soon another member takes over after this
	// one died, how long a rebalance waits). Default to consumergroup's
	// (10s, 30s).
	SessionTimeout   time.Duration
	RebalanceTimeout time.Duration
	// VisibilityTimeout bounds how long a record whose task is not found is
	// retried before it is dead-lettered as TASK_NOT_FOUND, counted from the
	// record's timestamp (the relay produces it after the commit record is
	// flushed) or its first failure, whichever is earlier. The task's
	// transaction committed, but its rows may not be visible to other
	// sessions yet: briefly always, and for as long as a synchronous standby
	// does not confirm (ErrNotYetVisible). The partition waits meanwhile; a
	// record of a task that never existed (forged, or older than the
	// database's retention) waits this long once. Defaults to 30s.
	VisibilityTimeout time.Duration
	// AttemptTimeout bounds one processing attempt of one record (database
	// statements and store calls). An attempt in flight when Run's context
	// is cancelled runs to its end within this bound. Defaults to 30s.
	AttemptTimeout time.Duration
	// InboxLease is how long a delivery leases the inbox row of a message
	// it registers or resumes (seed 6; inbox.Lease): while it lasts,
	// another instance that receives the message (a rebalance moved the
	// partition, a redelivery) waits instead of processing it
	// concurrently; after it, the message is taken over. It must be at
	// least AttemptTimeout, so that the holder's attempt has ended when the
	// lease expires; a worker that crashed mid-attempt delays its messages
	// by at most this long. Defaults to AttemptTimeout.
	InboxLease time.Duration
	// LeaseOwner names this worker instance in inbox leases
	// (inbox_message.locked_by). Defaults to the process's client id
	// (clientid.Process) and a random suffix, unique per Worker.
	LeaseOwner string
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
	if c.MaxBatchRecords <= 0 {
		c.MaxBatchRecords = 64
	}
	if c.RunGroups <= 0 {
		c.RunGroups = 2
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
	if c.VisibilityTimeout <= 0 {
		c.VisibilityTimeout = 30 * time.Second
	}
	if c.InboxLease <= 0 {
		c.InboxLease = c.AttemptTimeout
	}
	if c.LeaseOwner == "" {
		var b [4]byte
		_, _ = rand.Read(b[:])
		c.LeaseOwner = clientid.Process("converge-worker") + "-" + hex.EncodeToString(b[:])
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
	case c.InboxLease < c.AttemptTimeout:
		return fmt.Errorf("worker: InboxLease %s is below AttemptTimeout %s (a lease must outlive its holder's attempt)", c.InboxLease, c.AttemptTimeout)
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
	lease   inbox.Lease
	groups  *runGroups
	// afterStartMissed, when set (tests only), runs in the per-record
	// intake after the start's compare-and-set did not apply and before the
	// task is read.
	afterStartMissed func()
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
	w := &Worker{cfg: cfg, log: cfg.Logger, pool: cfg.Pool, store: cfg.ArtifactStore, faults: cfg.Faults, m: m,
		lease: inbox.Lease{Owner: cfg.LeaseOwner, For: cfg.InboxLease}}
	w.groups = newRunGroups(cfg.RunGroups, cfg.MaxBatchRecords, func(jobs []*job) ([]string, int) {
		// A group's work is bounded by AttemptTimeout per step, not by any
		// one partition's context: a partition revoked meanwhile waits for
		// its run's outcomes, as it did before groups.
		return w.processGroup(context.Background(), jobs)
	})
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
// The consumer-group rules (per-partition order, durable offsets only,
// revoke and loss, shutdown) are internal/consumergroup's.
func (w *Worker) Run(ctx context.Context) error {
	if w.ownPool {
		defer w.pool.Close()
	}
	sem := make(chan struct{}, w.cfg.Concurrency)
	c, err := consumergroup.New(consumergroup.Config{
		Brokers: w.cfg.Brokers, Group: w.cfg.Group, Topics: []string{w.cfg.Topic},
		ClientID: clientid.Process("converge-worker"), // one id per process: see internal/devbroker
		Logger:   w.log, MaxPollRecords: w.cfg.MaxPollRecords,
		SessionTimeout: w.cfg.SessionTimeout, RebalanceTimeout: w.cfg.RebalanceTimeout,
		// The outcomes are durable, the offsets not committed yet: an
		// injected error here is a lost acknowledgement (seed 14).
		BeforeMark: func(context.Context) error { return w.faults.Err(fault.WorkerBeforeOffsetCommit) },
		KafkaOpts:  w.cfg.KafkaOpts,
	}, consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		return w.processBatch(ctx, b, sem)
	}))
	if err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	ectx, cancel := context.WithTimeout(ctx, 10*time.Second)
	if err := kafkatopic.Ensure(ectx, c.Client(), w.cfg.DeadLetterPartitions, w.cfg.DeadLetterTopic); err != nil {
		w.log.WarnContext(ctx, "dead-letter topic not ensured; producing to it may fail", slog.String("topic", w.cfg.DeadLetterTopic), slog.Any("err", err))
	}
	cancel()
	w.log.InfoContext(ctx, "worker started", slog.String("topic", w.cfg.Topic), slog.String("group", w.cfg.Group))
	err = c.Run(ctx)
	w.log.Info("worker stopped", slog.String("group", w.cfg.Group))
	return err
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
	retries := 0 // retryable failures, bounded by MaxAttempts
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		outcome, err := w.handle(actx, r)
		cancel()
		if err == nil {
			w.m.messages.WithLabelValues(outcome).Inc()
			w.m.processing.Observe(time.Since(start).Seconds())
			log.DebugContext(ctx, "record handled", slog.String("outcome", outcome))
			return true
		}
		now := time.Now()
		if first.IsZero() {
			first = now
		}
		retryable := Retryable(err)
		leased := errors.Is(err, inbox.ErrLeaseHeld)
		if retryable && !leased {
			retries++
		}
		waiting := !retryable && errors.Is(err, ErrNotYetVisible) && now.Before(w.visibleBy(r, first))
		if !waiting && (!retryable || retries >= w.cfg.MaxAttempts) {
			f := failure{class: taskevent.ClassRetryable, code: CodeRetriesExhausted, err: err, attempts: attempt + 1, first: first, last: now}
			if !retryable {
				f.class, f.code = taskevent.ClassDeterministic, ErrorCode(err)
			}
			if !w.deadLetter(ctx, cl, r, f, log) {
				return false
			}
			w.m.messages.WithLabelValues(OutcomeDeadLettered).Inc()
			w.m.processing.Observe(time.Since(start).Seconds())
			return true
		}
		d := backoff.Delay(w.cfg.RetryBackoffMin, w.cfg.RetryBackoffMax, attempt)
		if leased {
			w.m.messages.WithLabelValues(OutcomeLeaseHeld).Inc()
		} else {
			w.m.messages.WithLabelValues(OutcomeRetried).Inc()
		}
		if leased {
			// The holder may finish any moment; its lease bounds the wait.
			d = min(d, leaseBackoffMax)
			log.InfoContext(ctx, "message leased to another instance; waiting", slog.Int("attempt", attempt+1), slog.Duration("backoff", d), slog.Any("err", err))
		} else if waiting {
			d = min(d, visibilityBackoffMax)
			log.DebugContext(ctx, "task not visible yet; retrying", slog.Int("attempt", attempt+1), slog.Duration("backoff", d), slog.Any("err", err))
		} else {
			log.WarnContext(ctx, "retrying record", slog.Int("attempt", attempt+1), slog.Duration("backoff", d), slog.Any("err", err))
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			w.releaseLease(r, log)
			return false
		case <-t.C:
		}
	}
}

// releaseLease ends this instance's inbox lease on record r, given up
// unfinished (inbox.ReleaseLease), so that its next consumer need not wait
// for the lease to expire. Best effort: a lease left behind expires.
func (w *Worker) releaseLease(r *kgo.Record, log *slog.Logger) {
	id := ""
	for _, h := range r.Headers {
		if h.Key == taskevent.HeaderEventID {
			id = string(h.Value)
		}
	}
	if id == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), releaseLeaseTimeout)
	defer cancel()
	if _, err := inbox.ReleaseLease(ctx, w.pool, w.cfg.Group, id, w.lease.Owner); err != nil {
		log.WarnContext(ctx, "could not release the inbox lease; it expires by itself", slog.String("event_id", id), slog.Any("err", err))
	}
}

// releaseLeaseTimeout bounds releaseLease.
const releaseLeaseTimeout = 2 * time.Second

// leaseBackoffMax caps the delay between attempts on a record whose inbox
// row another instance holds under a live lease.
const leaseBackoffMax = time.Second

// visibilityBackoffMax caps the delay between attempts on a record whose
// task is not visible yet: a commit normally becomes visible within
// milliseconds, so the record is tried again soon after it does.
const visibilityBackoffMax = time.Second

// visibleBy is when a record whose task is not visible stops being retried:
// VisibilityTimeout after the earlier of its timestamp and its first failure.
func (w *Worker) visibleBy(r *kgo.Record, first time.Time) time.Time {
	from := first
	if !r.Timestamp.IsZero() && r.Timestamp.Before(from) {
		from = r.Timestamp
	}
	return from.Add(w.cfg.VisibilityTimeout)
}

// metrics are the converge_worker_* collectors (listed in doc.go).
type metrics struct {
	batched      prometheus.Counter
	groups       prometheus.Histogram
	messages     *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	effects      *prometheus.CounterVec
	processing   prometheus.Histogram
	endToEnd     prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		batched: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_worker_batched_records_total",
			Help: "Records whose intake went through a run's shared transaction (batch.go); the others were processed on their own.",
		}),
		groups: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_worker_group_records",
			Help:    "Records per group of runs whose shared intake transaction committed (groups.go): how many tasks share the group's transactions, directory fsync and artifact pack.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 9),
		}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_worker_messages_total",
			Help: "Task-event records handled by the worker, by outcome (processed, duplicate, conflict, ignored, failed, retried, dead_lettered, cancelled, lease_held).",
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
	for _, o := range []string{OutcomeProcessed, OutcomeDuplicate, OutcomeConflict, OutcomeIgnored, OutcomeFailed, OutcomeRetried, OutcomeDeadLettered, OutcomeCancelled, OutcomeLeaseHeld} {
		m.messages.WithLabelValues(o)
	}
	// Exported at 0 from the start so that a dashboard's sum shows 0, not
	// "no data", on a healthy system (issue 13); other codes appear with
	// their first dead letter.
	for _, code := range []string{CodeRetriesExhausted, CodeTaskNotFound} {
		m.deadLettered.WithLabelValues(code)
	}
	for _, c := range []prometheus.Collector{m.batched, m.groups, m.messages, m.deadLettered, m.effects, m.processing, m.endToEnd} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("worker: register metrics: %w", err)
		}
	}
	return m, nil
}
