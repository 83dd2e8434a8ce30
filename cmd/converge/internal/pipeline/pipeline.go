package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkametrics"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/schemas"
	"github.com/converge-run/converge/services/api"
)

// Config is what the pipeline connects to. Zero values take the defaults
// noted on each field.
type Config struct {
	// DatabaseURL of a PostgreSQL with wal_level=logical. Required.
	DatabaseURL string
	// Brokers are Kafka bootstrap addresses. Required.
	Brokers []string
	// RedisURL (redis://host:port/db). Required.
	RedisURL string
	// ArtifactDir is the artifact store directory. Required.
	ArtifactDir string
	// Topic defaults to taskevent.DefaultTopic.
	Topic string
	// Partitions of the topic when it is created. Defaults to 4.
	Partitions int32
	// SlotName and PublicationName of the relay. Default "converge_outbox".
	SlotName        string
	PublicationName string
	// Listener for the HTTP API; when nil one is opened on HTTPAddr.
	Listener net.Listener
	// AdminListener serves the admin plane (api.Server.ServeAdmin: the
	// /v1/admin/ endpoints); nil serves none.
	AdminListener net.Listener
	// HTTPAddr defaults to 127.0.0.1:8080.
	HTTPAddr string
	// MaxBodyBytes of a create request. Defaults to the API's default.
	MaxBodyBytes int64
	// MaxInFlightPerTenant of the API. Defaults to the API's default.
	MaxInFlightPerTenant int
	// CreateBatchMax of the API (group commit of creates). Defaults to the
	// API's default.
	CreateBatchMax int
	// CreateTransactions of the API (group commit transactions at once).
	// Defaults to the API's default.
	CreateTransactions int
	// Faults armed in every component. Defaults to none.
	Faults *fault.Set
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registry receives every component's metrics and is served on
	// /metrics. Defaults to a new registry with Go and process collectors.
	Registry *prometheus.Registry
	// Ready, when set, is called once the relay streams and the API
	// serves, with the API's address.
	Ready func(addr string)
	// LagSampleInterval is how often consumer-group lag is sampled
	// (kafkametrics.LagSampler: the worker and projector groups on Topic,
	// and every other group of the cluster). Defaults to 10s.
	LagSampleInterval time.Duration
	// RepairPublication of the relay (cdc.Config): `converge dev` sets it.
	RepairPublication bool
	// Finalize the schema after migrating it (schemas.Finalize): the
	// database then serves no binary older than this one, and the worker
	// writes artifact pack files. For a database that only this pipeline
	// uses: `converge dev`'s embedded one, the bench's and the
	// experiments'. Without it the pipeline writes pack files only where
	// the database was finalized before (schemas.Versions.ArtifactPacks).
	Finalize bool
	// HeartbeatInterval and SlotSampleInterval of the relay (cdc.Config).
	// Default to the relay's defaults (10s each).
	HeartbeatInterval  time.Duration
	SlotSampleInterval time.Duration
	// Worker tunes the worker (MaxAttempts, RetryBackoffMin/Max,
	// AttemptTimeout, ...); the pipeline sets its Pool, Brokers, Topic,
	// ArtifactStore, Logger, Registerer and Faults. Zero values take the
	// worker's defaults.
	Worker worker.Config
	// Reconciler tunes the reconciler (Interval, EffectDeadline,
	// TaskDeadline, InboxLease, OutboxThreshold, BatchSize); the pipeline
	// sets its Pool, ArtifactStore, Brokers, Topic, Redis, Logger,
	// Registerer and cache faults. Zero values take the reconciler's
	// defaults.
	Reconciler reconciler.Config
	// MaxReplays of a dead letter through the admin API
	// (deadletter.Config.MaxReplays). Defaults to deadletter's default (3).
	MaxReplays int
	// Supervised are more components of the process, run and restarted
	// like the pipeline's own (converge_component_restarts_total{component}
	// = Name): `converge dev` watches its embedded PostgreSQL this way.
	// Defaults to none.
	Supervised []Component
}

// Component is a supervised part of the process: Run runs until ctx ends
// (then it returns nil) or the component fails (an error, or nil before
// ctx ended); it is then called again after a backoff.
type Component struct {
	Name string
	Run  func(ctx context.Context) error
}

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.Partitions == 0 {
		c.Partitions = 4
	}
	if c.SlotName == "" {
		c.SlotName = "converge_outbox"
	}
	if c.PublicationName == "" {
		c.PublicationName = "converge_outbox"
	}
	if c.HTTPAddr == "" {
		c.HTTPAddr = "127.0.0.1:8080"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
		c.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
}

// Validate reports missing required fields.
func (c *Config) Validate() error {
	switch {
	case c.DatabaseURL == "":
		return errors.New("pipeline: DatabaseURL is required")
	case len(c.Brokers) == 0:
		return errors.New("pipeline: Brokers is required")
	case c.RedisURL == "":
		return errors.New("pipeline: RedisURL is required")
	case c.ArtifactDir == "":
		return errors.New("pipeline: ArtifactDir is required")
	}
	return nil
}

// Run migrates the database, starts every component and serves until ctx is
// cancelled; then it shuts the components down (the relay sends its final
// status update, consumers commit) and returns nil. A component that fails
// is restarted with backoff (converge_component_restarts_total) while the
// others keep running; a fatal error (the relay's: lost or mismatched
// slot; an injected crash; the API's listener) stops all of them and is
// returned. A publication mismatch is not one: the relay repairs it
// (RepairPublication) or waits for it to be fixed.
func Run(ctx context.Context, cfg Config) error {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := cfg.Logger
	// A pool per component, each with its application_name (what
	// pg_stat_activity shows) and pgxpool's default size: the API's
	// creates, the worker's transactions and the reconciler's passes do not
	// wait for each other's connections.
	pools := map[string]*pgxpool.Pool{}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	for _, who := range []string{"api", "worker", "reconciler"} {
		p, err := dbpool.New(ctx, cfg.DatabaseURL, "converge-"+who)
		if err != nil {
			return fmt.Errorf("connect database: %w", err)
		}
		pools[who] = p
	}
	if err := schemas.Migrate(ctx, pools["api"]); err != nil {
		return err
	}
	v, err := schemas.Check(ctx, pools["api"]) // a database a newer release migrated fails here
	if err != nil {
		return err
	}
	if cfg.Finalize && v.OldestBinary < v.Binary {
		from := v.OldestBinary
		if v, err = schemas.Finalize(ctx, pools["api"]); err != nil {
			return err
		}
		log.Info("schema finalized: it no longer serves binaries built before this one", slog.Int64("oldest_binary_was", from), slog.Int64("oldest_binary", v.OldestBinary))
	}
	ropt, err := taskview.ClientOptions(cfg.RedisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(ropt)
	defer rdb.Close()
	store, err := artifact.Open(cfg.ArtifactDir, cfg.Faults)
	if err != nil {
		return err
	}
	if !v.ArtifactPacks() {
		store.WriteOneObjectFiles()
		log.Info("artifacts are written one file per object: the database still serves binaries that cannot read pack files; `converge migrate --finalize` ends that", slog.Int64("oldest_binary", v.OldestBinary))
	}
	reg := cfg.Registry

	relay, err := cdc.New(cdc.Config{
		DatabaseURL: cfg.DatabaseURL, Brokers: cfg.Brokers, Topic: cfg.Topic, Partitions: cfg.Partitions,
		SlotName: cfg.SlotName, PublicationName: cfg.PublicationName, RepairPublication: cfg.RepairPublication,
		HeartbeatInterval: cfg.HeartbeatInterval, SlotSampleInterval: cfg.SlotSampleInterval,
		Logger: log.With("component", "relay"), Registerer: reg, Faults: cfg.Faults,
		KafkaOpts: []kgo.Opt{kafkametrics.ClientMetrics(reg, "relay")},
	})
	if err != nil {
		return err
	}
	wcfg := cfg.Worker
	wcfg.Pool, wcfg.Brokers, wcfg.Topic, wcfg.ArtifactStore = pools["worker"], cfg.Brokers, cfg.Topic, store
	wcfg.Logger, wcfg.Registerer, wcfg.Faults = log.With("component", "worker"), reg, cfg.Faults
	wcfg.KafkaOpts = append(wcfg.KafkaOpts, kafkametrics.ClientMetrics(reg, "worker"))
	wrk, err := worker.New(wcfg)
	if err != nil {
		return err
	}
	proj, err := taskview.New(taskview.Config{
		Brokers: cfg.Brokers, Topic: cfg.Topic, Redis: rdb, Cache: taskview.CacheOptions{Faults: cfg.Faults},
		Logger: log.With("component", "projector"), Registerer: reg,
		KafkaOpts: []kgo.Opt{kafkametrics.ClientMetrics(reg, "projector")},
	})
	if err != nil {
		return err
	}
	lag, err := kafkametrics.NewLagSampler(kafkametrics.LagConfig{
		Brokers: cfg.Brokers, AllGroups: true, Interval: cfg.LagSampleInterval,
		Groups: []kafkametrics.Group{
			{Name: worker.DefaultGroup, Topics: []string{cfg.Topic}},
			{Name: taskview.DefaultGroup, Topics: []string{cfg.Topic}},
			// The dead-letter intake: its lag shows from the start, not
			// only after the first dead letter.
			{Name: reconciler.DefaultDeadLetterGroup, Topics: []string{taskevent.DeadLetterTopic(cfg.Topic)}},
		},
		Logger: log.With("component", "lag"), Registerer: reg,
	})
	if err != nil {
		return err
	}
	// One producer for the dead-letter replays and the outbox
	// republications (the reconciler's and the admin API's).
	producer, err := cdc.NewRepublishProducer(cfg.Brokers)
	if err != nil {
		return fmt.Errorf("dead-letter replay producer: %w", err)
	}
	defer producer.Close()
	rcfg := cfg.Reconciler
	rcfg.Pool, rcfg.ArtifactStore, rcfg.Brokers, rcfg.Topic, rcfg.Redis = pools["reconciler"], store, cfg.Brokers, cfg.Topic, rdb
	rcfg.Logger, rcfg.Registerer, rcfg.Cache.Faults, rcfg.Faults = log.With("component", "reconciler"), reg, cfg.Faults, cfg.Faults
	rcfg.Producer = producer
	rec, err := reconciler.New(rcfg)
	if err != nil {
		return err
	}
	dls, err := deadletter.New(deadletter.Config{Pool: pools["reconciler"], Producer: producer, MaxReplays: cfg.MaxReplays,
		Logger: log.With("component", "deadletter"), Registerer: reg})
	if err != nil {
		return err
	}
	srv, err := api.New(api.Config{
		Pool: pools["api"], Redis: rdb, ArtifactStore: store, MaxBodyBytes: cfg.MaxBodyBytes, MaxInFlightPerTenant: cfg.MaxInFlightPerTenant, CreateBatchMax: cfg.CreateBatchMax, CreateTransactions: cfg.CreateTransactions, DeadLetters: dls,
		OutboxProducer: producer, Topic: cfg.Topic,
		Auth:   tenant.NewAuthenticator(pools["api"], 0),
		Logger: log.With("component", "api"), Registerer: reg, Gatherer: reg, Faults: cfg.Faults,
	})
	if err != nil {
		return err
	}

	ln := cfg.Listener
	if ln == nil {
		ln, err = net.Listen("tcp", cfg.HTTPAddr)
		if err != nil {
			return fmt.Errorf("listen %s: %w", cfg.HTTPAddr, err)
		}
	}

	names := []string{"relay", "worker", "projector", "reconciler", "lag_sampler"}
	for _, c := range cfg.Supervised {
		names = append(names, c.Name)
	}
	sup, err := newSupervisor(log, reg, names...)
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	// A component that fails is restarted while the others keep running
	// (issue 13); a fatal error stops the process with its message.
	run := func(name string, fatal func(error) bool, fn func(context.Context) error) {
		g.Go(func() error {
			if err := sup.run(gctx, name, fatal, fn); err != nil && !errors.Is(err, context.Canceled) {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	// The relay restarts its own sessions and waits out a publication
	// mismatch; what its Run returns needs a person (lost or mismatched
	// slot).
	run("relay", func(error) bool { return true }, relay.Run)
	run("worker", nil, wrk.Run)
	run("projector", nil, proj.Run)
	run("reconciler", nil, rec.Run)
	run("lag_sampler", nil, lag.Run)
	for _, c := range cfg.Supervised {
		run(c.Name, nil, c.Run)
	}
	g.Go(func() error {
		// Serve only once the relay streams from its slot: a row committed
		// before the slot exists would never be relayed.
		if err := waitStreaming(gctx, relay); err != nil {
			ln.Close()
			return nil
		}
		log.Info("relay streaming; API serving", "addr", ln.Addr().String())
		if cfg.Ready != nil {
			cfg.Ready(ln.Addr().String())
		}
		return srv.Serve(gctx, ln)
	})
	if cfg.AdminListener != nil {
		g.Go(func() error {
			if err := srv.ServeAdmin(gctx, cfg.AdminListener); err != nil && !errors.Is(err, context.Canceled) {
				return fmt.Errorf("admin api: %w", err)
			}
			return nil
		})
	}
	err = g.Wait()
	if err != nil {
		log.Error("pipeline stopped", "err", err)
	}
	return err
}

// waitStreaming returns once the relay has started streaming from its slot,
// or ctx's error.
func waitStreaming(ctx context.Context, r *cdc.Relay) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for r.ConfirmedLSN() == 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
