package taskview

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/clientid"
	"github.com/converge-run/converge/internal/consumergroup"
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
	// up to MaxRetryBackoff, with jitter (internal/backoff), and the write
	// is retried until it succeeds or Run's context ends. Defaults to 100ms.
	RetryBackoff time.Duration
	// MaxRetryBackoff caps RetryBackoff. Defaults to 5s.
	MaxRetryBackoff time.Duration
	// Logger receives structured logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the projector's metrics (see the package doc).
	// Defaults to a fresh prometheus.NewRegistry().
	Registerer prometheus.Registerer
	// KafkaOpts are appended to the client options the consumer-group
	// engine sets (internal/consumergroup), for TLS, SASL, metrics or test
	// tuning.
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
	return &Projector{cfg: cfg, cache: cache, log: cfg.Logger, events: events, redisEr: redisErrs}, nil
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
// returns an error only when the Kafka client cannot be created. The
// consumer-group rules are internal/consumergroup's: an offset is committed
// only after its record's view write finished.
func (p *Projector) Run(ctx context.Context) error {
	c, err := consumergroup.New(consumergroup.Config{
		Brokers: p.cfg.Brokers, Group: p.cfg.Group, Topics: []string{p.cfg.Topic},
		ClientID: clientid.Process("converge-projector"), // one id per process: see internal/devbroker
		Logger:   p.log, MaxPollRecords: p.cfg.MaxPollRecords, KafkaOpts: p.cfg.KafkaOpts,
	}, consumergroup.HandlerFunc(p.project))
	if err != nil {
		return fmt.Errorf("projector: %w", err)
	}
	p.log.InfoContext(ctx, "projector started", slog.String("topic", p.cfg.Topic), slog.String("group", p.cfg.Group))
	err = c.Run(ctx)
	p.log.Info("projector stopped")
	return err
}

// project writes the task snapshots of a partition's batch with one
// pipeline (Cache.PutMany), repeating the writes whose outcome is unknown
// (a Redis failure) with backoff, and returns how many records from the
// first have their view written or were skipped: all of them, unless ctx
// ended first (the rest stay uncommitted and come again).
func (p *Projector) project(ctx context.Context, b consumergroup.Batch) int {
	var pending []int // indexes into b.Records of the writes still to do
	var tasks []taskevent.Task
	for i, r := range b.Records {
		ev, err := decodeRecord(r)
		if err != nil {
			p.events.WithLabelValues(outcomeInvalid).Inc()
			p.log.WarnContext(ctx, "projector skipped undecodable record",
				slog.String("topic", r.Topic), slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset), slog.Any("error", err))
			continue
		}
		pending, tasks = append(pending, i), append(tasks, ev.Task)
	}
	for n := 0; len(pending) > 0; n++ {
		rs, err := p.cache.PutMany(ctx, tasks)
		var again []int
		var againTasks []taskevent.Task
		cause := err // what is logged when writes are repeated
		for k, i := range pending {
			switch {
			case err != nil:
			case rs[k].Err == nil && rs[k].Stored:
				p.events.WithLabelValues(outcomeStored).Inc()
				continue
			case rs[k].Err == nil:
				p.events.WithLabelValues(outcomeStale).Inc()
				continue
			case errors.Is(rs[k].Err, ErrInvalidTask):
				p.events.WithLabelValues(outcomeInvalid).Inc()
				p.log.WarnContext(ctx, "projector skipped invalid task snapshot",
					slog.String("task_id", tasks[k].TaskID), slog.Int64("offset", b.Records[i].Offset), slog.Any("error", rs[k].Err))
				continue
			default:
				cause = rs[k].Err
			}
			again, againTasks = append(again, i), append(againTasks, tasks[k])
		}
		if len(again) == 0 {
			break
		}
		pending, tasks = again, againTasks
		if ctx.Err() != nil {
			return pending[0]
		}
		p.redisEr.Inc()
		p.log.WarnContext(ctx, "projector redis write failed, retrying",
			slog.Int("views", len(pending)), slog.String("first_task_id", tasks[0].TaskID), slog.Int("attempt", n+1), slog.Any("error", cause))
		if !backoff.Sleep(ctx, p.cfg.RetryBackoff, p.cfg.MaxRetryBackoff, n) {
			return pending[0]
		}
	}
	return len(b.Records)
}

// decodeRecord checks a record against the task-events contract
// (taskevent.CheckRecord, as the worker does): a record that breaks it is
// skipped, counted invalid.
func decodeRecord(r *kgo.Record) (*taskevent.Event, error) {
	hdr := make(map[string]string, len(r.Headers))
	for _, h := range r.Headers {
		hdr[h.Key] = string(h.Value)
	}
	return taskevent.CheckRecord(r.Key, r.Value, hdr)
}
