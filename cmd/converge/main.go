// Command converge runs the converge pipeline: `converge dev` runs everything
// in one process on embedded defaults (make run); `converge api|relay|worker|
// projector|reconciler` run one component each against real services;
// `converge submit` sends documents; `converge migrate` applies the schema.
//
// Every flag also reads a CONVERGE_* environment variable; README.md lists
// them all.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/internal/fault"
)

// Globals are the options every subcommand shares.
type Globals struct {
	LogLevel  string `env:"CONVERGE_LOG_LEVEL" default:"info" enum:"debug,info,warn,error" help:"Log level (debug, info, warn, error)."`
	LogFormat string `env:"CONVERGE_LOG_FORMAT" default:"text" enum:"text,json" help:"Log format (text or json)."`
	Faults    string `env:"CONVERGE_FAULTS" help:"Fault points to arm, name=action[@n],... (off by default; see 'converge faults')."`
}

// Services are the endpoints of the three external services.
type Services struct {
	DatabaseURL  string   `name:"database-url" env:"CONVERGE_DATABASE_URL" help:"PostgreSQL URL (wal_level=logical for the relay)."`
	KafkaBrokers []string `name:"kafka-brokers" env:"CONVERGE_KAFKA_BROKERS" sep:"," help:"Kafka bootstrap brokers, comma-separated."`
	RedisURL     string   `name:"redis-url" env:"CONVERGE_REDIS_URL" help:"Redis URL (redis://host:port/db)."`
}

// Pipeline are the settings shared by the components.
type Pipeline struct {
	Topic           string `env:"CONVERGE_TOPIC" default:"converge.task-events.v1" help:"Task-events topic."`
	TopicPartitions int32  `env:"CONVERGE_TOPIC_PARTITIONS" default:"4" help:"Partitions of the task-events topic when converge creates it."`
	SlotName        string `env:"CONVERGE_SLOT_NAME" default:"converge_outbox" help:"Logical replication slot of the relay."`
	PublicationName string `env:"CONVERGE_PUBLICATION_NAME" default:"converge_outbox" help:"Publication on outbox_event."`
	ArtifactDir     string `env:"CONVERGE_ARTIFACT_DIR" help:"Artifact store directory (default: <data-dir>/artifacts for dev, required otherwise)."`
}

// APIServer are the settings of the HTTP API, for `converge api` and the
// API inside `converge dev` (the other components neither take nor check
// them).
type APIServer struct {
	MaxBodyBytes   int64  `env:"CONVERGE_MAX_BODY_BYTES" default:"8388608" help:"Largest accepted POST /v1/tasks body in bytes (larger: 413)."`
	MaxInFlight    int    `name:"max-in-flight-per-tenant" env:"CONVERGE_MAX_IN_FLIGHT_PER_TENANT" default:"64" help:"API requests one tenant may have in process at once (more: 429 RATE_LIMITED)."`
	CreateBatchMax int    `name:"create-batch-max" env:"CONVERGE_CREATE_BATCH_MAX" default:"32" help:"Most concurrent POST /v1/tasks requests the API creates in one transaction (group commit; each keeps its own outcome); 1: each in its own transaction."`
	CreateTx       int    `name:"create-transactions" env:"CONVERGE_CREATE_TRANSACTIONS" default:"2" help:"Most group-commit create transactions the API runs at once (with --create-batch-max above 1); the requests that arrive meanwhile wait and join the next."`
	HTTPAddr       string `name:"http-addr" env:"CONVERGE_HTTP_ADDR" default:"127.0.0.1:8080" help:"API listen address (also serves /metrics)."`
	AdminAddr      string `name:"admin-addr" env:"CONVERGE_ADMIN_ADDR" default:"127.0.0.1:8081" help:"Listen address of the admin plane (/v1/admin/: dead letters, parked outbox rows, tenants; admin tokens only; also /metrics)."`
}

// WorkerTuning are the worker settings an operator may change.
type WorkerTuning struct {
	WorkerVisibilityTimeout time.Duration `env:"CONVERGE_WORKER_VISIBILITY_TIMEOUT" default:"30s" help:"How long the worker retries a record whose task it cannot see yet (its transaction committed but is not visible yet, e.g. waiting for a synchronous standby) before it dead-letters it as TASK_NOT_FOUND."`
}

// CLI is the command line.
type CLI struct {
	Globals

	Dev        DevCmd        `cmd:"" help:"Run the whole pipeline on embedded defaults (make run)."`
	API        APICmd        `cmd:"" name:"api" help:"Run the HTTP API."`
	Relay      RelayCmd      `cmd:"" help:"Run the CDC relay (outbox → Kafka)."`
	Worker     WorkerCmd     `cmd:"" help:"Run the worker consumer group."`
	Projector  ProjectorCmd  `cmd:"" help:"Run the Redis task-view projector."`
	Reconciler ReconcilerCmd `cmd:"" help:"Run the reconciler."`
	Migrate    MigrateCmd    `cmd:"" help:"Apply the database migrations."`
	Submit     SubmitCmd     `cmd:"" help:"Submit JSON files and wait for their tasks."`
	Loadgen    LoadgenCmd    `cmd:"" help:"Generate create load (fixed rate or N clients) and measure latency and throughput."`
	Bench      BenchCmd      `cmd:"" help:"Measure each stage against its physical limit on a fresh local PostgreSQL (make bench)."`
	DLQ        DLQCmd        `cmd:"" name:"dlq" help:"List, show and replay dead letters."`
	Outbox     OutboxCmd     `cmd:"" help:"List, show, republish and discard parked outbox rows."`
	Inbox      InboxCmd      `cmd:"" help:"List inbox conflicts."`
	Tenants    TenantsCmd    `cmd:"" help:"Add, list, rotate and disable tenants and their API tokens."`
	Experiment ExperimentCmd `cmd:"" help:"Run the seed's fault-injection experiments against the real pipeline."`
	FaultList  FaultsCmd     `cmd:"" name:"faults" help:"List the fault points."`
}

// defaultGCPercent is the garbage collector's target heap growth (percent of
// the live heap) the process runs with when GOGC is not set: 200 instead of
// Go's 100. The collector was about 9 % of the pipeline's CPU in the peer
// benchmark's profile; BENCHMARKS.md records what 200 saves per task and the
// relay's peak RSS with it. GOGC, when set, wins (GOGC=off included).
const defaultGCPercent = 200

// setGCPercent applies defaultGCPercent unless the environment sets GOGC.
func setGCPercent(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(defaultGCPercent)
	}
}

func main() {
	setGCPercent(os.Getenv)
	var cli CLI
	kctx := kong.Parse(&cli,
		kong.Name("converge"),
		kong.Description("Reliable document-conversion tasks through PostgreSQL, Kafka and Redis (at-least-once delivery plus deduplication)."),
		kong.ShortUsageOnError(), // the error, then one usage line and where the help is: not 90 lines of flags before the error
	)
	log := newLogger(cli.Globals)
	redis.SetLogger(redisLogger{log}) // go-redis's own messages (reconnects) into the structured log
	slog.SetDefault(log)
	faults, err := fault.Parse(cli.Faults)
	if err != nil {
		fmt.Fprintln(os.Stderr, "converge:", err)
		os.Exit(2)
	}
	if armed := faults.String(); armed != "" {
		log.Warn("FAULT POINTS ARMED: this process will fail on purpose (CONVERGE_FAULTS)", "faults", armed)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = kctx.Run(&runEnv{ctx: ctx, log: log, faults: faults})
	if err != nil && !errors.Is(err, context.Canceled) {
		var ec exitCode
		if errors.As(err, &ec) {
			os.Exit(int(ec))
		}
		fmt.Fprintln(os.Stderr, "converge:", err)
		os.Exit(1)
	}
}

// runEnv is what every subcommand's Run receives.
type runEnv struct {
	ctx    context.Context
	log    *slog.Logger
	faults *fault.Set
}

// exitCode ends the process with a status without printing an error.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

func newLogger(g Globals) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(g.LogLevel))
	opts := &slog.HandlerOptions{Level: lvl}
	if strings.EqualFold(g.LogFormat, "json") {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// FaultsCmd lists the fault points.
type FaultsCmd struct{}

// Run prints one fault point name per line.
func (FaultsCmd) Run(env *runEnv) error {
	for _, n := range fault.Names() {
		fmt.Println(n)
	}
	return nil
}

// redisLogger sends go-redis's internal messages (pool reconnects, dial
// failures) to slog at warn level instead of the standard log package.
type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.l.WarnContext(ctx, "redis: "+fmt.Sprintf(format, v...))
}
