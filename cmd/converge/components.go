package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/kafkametrics"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/schemas"
	"github.com/converge-run/converge/services/api"
)

// MetricsAddr is where a non-API component serves /metrics, /healthz and
// /readyz.
type MetricsAddr struct {
	MetricsAddr string `env:"CONVERGE_METRICS_ADDR" default:"127.0.0.1:9464" help:"Listen address of /metrics, /healthz and /readyz for relay, worker, projector and reconciler."`
}

func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// serveWith runs fn and a server of /metrics, /healthz (the process is
// alive: 200) and /readyz until ctx ends or either fails. /readyz answers
// 200 "ok" while ready is nil or returns nil, else 503 with the error's
// text (the relay's Health: a publication that does not deliver outbox
// inserts, with its fix).
func serveWith(ctx context.Context, addr string, reg *prometheus.Registry, ready func() error, fn func(context.Context) error) error {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil {
			if err := ready(); err != nil {
				w.Header().Set("Content-Type", "text/plain; charset=utf-8")
				w.WriteHeader(http.StatusServiceUnavailable)
				fmt.Fprintln(w, err.Error())
				return
			}
		}
		w.Write([]byte("ok\n"))
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listen %s: %w", addr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	g.Go(func() error {
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			srv.Shutdown(sctx)
		}()
		return fn(gctx)
	})
	return g.Wait()
}

func need(what, v string) error {
	if v == "" {
		return fmt.Errorf("%s is required", what)
	}
	return nil
}

// openPool opens the database pool of component who (application_name
// "converge-" + who) and checks that the database's schema serves this
// binary (schemas.Check: ErrSchemaBehind before `converge migrate`,
// ErrBinaryTooOld after a rollback across a migration that stopped serving
// it).
func openPool(ctx context.Context, url, who string) (*pgxpool.Pool, error) {
	pool, err := connectDB(ctx, url, who)
	if err != nil {
		return nil, err
	}
	if _, err := schemas.Check(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// connectDB is openPool without the schema check, for the commands that
// migrate the database themselves (migrate, dev, tenants add).
func connectDB(ctx context.Context, url, who string) (*pgxpool.Pool, error) {
	if err := need("CONVERGE_DATABASE_URL", url); err != nil {
		return nil, err
	}
	pool, err := dbpool.New(ctx, url, "converge-"+who)
	if err != nil {
		return nil, fmt.Errorf("connect database: %w", err)
	}
	return pool, nil
}

// openArtifacts opens the artifact store shared by API, worker and
// reconciler; CONVERGE_ARTIFACT_DIR is required. Its Puts write pack files
// only where the database's schema serves no binary that cannot read them
// (schemas.Versions.ArtifactPacks: after `converge migrate --finalize`),
// else one file per object.
func openArtifacts(dir string, env *runEnv, pool *pgxpool.Pool) (*artifact.Store, error) {
	if err := need("CONVERGE_ARTIFACT_DIR", dir); err != nil {
		return nil, err
	}
	v, err := schemas.Check(env.ctx, pool)
	if err != nil {
		return nil, err
	}
	store, err := artifact.Open(dir, env.faults)
	if err != nil {
		return nil, err
	}
	if !v.ArtifactPacks() {
		store.WriteOneObjectFiles()
	}
	return store, nil
}

func openRedis(url string) (*redis.Client, error) {
	if err := need("CONVERGE_REDIS_URL", url); err != nil {
		return nil, err
	}
	opt, err := taskview.ClientOptions(url)
	if err != nil {
		return nil, fmt.Errorf("redis url: %w", err)
	}
	return redis.NewClient(opt), nil
}

// APICmd runs the HTTP API.
type APICmd struct {
	Services
	Pipeline
	APIServer
	MaxReplays int `env:"CONVERGE_DLQ_MAX_REPLAYS" default:"3" help:"Replays allowed per dead-lettered message through POST /v1/admin/dead-letters/{id}/replay; the next request marks it refused."`
}

// Run serves the API until interrupted.
func (c *APICmd) Run(env *runEnv) error {
	pool, err := openPool(env.ctx, c.DatabaseURL, "api")
	if err != nil {
		return err
	}
	defer pool.Close()
	var rdb *redis.Client
	if c.RedisURL != "" {
		if rdb, err = openRedis(c.RedisURL); err != nil {
			return err
		}
		defer rdb.Close()
	}
	store, err := openArtifacts(c.ArtifactDir, env, pool)
	if err != nil {
		return err
	}
	reg := newRegistry()
	// The admin endpoints list and show dead letters and parked outbox rows
	// from PostgreSQL; a dead-letter replay and an outbox republication
	// produce to Kafka, so they need brokers (without them they answer 503
	// DEAD_LETTERS_UNAVAILABLE / OUTBOX_REPUBLISH_UNAVAILABLE saying so).
	dcfg := deadletter.Config{Pool: pool, MaxReplays: c.MaxReplays, Logger: env.log.With("component", "deadletter"), Registerer: reg}
	var producer *kgo.Client
	if len(c.KafkaBrokers) > 0 {
		producer, err = cdc.NewRepublishProducer(c.KafkaBrokers, kafkametrics.ClientMetrics(reg, "api"))
		if err != nil {
			return fmt.Errorf("dead-letter replay and outbox republish producer: %w", err)
		}
		defer producer.Close()
		dcfg.Producer = producer
	} else {
		env.log.Warn("no Kafka brokers (CONVERGE_KAFKA_BROKERS): dead-letter replays and outbox republications through the admin API answer 503")
	}
	dls, err := deadletter.New(dcfg)
	if err != nil {
		return err
	}
	srv, err := api.New(api.Config{Pool: pool, Redis: rdb, ArtifactStore: store, MaxBodyBytes: c.MaxBodyBytes, MaxInFlightPerTenant: c.MaxInFlight, CreateBatchMax: c.CreateBatchMax, CreateTransactions: c.CreateTx, DeadLetters: dls,
		OutboxProducer: producer, Topic: c.Topic, Auth: tenant.NewAuthenticator(pool, 0), Logger: env.log, Registerer: reg, Gatherer: reg, Faults: env.faults})
	if err != nil {
		return err
	}
	adminLn, err := net.Listen("tcp", c.AdminAddr)
	if err != nil {
		return fmt.Errorf("admin api listen %s: %w", c.AdminAddr, err)
	}
	g, gctx := errgroup.WithContext(env.ctx)
	g.Go(func() error { return srv.Run(gctx, c.HTTPAddr) })
	g.Go(func() error { return srv.ServeAdmin(gctx, adminLn) })
	return g.Wait()
}

// RelayCmd runs the CDC relay.
type RelayCmd struct {
	Services
	Pipeline
	MetricsAddr
	HeartbeatInterval time.Duration `env:"CONVERGE_RELAY_HEARTBEAT_INTERVAL" default:"10s" help:"Interval of the relay's WAL heartbeat (pg_logical_emit_message) that advances the slot while the outbox is idle; 0 disables it."`
}

// Run relays until interrupted, then sends the final status update.
func (c *RelayCmd) Run(env *runEnv) error {
	pool, err := openPool(env.ctx, c.DatabaseURL, "relay") // the schema check; the relay opens its own connections
	if err != nil {
		return err
	}
	pool.Close()
	reg := newRegistry()
	heartbeat := c.HeartbeatInterval
	if heartbeat == 0 {
		heartbeat = -1 // disabled (cdc.Config: zero means the default)
	}
	r, err := cdc.New(cdc.Config{DatabaseURL: c.DatabaseURL, Brokers: c.KafkaBrokers, Topic: c.Topic, Partitions: c.TopicPartitions,
		SlotName: c.SlotName, PublicationName: c.PublicationName, HeartbeatInterval: heartbeat,
		Logger: env.log, Registerer: reg, Faults: env.faults,
		KafkaOpts: []kgo.Opt{kafkametrics.ClientMetrics(reg, "relay")}})
	if err != nil {
		return err
	}
	return serveWith(env.ctx, c.MetricsAddr.MetricsAddr, reg, r.Health, r.Run)
}

// WorkerCmd runs the worker consumer group.
type WorkerCmd struct {
	Services
	Pipeline
	WorkerTuning
	MetricsAddr
}

// Run consumes until interrupted, then commits and leaves the group.
func (c *WorkerCmd) Run(env *runEnv) error {
	pool, err := openPool(env.ctx, c.DatabaseURL, "worker")
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := openArtifacts(c.ArtifactDir, env, pool)
	if err != nil {
		return err
	}
	reg := newRegistry()
	w, err := worker.New(worker.Config{Pool: pool, Brokers: c.KafkaBrokers, Topic: c.Topic, ArtifactStore: store,
		Logger: env.log, Registerer: reg, Faults: env.faults, VisibilityTimeout: c.WorkerVisibilityTimeout,
		KafkaOpts: []kgo.Opt{kafkametrics.ClientMetrics(reg, "worker")}})
	if err != nil {
		return err
	}
	return serveWith(env.ctx, c.MetricsAddr.MetricsAddr, reg, nil, w.Run)
}

// ProjectorCmd runs the Redis task-view projector.
type ProjectorCmd struct {
	Services
	Pipeline
	MetricsAddr
}

// Run projects until interrupted.
func (c *ProjectorCmd) Run(env *runEnv) error {
	rdb, err := openRedis(c.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	reg := newRegistry()
	p, err := taskview.New(taskview.Config{Brokers: c.KafkaBrokers, Topic: c.Topic, Redis: rdb, Logger: env.log, Registerer: reg,
		KafkaOpts: []kgo.Opt{kafkametrics.ClientMetrics(reg, "projector")}})
	if err != nil {
		return err
	}
	return serveWith(env.ctx, c.MetricsAddr.MetricsAddr, reg, nil, p.Run)
}

// ReconcilerCmd runs the reconciler.
type ReconcilerCmd struct {
	Services
	Pipeline
	MetricsAddr
	Retention
	LagInterval time.Duration `env:"CONVERGE_LAG_SAMPLE_INTERVAL" default:"10s" help:"Interval of the consumer-group lag sample the reconciler exports (every group of the cluster; needs --kafka-brokers)."`
}

// Retention is the reconciler's retention windows, for `converge
// reconciler` and the reconciler inside `converge dev`.
type Retention struct {
	OutboxRetention time.Duration `name:"outbox-retention" env:"CONVERGE_OUTBOX_RETENTION" default:"168h" help:"How long a published outbox row is kept before the retention scan removes it."`
	TaskRetention   time.Duration `name:"task-retention" env:"CONVERGE_TASK_RETENTION" default:"720h" help:"How long a terminal task is kept after its last update before the retention scan removes it with its artifact and every row of it (at least 24h and at least the outbox retention)."`
}

// Validate refuses API settings that are not counts of at least one,
// naming the flag and the variable (api.Config would take 0 for its
// default). kong calls it when it parses a command that embeds APIServer
// (`api`, `dev`), before anything starts; the other components do not
// read these settings and so do not refuse them.
func (p APIServer) Validate() error {
	for _, v := range []struct {
		n          int
		flag, name string
	}{
		{p.CreateBatchMax, "--create-batch-max", "CONVERGE_CREATE_BATCH_MAX"},
		{p.CreateTx, "--create-transactions", "CONVERGE_CREATE_TRANSACTIONS"},
		{p.MaxInFlight, "--max-in-flight-per-tenant", "CONVERGE_MAX_IN_FLIGHT_PER_TENANT"},
	} {
		if v.n < 1 {
			return fmt.Errorf("%s (%s) %d: want at least 1", v.flag, v.name, v.n)
		}
	}
	return nil
}

// check refuses windows the reconciler would not keep: an outbox retention
// under 1h, and a task retention of zero or less (which reconciler.Config
// would take for its default; it refuses the other short ones itself).
func (r Retention) check() error {
	if r.OutboxRetention < time.Hour {
		return fmt.Errorf("CONVERGE_OUTBOX_RETENTION %s: want at least 1h", r.OutboxRetention)
	}
	if r.TaskRetention <= 0 {
		return fmt.Errorf("CONVERGE_TASK_RETENTION %s: want at least 24h and at least CONVERGE_OUTBOX_RETENTION", r.TaskRetention)
	}
	return nil
}

// Run reconciles until interrupted.
func (c *ReconcilerCmd) Run(env *runEnv) error {
	pool, err := openPool(env.ctx, c.DatabaseURL, "reconciler")
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := openArtifacts(c.ArtifactDir, env, pool)
	if err != nil {
		return err
	}
	reg := newRegistry()
	if err := c.Retention.check(); err != nil {
		return err
	}
	rcfg := reconciler.Config{Pool: pool, ArtifactStore: store, Logger: env.log, Registerer: reg, OutboxRetention: c.OutboxRetention,
		TaskRetention: c.TaskRetention, Faults: env.faults,
		Brokers: c.KafkaBrokers, Topic: c.Topic, Cache: taskview.CacheOptions{Faults: env.faults}}
	if c.RedisURL != "" {
		rdb, err := openRedis(c.RedisURL)
		if err != nil {
			return err
		}
		defer rdb.Close()
		rcfg.Redis = rdb
	}
	if len(c.KafkaBrokers) > 0 {
		// Republishes the outbox rows the slot did not deliver.
		producer, err := kgo.NewClient(kgo.SeedBrokers(c.KafkaBrokers...), kgo.RequiredAcks(kgo.AllISRAcks()))
		if err != nil {
			return err
		}
		defer producer.Close()
		rcfg.Producer = producer
	}
	r, err := reconciler.New(rcfg)
	if err != nil {
		return err
	}
	if len(c.KafkaBrokers) == 0 {
		env.log.Warn("no Kafka brokers: consumer-group lag is not sampled")
		return serveWith(env.ctx, c.MetricsAddr.MetricsAddr, reg, nil, r.Run)
	}
	// Consumer-group lag of the whole deployment is sampled here, once.
	lag, err := kafkametrics.NewLagSampler(kafkametrics.LagConfig{Brokers: c.KafkaBrokers, AllGroups: true,
		Groups: []kafkametrics.Group{
			{Name: worker.DefaultGroup, Topics: []string{c.Topic}},
			{Name: taskview.DefaultGroup, Topics: []string{c.Topic}},
			{Name: reconciler.DefaultDeadLetterGroup, Topics: []string{taskevent.DeadLetterTopic(c.Topic)}},
		},
		Interval: c.LagInterval, Logger: env.log.With("component", "lag"), Registerer: reg})
	if err != nil {
		return err
	}
	return serveWith(env.ctx, c.MetricsAddr.MetricsAddr, reg, nil, func(ctx context.Context) error {
		g, gctx := errgroup.WithContext(ctx)
		g.Go(func() error { return r.Run(gctx) })
		g.Go(func() error { return lag.Run(gctx) })
		return g.Wait()
	})
}

// MigrateCmd applies the migrations.
type MigrateCmd struct {
	DatabaseURL string `name:"database-url" env:"CONVERGE_DATABASE_URL" help:"PostgreSQL URL."`
	Finalize    bool   `help:"After migrating, end the upgrade: the schema stops serving binaries older than this one (a rollback to the previous release is then refused), and components started afterwards write artifact pack files. Run it once every component runs this release."`
}

// Run applies every pending migration.
func (c *MigrateCmd) Run(env *runEnv) error {
	pool, err := connectDB(env.ctx, c.DatabaseURL, "migrate")
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := schemas.Migrate(env.ctx, pool); err != nil {
		return err
	}
	// A newer release may have migrated the database past what this
	// binary's components can run on: then nothing was applied, and
	// migrate fails as they would (ErrBinaryTooOld).
	v, err := schemas.Check(env.ctx, pool)
	if err != nil {
		return err
	}
	fmt.Printf("migrations applied: the database is at migration %d, this binary's is %d\n", v.Database, v.Binary)
	if c.Finalize {
		if v, err = schemas.Finalize(env.ctx, pool); err != nil {
			return err
		}
		fmt.Printf("finalized: the schema serves binaries built for migration %d or later\n", v.OldestBinary)
	} else if !v.ArtifactPacks() {
		fmt.Printf("the schema serves binaries built for migration %d or later, so components write one artifact file per object; `converge migrate --finalize` ends the upgrade\n", v.OldestBinary)
	}
	return nil
}

// SubmitCmd submits JSON files.
type SubmitCmd struct {
	APIURL      string        `name:"api-url" env:"CONVERGE_API_URL" default:"http://127.0.0.1:8080" help:"Base URL of the converge API."`
	Concurrency int           `default:"8" help:"Documents in flight at once."`
	Timeout     time.Duration `default:"120s" help:"How long to wait for each task to become terminal."`
	Paths       []string      `arg:"" name:"path" help:"JSON files or directories (walked for *.json)." type:"path"`
	Token       string        `env:"CONVERGE_TOKEN" help:"API token of the tenant to submit as (default: the dev tenant's token of converge dev's --data-dir)."`
	DataDir     string        `env:"CONVERGE_DATA_DIR" default:".converge" help:"Data directory of a converge dev whose dev token is used when --token is not set."`
}

// Run submits and prints one line per document; exits 1 when any document
// did not complete.
func (c *SubmitCmd) Run(env *runEnv) error {
	tok, err := clientToken(c.Token, c.DataDir)
	if err != nil {
		return err
	}
	cl := &submit.Client{BaseURL: c.APIURL, Token: tok}
	s, err := submit.Run(env.ctx, os.Stdout, cl, c.Paths, c.Concurrency, c.Timeout)
	if err != nil {
		return err
	}
	if !s.OK() {
		return exitCode(1)
	}
	return nil
}
