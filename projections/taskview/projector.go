package taskview

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/taskevent"
)

// DefaultGroup is the projector's consumer group.
const DefaultGroup = "converge-projector"

// Config configures a Projector.
type Config struct {
	// Brokers are the Kafka seed brokers. Required.
	Brokers []string
	// Topic is the task-events topic. Defaults to taskevent.DefaultTopic.
	Topic string
	// Group is the consumer group. Defaults to DefaultGroup
	// ("converge-projector").
	Group string
	// Redis is the client of the task view. Required.
	Redis *redis.Client
	// Cache configures the view (TTL, jitter). Its Registerer defaults to
	// Config.Registerer.
	Cache CacheOptions
	// MaxPollRecords bounds the records handled between two offset
	// commits. Defaults to 500.
	MaxPollRecords int
	// RetryBackoff is the first wait after a failed Redis write; it doubles
	// up to MaxRetryBackoff, and the write is retried until it succeeds or
	// Run's context ends. Defaults to 100ms.
	RetryBackoff time.Duration
	// MaxRetryBackoff caps RetryBackoff. Defaults to 5s.
	MaxRetryBackoff time.Duration
	// Logger receives structured logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the projector's metrics (see the package doc).
	// Defaults to a fresh prometheus.NewRegistry().
	Registerer prometheus.Registerer
	// KafkaOpts are appended to the client options the projector sets
	// (seed brokers, group, topic, manual commits), for TLS, SASL, logging
	// or test tuning.
	KafkaOpts []kgo.Opt
}

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.Group == "" {
		c.Group = DefaultGroup
	}
	if c.MaxPollRecords == 0 {
		c.MaxPollRecords = 500
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = 100 * time.Millisecond
	}
	if c.MaxRetryBackoff == 0 {
		c.MaxRetryBackoff = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Cache.Registerer == nil {
		c.Cache.Registerer = c.Registerer
	}
}

// Validate reports a missing or unusable setting after defaults are applied.
func (c *Config) Validate() error {
	switch {
	case len(c.Brokers) == 0:
		return errors.New("projector: Brokers required")
	case c.Redis == nil:
		return errors.New("projector: Redis required")
	case c.MaxPollRecords < 1:
		return fmt.Errorf("projector: MaxPollRecords %d must be positive", c.MaxPollRecords)
	case c.RetryBackoff < 0 || c.MaxRetryBackoff < c.RetryBackoff:
		return fmt.Errorf("projector: RetryBackoff %s / MaxRetryBackoff %s invalid", c.RetryBackoff, c.MaxRetryBackoff)
	}
	return nil
}

// Projector consumes the task-events topic in a consumer group and writes
// every event's task snapshot into the Redis task view (Cache.Put). See the
// package doc for its commit rule.
type Projector struct {
	cfg     Config
	cache   *Cache
	log     *slog.Logger
	events  *prometheus.CounterVec
	redisEr prometheus.Counter

	mu   sync.Mutex
	done map[int32]kgo.EpochOffset // next offset to commit, per partition of cfg.Topic
}

// New validates cfg and returns a Projector. It does not connect; Run does.
func New(cfg Config) (*Projector, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cache, err := NewCache(cfg.Redis, cfg.Cache)
	if err != nil {
		return nil, fmt.Errorf("projector: %w", err)
	}
	events := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "converge_projector_events_total",
		Help: "Task events handled by the projector, by outcome: stored (view written), stale (view already at an equal or newer version), invalid (undecodable record, skipped).",
	}, []string{"outcome"})
	redisErrs := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "converge_projector_redis_errors_total",
		Help: "Failed task view writes; each is retried with bounded backoff.",
	})
	for _, c := range []prometheus.Collector{events, redisErrs} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("projector metrics: %w", err)
		}
	}
	for _, o := range []string{outcomeStored, outcomeStale, outcomeInvalid} {
		events.WithLabelValues(o)
	}
	return &Projector{cfg: cfg, cache: cache, log: cfg.Logger, events: events, redisEr: redisErrs, done: map[int32]kgo.EpochOffset{}}, nil
}

const (
	outcomeStored  = "stored"
	outcomeStale   = "stale"
	outcomeInvalid = "invalid"
)

// Cache returns the projector's view, for readers in the same process.
func (p *Projector) Cache() *Cache { return p.cache }

// Run joins the consumer group and projects events until ctx is cancelled,
// then commits what it projected, leaves the group and returns nil. It
// returns an error only when the Kafka client cannot be created.
func (p *Projector) Run(ctx context.Context) error {
	opts := append([]kgo.Opt{
		kgo.SeedBrokers(p.cfg.Brokers...),
		kgo.ConsumerGroup(p.cfg.Group),
		kgo.ConsumeTopics(p.cfg.Topic),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(p.onRevoked),
		kgo.OnPartitionsLost(p.onLost),
	}, p.cfg.KafkaOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("projector kafka client: %w", err)
	}
	p.log.InfoContext(ctx, "projector started", slog.String("topic", p.cfg.Topic), slog.String("group", p.cfg.Group))
	for ctx.Err() == nil {
		fetches := cl.PollRecords(ctx, p.cfg.MaxPollRecords)
		if fetches.IsClientClosed() || ctx.Err() != nil {
			cl.AllowRebalance()
			break
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			p.log.WarnContext(ctx, "projector fetch error", slog.String("topic", topic), slog.Int("partition", int(partition)), slog.Any("error", err))
		})
		aborted := false
		fetches.EachRecord(func(r *kgo.Record) {
			if aborted {
				return
			}
			if err := p.project(ctx, r); err != nil {
				aborted = true // ctx ended: r and the rest stay uncommitted
				return
			}
			p.markDone(r)
		})
		if !aborted {
			p.commit(ctx, cl, nil)
		}
		cl.AllowRebalance()
	}
	// Final commit of everything projected, then leave the group (which
	// runs onRevoked, committing again: harmless).
	cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	p.commit(cctx, cl, nil)
	cancel()
	cl.Close()
	p.log.Info("projector stopped")
	return nil
}

// project writes one record's task snapshot. It returns an error only when
// ctx ended before the write succeeded.
func (p *Projector) project(ctx context.Context, r *kgo.Record) error {
	ev, err := decodeRecord(r)
	if err != nil {
		p.events.WithLabelValues(outcomeInvalid).Inc()
		p.log.WarnContext(ctx, "projector skipped undecodable record",
			slog.String("topic", r.Topic), slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset), slog.Any("error", err))
		return nil
	}
	backoff := p.cfg.RetryBackoff
	for {
		stored, err := p.cache.Put(ctx, ev.Task)
		switch {
		case err == nil && stored:
			p.events.WithLabelValues(outcomeStored).Inc()
			return nil
		case err == nil:
			p.events.WithLabelValues(outcomeStale).Inc()
			return nil
		case errors.Is(err, ErrInvalidTask):
			p.events.WithLabelValues(outcomeInvalid).Inc()
			p.log.WarnContext(ctx, "projector skipped invalid task snapshot",
				slog.String("event_id", ev.EventID), slog.Int64("offset", r.Offset), slog.Any("error", err))
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.redisEr.Inc()
		p.log.WarnContext(ctx, "projector redis write failed, retrying",
			slog.String("task_id", ev.TaskID), slog.Duration("backoff", backoff), slog.Any("error", err))
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, p.cfg.MaxRetryBackoff)
	}
}

// decodeRecord decodes a record value and, when the record carries the
// payload-sha256 header, checks it against the value (seed 13.4: a payload
// that does not match its identity is not processed).
func decodeRecord(r *kgo.Record) (*taskevent.Event, error) {
	for _, h := range r.Headers {
		if h.Key == taskevent.HeaderPayloadSHA256 {
			if got := canon.SHA256Hex(r.Value); got != string(h.Value) {
				return nil, fmt.Errorf("%w: payload sha256 %s, header says %s", taskevent.ErrInvalidEvent, got, h.Value)
			}
		}
	}
	return taskevent.Decode(r.Value)
}

func (p *Projector) markDone(r *kgo.Record) {
	if r.Topic != p.cfg.Topic {
		return
	}
	p.mu.Lock()
	p.done[r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
	p.mu.Unlock()
}

// commit synchronously commits the projected offsets of the given partitions
// (all when only is nil). Only offsets of records whose view write finished
// are ever committed.
func (p *Projector) commit(ctx context.Context, cl *kgo.Client, only []int32) {
	p.mu.Lock()
	offsets := map[int32]kgo.EpochOffset{}
	if only == nil {
		for part, eo := range p.done {
			offsets[part] = eo
		}
	} else {
		for _, part := range only {
			if eo, ok := p.done[part]; ok {
				offsets[part] = eo
			}
		}
	}
	p.mu.Unlock()
	if len(offsets) == 0 {
		return
	}
	// The projections are written: commit them even when ctx was just
	// cancelled (shutdown), bounded by its own deadline.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var cerr error
	cl.CommitOffsetsSync(cctx, map[string]map[int32]kgo.EpochOffset{p.cfg.Topic: offsets},
		func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
			cerr = commitError(resp, err)
		})
	if cerr != nil {
		p.log.WarnContext(ctx, "projector offset commit failed (records will be projected again)", slog.Any("error", cerr))
	}
}

func (p *Projector) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	parts := revoked[p.cfg.Topic]
	p.commit(ctx, cl, parts)
	p.forget(parts)
}

func (p *Projector) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	p.forget(lost[p.cfg.Topic])
}

// forget drops partitions this member no longer owns, so that a later
// commit never rewinds another member's progress.
func (p *Projector) forget(parts []int32) {
	p.mu.Lock()
	for _, part := range parts {
		delete(p.done, part)
	}
	p.mu.Unlock()
}

// commitError returns the request error or the first partition error of an
// offset commit response.
func commitError(resp *kmsg.OffsetCommitResponse, err error) error {
	if err != nil {
		return err
	}
	if resp == nil {
		return nil
	}
	for _, t := range resp.Topics {
		for _, part := range t.Partitions {
			if perr := kerr.ErrorForCode(part.ErrorCode); perr != nil {
				return fmt.Errorf("commit %s[%d]: %w", t.Topic, part.Partition, perr)
			}
		}
	}
	return nil
}
