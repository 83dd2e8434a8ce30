package reconciler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/services/api/idempotency"
)

// CodeArtifactVerificationFailed is the effect error code of an artifact
// whose stored object does not match its ledger request (seed 7.1).
const CodeArtifactVerificationFailed = ledger.CodeVerificationFailed

// Action kinds, the kind label of converge_reconciler_actions_total.
const (
	// ActionVerified: an effect started/unknown past the deadline was found
	// in the store, matching its request: -> verified.
	ActionVerified = "verified"
	// ActionPlanned: such an effect's object is absent: -> planned (not
	// executed; safe to retry with the same token).
	ActionPlanned = "planned"
	// ActionCompensationRequired: such an effect's object is present but
	// does not match: -> compensation_required.
	ActionCompensationRequired = "compensation_required"
	// ActionCompensated: a compensation_required effect's object was hidden
	// under its own ledger entry: -> compensated.
	ActionCompensated = "compensated"
	// ActionSkipped: the compare-and-set found the effect changed since it
	// was read; nothing was written.
	ActionSkipped = "skipped"
	// ActionError: observing the store or writing the repair failed; the
	// effect is retried on a later pass.
	ActionError = "error"
	// ActionCompensationObserved: a compensation (artifact.hide) left
	// started — its store call timed out — was found done by observing the
	// token gone: hide -> verified without hiding again, effect ->
	// compensated (seed 14, "compensation times out").
	ActionCompensationObserved = "compensation_observed"
	// ActionInboxReleased: an inbox row left processing past InboxLease
	// whose task is terminal was finished (processing -> completed).
	ActionInboxReleased = "inbox_released"
	// ActionTaskRedriven: a task queued or running past TaskDeadline got a
	// TaskRedriveRequested outbox event for its current version.
	ActionTaskRedriven = "task_redriven"
	// ActionIdempotencyResolved: an idempotency record in_progress past
	// locked_until was resolved from the task state.
	ActionIdempotencyResolved = "idempotency_resolved"
	// ActionCacheRepaired: a Redis task view older than the task's
	// database version was replaced by the database snapshot.
	ActionCacheRepaired = "cache_repaired"
	// ActionDeadLetterRecorded: a record of the dead-letter topic was
	// recorded in dead_letter.
	ActionDeadLetterRecorded = "dead_letter_recorded"
	// ActionDeadLetterResolved: a dead letter parked or refused whose task
	// has completed since (by another route) was resolved: nothing is left
	// to replay, and it no longer counts in converge_deadletter_unresolved.
	ActionDeadLetterResolved = "dead_letter_resolved"
	// ActionIdempotencyExpired: an idempotency record past expires_at whose
	// task is settled was removed (idempotency.Purge, seed 3.3).
	ActionIdempotencyExpired = "idempotency_expired"
	// ActionOutboxPurged: a published outbox row older than
	// OutboxRetention was removed.
	ActionOutboxPurged = "outbox_purged"
	// ActionInboxPurged: an inbox row (completed or failed) of a message
	// whose outbox row or task was removed by retention was removed.
	ActionInboxPurged = "inbox_purged"
	// ActionArtifactDeleted: an artifact of a task past TaskRetention was
	// removed from the store under its own artifact.delete ledger entry,
	// verified by observing it gone (ledger.DeleteArtifacts).
	ActionArtifactDeleted = "artifact_deleted"
	// ActionTaskPurged: a settled task past TaskRetention was removed with
	// its input, effects, outbox and inbox rows and dead letters, in one
	// transaction, after its artifacts were deleted.
	ActionTaskPurged = "task_purged"
	// ActionDeadLetterPurged: a resolved or replayed dead letter of no
	// existing task, last updated more than TaskRetention ago, was removed
	// (deadletter.DeleteOrphans).
	ActionDeadLetterPurged = "dead_letter_purged"
	// ActionOutboxRepublished: an outbox row unpublished past
	// RepublishAfter was produced again by the reconciler (Config.Producer)
	// and marked published.
	ActionOutboxRepublished = "outbox_republished"
	// ActionSuperseded: an effect started/unknown past the deadline was
	// found matching in the store while another artifact.put effect of its
	// task is already verified (at most one may be: the unique index of
	// migration 00003): -> compensation_required (ARTIFACT_SUPERSEDED), and
	// its object is hidden in the same pass (counted as compensated).
	ActionSuperseded = "superseded"
)

// CodeArtifactSuperseded is the effect error code of an artifact that
// matched its request but was not verified because another effect of the
// same task is; it is compensated (hidden).
const CodeArtifactSuperseded = ledger.CodeSuperseded

// Config configures a Reconciler. Zero values take the defaults noted.
type Config struct {
	// DatabaseURL of PostgreSQL, used when Pool is nil; the reconciler then
	// owns the pool and closes it when Run returns. One of DatabaseURL and
	// Pool is required.
	DatabaseURL string
	// Pool to use; the reconciler does not close it.
	Pool *pgxpool.Pool
	// ArtifactStore is observed to resolve effects. Required.
	ArtifactStore *artifact.Store
	// Interval between passes of Run. Defaults to 5s.
	Interval time.Duration
	// EffectDeadline is how long an effect may stay started or unknown (or
	// compensation_required) without an update before a pass repairs it: a
	// worker still on the effect updates it well within this time. Defaults
	// to 30s.
	EffectDeadline time.Duration
	// BatchSize bounds the effects each scan of one pass handles, and the
	// rows or tasks of one retention batch. Defaults to 100.
	BatchSize int
	// RetentionBudget is the longest a pass spends on retention: while
	// its batches come back full, it takes another until this much time
	// has gone (scanRetention). Defaults to Interval, so that retention
	// can use the whole of each interval when it is behind.
	RetentionBudget time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the converge_reconciler_* metrics. Defaults to a
	// new prometheus.NewRegistry() (metrics then go nowhere).
	Registerer prometheus.Registerer

	// Brokers are the Kafka bootstrap addresses of the dead-letter intake.
	// Optional: without them Run records no dead letters.
	Brokers []string
	// Topic is the task-events topic. Defaults to taskevent.DefaultTopic.
	Topic string
	// DeadLetterTopic is consumed into the dead_letter table. Defaults to
	// Topic + ".dlq".
	DeadLetterTopic string
	// DeadLetterGroup is the intake's consumer group. Defaults to
	// "converge-reconciler-dlq".
	DeadLetterGroup string
	// KafkaOpts are appended to the intake's client options. Defaults to
	// none.
	KafkaOpts []kgo.Opt
	// Redis is the task view's Redis. Optional: without it the cache scan
	// is skipped.
	Redis *redis.Client
	// Cache configures the task view used for repairs (its Registerer
	// defaults to Registerer).
	Cache taskview.CacheOptions
	// InboxLease is how long an inbox row may stay processing without a
	// delivery before a pass looks at it. Defaults to 2m.
	InboxLease time.Duration
	// TaskDeadline is how long a task may stay queued or running without
	// an update before a pass re-drives it (once per task version: the
	// outbox's unique (task, version, type) bounds it). Defaults to 5m.
	TaskDeadline time.Duration
	// OutboxThreshold is the age above which an unpublished outbox row is
	// reported (gauge and log). Defaults to 1m.
	OutboxThreshold time.Duration
	// Producer, when set, republishes outbox rows unpublished (and not
	// parked) for longer than RepublishAfter: at most BatchSize per pass,
	// oldest first, each with its original key, value and headers
	// (cdc.RecordOf), then marked published (issue 13: rows the slot can no
	// longer deliver — a lost and recreated slot, rows committed before the
	// slot existed; cdc.RepublishUnpublished, which `converge outbox
	// republish --unpublished` runs on demand). Use acks=all. The caller
	// closes it. Optional.
	Producer *kgo.Client
	// OutboxRetention is how long a published (or parked and decided)
	// outbox row is kept before a pass removes it (issue 13; in batches of
	// BatchSize, for at most RetentionBudget per pass). Defaults to 7 days
	// (168h), the default retention of a Kafka topic: after it the event is
	// gone from the broker too.
	OutboxRetention time.Duration
	// TaskRetention is how long a terminal task is kept after its last
	// update before a pass removes it with its artifacts and every row of
	// it (issue 13, seed 3.3; in batches of BatchSize tasks, for at most
	// RetentionBudget per pass), once nothing still needs it (task.Hold: no
	// idempotency record names it, every event published or decided, no
	// dead letter parked or refused, every effect settled, no inbox row
	// processing). Defaults to 30 days (720h). Validate refuses a window shorter than the idempotency
	// window (idempotency.DefaultTTL, 24h: a task outlives its keys) or
	// than OutboxRetention (the task's inbox rows must outlive its records
	// in Kafka, whose retention OutboxRetention follows).
	TaskRetention time.Duration
	// Faults are the armed fault points (fault.RetentionAfterDeletePlanned,
	// fault.RetentionAfterArtifactDelete). Defaults to nil: none.
	Faults *fault.Set
	// RepublishAfter is the age of an unpublished outbox row past which
	// Producer republishes it. Far above the relay's normal delay, so that
	// a republication is the exception; a row published twice is a
	// duplicate the inboxes absorb. Defaults to 5m.
	RepublishAfter time.Duration
}

func (c *Config) setDefaults() {
	if c.Interval <= 0 {
		c.Interval = 5 * time.Second
	}
	if c.EffectDeadline <= 0 {
		c.EffectDeadline = 30 * time.Second
	}
	if c.BatchSize <= 0 {
		c.BatchSize = 100
	}
	if c.RetentionBudget <= 0 {
		c.RetentionBudget = c.Interval
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.DeadLetterTopic == "" {
		c.DeadLetterTopic = taskevent.DeadLetterTopic(c.Topic)
	}
	if c.DeadLetterGroup == "" {
		c.DeadLetterGroup = DefaultDeadLetterGroup
	}
	if c.Cache.Registerer == nil {
		c.Cache.Registerer = c.Registerer
	}
	if c.InboxLease <= 0 {
		c.InboxLease = 2 * time.Minute
	}
	if c.TaskDeadline <= 0 {
		c.TaskDeadline = 5 * time.Minute
	}
	if c.OutboxThreshold <= 0 {
		c.OutboxThreshold = time.Minute
	}
	if c.OutboxRetention <= 0 {
		c.OutboxRetention = 7 * 24 * time.Hour
	}
	if c.TaskRetention <= 0 {
		c.TaskRetention = DefaultTaskRetention
	}
	if c.RepublishAfter <= 0 {
		c.RepublishAfter = 5 * time.Minute
	}
}

// DefaultTaskRetention is Config.TaskRetention's default: 30 days.
const DefaultTaskRetention = 30 * 24 * time.Hour

// DefaultDeadLetterGroup is the consumer group of the dead-letter intake.
const DefaultDeadLetterGroup = "converge-reconciler-dlq"

// Validate reports a missing field, or a TaskRetention (after defaults)
// shorter than the idempotency window or than OutboxRetention.
func (c *Config) Validate() error {
	switch {
	case c.Pool == nil && c.DatabaseURL == "":
		return errors.New("reconciler: one of Pool and DatabaseURL is required")
	case c.ArtifactStore == nil:
		return errors.New("reconciler: ArtifactStore is required")
	case c.TaskRetention > 0 && c.TaskRetention < idempotency.DefaultTTL:
		return fmt.Errorf("reconciler: TaskRetention %s is shorter than the idempotency window %s: a key must never outlive its task", c.TaskRetention, idempotency.DefaultTTL)
	case c.TaskRetention > 0 && c.TaskRetention < c.OutboxRetention:
		return fmt.Errorf("reconciler: TaskRetention %s is shorter than OutboxRetention %s: a task's inbox rows must outlive its events in Kafka", c.TaskRetention, c.OutboxRetention)
	}
	return nil
}

// Reconciler repairs effect ledger drift (see the package doc).
type Reconciler struct {
	cfg     Config
	log     *slog.Logger
	pool    *pgxpool.Pool
	ownPool bool
	store   *artifact.Store
	cache   *taskview.Cache // nil without Redis
	m       *metrics
	// cacheCursor is the task id after which the next cache scan starts.
	cacheCursor string
	// backlog is the outbox backlog scan's watermark (outbox.Backlog).
	backlog outbox.Backlog
	// lastSweep is when the artifact store's leftovers were last removed.
	lastSweep time.Time
	// retentionCursor is where the next pass's walk over expired terminal
	// tasks starts (past the tasks kept so far).
	retentionCursor task.Cursor

	// beforeRepair, when set (tests), runs after an effect was read and
	// observed and before its compare-and-set.
	beforeRepair func(ctx context.Context, effectID string)
}

// New validates cfg and returns a Reconciler. It registers the metrics on
// cfg.Registerer (an error if they are already registered there) and, with
// DatabaseURL, creates a pool (connections are made on first use).
func New(cfg Config) (*Reconciler, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	r := &Reconciler{cfg: cfg, log: cfg.Logger, pool: cfg.Pool, store: cfg.ArtifactStore, m: m}
	if cfg.Redis != nil {
		if r.cache, err = taskview.NewCache(cfg.Redis, cfg.Cache); err != nil {
			return nil, fmt.Errorf("reconciler: %w", err)
		}
	}
	if r.pool, r.ownPool, err = dbpool.Use(r.pool, cfg.DatabaseURL, "reconciler"); err != nil {
		return nil, err
	}
	return r, nil
}

// Run runs a pass at once and then every Interval until ctx is cancelled,
// then returns nil. A failed pass is logged and counted; the next pass
// tries again. With Brokers, Run also consumes the dead-letter topic into
// the dead_letter table (see Intake); it returns an error only when that
// consumer cannot be created.
func (r *Reconciler) Run(ctx context.Context) error {
	if r.ownPool {
		defer r.pool.Close()
	}
	if len(r.cfg.Brokers) == 0 {
		return r.runPasses(ctx)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return r.runPasses(gctx) })
	g.Go(func() error { return r.runIntake(gctx) })
	return g.Wait()
}

func (r *Reconciler) runPasses(ctx context.Context) error {
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	r.log.InfoContext(ctx, "reconciler started", slog.Duration("interval", r.cfg.Interval), slog.Duration("effect_deadline", r.cfg.EffectDeadline))
	if r.cache == nil {
		r.log.WarnContext(ctx, "reconciler without Redis: the task views of the tasks retention removes stay until their TTL, and the API may answer from them; stale views are not repaired")
	}
	for {
		res, err := r.Pass(ctx)
		switch {
		case ctx.Err() != nil:
		case err != nil:
			r.log.WarnContext(ctx, "reconciler pass failed", slog.Any("err", err))
		case res.Examined > 0 || res.Repairs() > 0:
			r.log.InfoContext(ctx, "reconciler pass", slog.Any("result", res))
		}
		select {
		case <-ctx.Done():
			r.log.Info("reconciler stopped")
			return nil
		case <-t.C:
		}
	}
}

// Result counts what one pass did.
type Result struct {
	// Examined is the number of effects the pass read.
	Examined int
	// Verified, Planned, CompensationRequired and Compensated count the
	// repairs written, by new state; Superseded counts effects that matched
	// while another effect of their task was verified (each also counts in
	// Compensated once hidden).
	Verified, Planned, CompensationRequired, Compensated, Superseded int
	// Skipped counts compare-and-sets that found the effect changed
	// concurrently (nothing written).
	Skipped int
	// Errors counts effects whose observation or repair failed; they are
	// examined again on a later pass.
	Errors int
	// CompensationsObserved counts compensations found done by observation.
	CompensationsObserved int
	// InboxReleased, TasksRedriven, IdempotencyResolved and CacheRepaired
	// count the repairs of the other scans.
	InboxReleased, TasksRedriven, IdempotencyResolved, CacheRepaired int
	// DeadLettersResolved counts dead letters resolved because their task
	// completed since.
	DeadLettersResolved int
	// OutboxUnpublished is the number of outbox rows unpublished for longer
	// than OutboxThreshold.
	OutboxUnpublished int
	// IdempotencyExpired, OutboxPurged and InboxPurged count the rows the
	// retention scan removed; TasksPurged the tasks it removed (each with
	// its rows), ArtifactsDeleted the artifacts it deleted from the store,
	// TasksKept the expired tasks it examined and kept (task.Hold),
	// DeadLettersPurged the settled dead letters of no task it removed.
	IdempotencyExpired, OutboxPurged, InboxPurged, TasksPurged, ArtifactsDeleted, TasksKept, DeadLettersPurged int
	// LeftoversRemoved counts temporary files of crashed artifact writes
	// the pass removed (artifact.Store.RemoveLeftovers).
	LeftoversRemoved int
	// OutboxRepublished counts outbox rows the pass republished.
	OutboxRepublished int
	// OutboxParked is the number of parked outbox rows not yet republished
	// or discarded (converge outbox list).
	OutboxParked int
}

// Repairs is the number of repairs written by the pass.
func (res Result) Repairs() int {
	return res.Verified + res.Planned + res.CompensationRequired + res.Superseded + res.Compensated + res.CompensationsObserved +
		res.InboxReleased + res.TasksRedriven + res.IdempotencyResolved + res.CacheRepaired + res.DeadLettersResolved
}

// Pass runs one bounded reconciliation pass:
//
//  1. Effects of kind artifact.put in state started or unknown whose
//     updated_at is older than EffectDeadline (at most BatchSize, oldest
//     first) are resolved by observing the store under the same token
//     (seed 7): present and matching task id, attempt, size and request
//     SHA-256 -> verified (with observed_result_sha256); present and not
//     matching -> compensation_required (error_code
//     ARTIFACT_VERIFICATION_FAILED); absent -> planned (not executed, safe
//     to retry with the same token). Present and matching while another
//     effect of the task is verified -> compensation_required
//     (ARTIFACT_SUPERSEDED), compensated at once as in step 2.
//  2. Effects of kind artifact.put in state compensation_required past the
//     deadline (at most BatchSize) are compensated (seed 8): an
//     artifact.hide ledger row with token "compensation-for-<effect_id>",
//     store Hide, Head must report the object gone, hide -> verified,
//     effect -> compensated.
//
// Every write is a compare-and-set on the state read, so a pass never
// overwrites a change made after it read the effect. Pass returns an error
// only when a scan query fails; per-effect failures are counted in Errors.
func (r *Reconciler) Pass(ctx context.Context) (Result, error) {
	start := time.Now()
	var res Result
	err := r.pass(ctx, &res)
	result := "ok"
	if err != nil {
		result = "error"
	}
	r.m.passes.WithLabelValues(result).Inc()
	r.m.passSeconds.Observe(time.Since(start).Seconds())
	return res, err
}

func (r *Reconciler) pass(ctx context.Context, res *Result) error {
	unresolved, err := ledger.Stale(ctx, r.pool, ledger.KindArtifactPut, []ledger.State{ledger.Started, ledger.Unknown}, r.cfg.EffectDeadline, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, e := range unresolved {
		res.Examined++
		action, observed := r.resolve(ctx, e)
		r.count(res, action)
		if action == ActionSuperseded {
			e.State, e.ObservedSHA256 = ledger.CompensationRequired, observed
			r.count(res, r.compensate(ctx, e))
		}
	}
	pending, err := ledger.Stale(ctx, r.pool, ledger.KindArtifactPut, []ledger.State{ledger.CompensationRequired}, r.cfg.EffectDeadline, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, e := range pending {
		res.Examined++
		r.count(res, r.compensate(ctx, e))
	}
	return r.scans(ctx, res)
}

func (r *Reconciler) count(res *Result, action string) {
	r.m.actions.WithLabelValues(action).Inc()
	switch action {
	case ActionVerified:
		res.Verified++
	case ActionPlanned:
		res.Planned++
	case ActionCompensationRequired:
		res.CompensationRequired++
	case ActionCompensated:
		res.Compensated++
	case ActionCompensationObserved:
		res.Compensated++
		res.CompensationsObserved++
	case ActionSuperseded:
		res.Superseded++
	case ActionSkipped:
		res.Skipped++
	default:
		res.Errors++
	}
}

// resolve observes the store for an effect whose outcome is not known and
// records what it sees, by compare-and-set (ledger.Verify decides whether
// the object matches). It returns the action taken and the SHA-256 observed.
func (r *Reconciler) resolve(ctx context.Context, e ledger.Effect) (string, *string) {
	log := r.log.With(slog.String("effect_id", e.EffectID), slog.String("state", string(e.State)))
	obs, err := r.store.Observe(e.Token)
	var to ledger.State
	var observed *string
	switch {
	case errors.Is(err, artifact.ErrNotFound):
		to = ledger.Planned
	case err != nil:
		log.WarnContext(ctx, "observe artifact", slog.Any("err", err))
		return ActionError, nil
	case ledger.Verify(obs, e):
		to, observed = ledger.Verified, &obs.SHA256
	default:
		to, observed = ledger.CompensationRequired, &obs.SHA256
	}
	if r.beforeRepair != nil {
		r.beforeRepair(ctx, e.EffectID)
	}
	var ok bool
	switch to {
	case ledger.Planned:
		ok, err = ledger.MarkPlanned(ctx, r.pool, e.EffectID, e.State)
	case ledger.Verified:
		ok, err = ledger.MarkVerified(ctx, r.pool, e.EffectID, e.State, observed)
	default:
		ok, err = ledger.RequireCompensation(ctx, r.pool, e.EffectID, e.State, observed, CodeArtifactVerificationFailed)
	}
	if to == ledger.Verified && ledger.OneVerifiedViolation(err) {
		// Another effect of the task is verified: this artifact is one too
		// many; mark it for compensation instead (pass hides it).
		ok, err = ledger.RequireCompensation(ctx, r.pool, e.EffectID, e.State, observed, CodeArtifactSuperseded)
		if err != nil {
			log.WarnContext(ctx, "repair superseded effect", slog.Any("err", err))
			return ActionError, nil
		}
		if !ok {
			return ActionSkipped, nil
		}
		log.WarnContext(ctx, "effect superseded: another artifact of the task is verified; compensating")
		return ActionSuperseded, observed
	}
	if err != nil {
		log.WarnContext(ctx, "repair effect", slog.Any("err", err))
		return ActionError, nil
	}
	if !ok {
		log.InfoContext(ctx, "effect changed concurrently; left alone", slog.String("wanted", string(to)))
		return ActionSkipped, nil
	}
	log.InfoContext(ctx, "effect repaired", slog.String("new_state", string(to)))
	switch to {
	case ledger.Verified:
		return ActionVerified, observed
	case ledger.Planned:
		return ActionPlanned, observed
	}
	return ActionCompensationRequired, observed
}

// compensate undoes the object of a compensation_required effect under its
// own ledger entry and marks the effect compensated (ledger.Compensate, seed
// 8).
func (r *Reconciler) compensate(ctx context.Context, e ledger.Effect) string {
	log := r.log.With(slog.String("effect_id", e.EffectID))
	c, err := ledger.Compensate(ctx, r.pool, r.store, e, e.RequestSize)
	if err != nil {
		log.WarnContext(ctx, "compensate effect", slog.Any("err", err))
		return ActionError
	}
	if !c.Applied {
		return ActionSkipped
	}
	log.InfoContext(ctx, "effect compensated", slog.String("compensation_id", c.HideID), slog.Bool("hide_observed", c.Observed))
	if c.Observed {
		return ActionCompensationObserved
	}
	return ActionCompensated
}

// metrics are the converge_reconciler_* collectors (listed in doc.go).
type metrics struct {
	actions      *prometheus.CounterVec
	passes       *prometheus.CounterVec
	passSeconds  prometheus.Histogram
	unresolved   prometheus.Gauge
	outboxRows   prometheus.Gauge
	outboxAge    prometheus.Gauge
	outboxParked prometheus.Gauge
	expiredTasks prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_reconciler_actions_total",
			Help: "Reconciler actions, by kind: effects (verified, planned, compensation_required, superseded, compensated, compensation_observed, skipped, error), inbox_released, task_redriven, idempotency_resolved, cache_repaired, dead_letter_recorded, dead_letter_resolved, outbox_republished; retention: idempotency_expired, outbox_purged, inbox_purged, artifact_deleted, task_purged.",
		}, []string{"kind"}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_reconciler_passes_total",
			Help: "Reconciler passes, by result (ok, error).",
		}, []string{"result"}),
		passSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_reconciler_pass_seconds",
			Help:    "Duration of one reconciler pass.",
			Buckets: prometheus.ExponentialBuckets(0.001, 3, 12),
		}),
		unresolved: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_deadletter_unresolved",
			Help: "Dead letters that need a person (state parked or refused), counted from the dead_letter table at each pass.",
		}),
		outboxRows: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_outbox_unpublished_rows",
			Help: "Outbox rows unpublished for longer than the reconciler's OutboxThreshold, at the last pass.",
		}),
		outboxAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_outbox_oldest_unpublished_age_seconds",
			Help: "Age of the oldest unpublished outbox row at the last pass (0 when none; parked rows are not counted).",
		}),
		outboxParked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_outbox_parked_rows",
			Help: "Outbox rows the relay parked (it cannot publish them) that no one has republished or discarded yet (converge outbox list), at the last pass.",
		}),
		expiredTasks: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_reconciler_expired_tasks",
			Help: "Terminal tasks past the task retention window still in the database after the last pass's retention (kept for a reason, or not reached yet), counted up to 10001. Growing: retention falls behind the rate tasks are created at.",
		}),
	}
	for _, k := range []string{ActionVerified, ActionPlanned, ActionCompensationRequired, ActionCompensated, ActionSkipped, ActionError,
		ActionCompensationObserved, ActionInboxReleased, ActionTaskRedriven, ActionIdempotencyResolved, ActionCacheRepaired, ActionDeadLetterRecorded, ActionDeadLetterResolved, ActionSuperseded, ActionOutboxRepublished, ActionIdempotencyExpired, ActionOutboxPurged,
		ActionInboxPurged, ActionArtifactDeleted, ActionTaskPurged, ActionDeadLetterPurged} {
		m.actions.WithLabelValues(k)
	}
	for _, r := range []string{"ok", "error"} {
		m.passes.WithLabelValues(r) // exported at 0 before the first pass
	}
	for _, c := range []prometheus.Collector{m.actions, m.passes, m.passSeconds, m.unresolved, m.outboxRows, m.outboxAge, m.outboxParked, m.expiredTasks} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("reconciler: register metrics: %w", err)
		}
	}
	return m, nil
}
