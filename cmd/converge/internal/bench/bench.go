package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/converge-run/converge/internal/freeport"
	"github.com/converge-run/converge/internal/tenant"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
	"github.com/converge-run/converge/schemas"
)

// Stage names, in the order they run.
const (
	StageCreate = "create"
	StageRelay  = "relay"
	StageRSS    = "rss"
	StageWorker = "worker"
	StageE2E    = "e2e"
	StagePeer   = "peer"
)

// StageAB runs only when asked for (Config.ABBinaries): two converge
// executables side by side.
const StageAB = "ab"

// AllStages is every stage that runs by default, in order; StageAB runs
// after them when it is asked for.
var AllStages = []string{StageCreate, StageRelay, StageRSS, StageWorker, StageE2E, StagePeer}

// knownStages is AllStages and StageAB.
var knownStages = append(slices.Clone(AllStages), StageAB)

// Config sizes a run. Zero values take the defaults of Full; Quick and Tiny
// return smaller sizes.
type Config struct {
	// Stages to run, a subset of AllStages. Defaults to all.
	Stages []string
	// Runs is how many times each measurement is repeated (the median is
	// reported). Defaults to 3.
	Runs int
	// CreateClients are the client counts of the create stage. Defaults to
	// 1, 4, 16, 64.
	CreateClients []int
	// CreateDuration of each create measurement (API and pgbench alike,
	// whole seconds). Defaults to 5s.
	CreateDuration time.Duration
	// RelayRows is the size of the pre-filled outbox of the relay stage,
	// one row per transaction. Defaults to 200000.
	RelayRows int
	// RSSRows is the size of the single transaction the relay subprocess
	// relays while its peak RSS is sampled. Defaults to 1000000.
	RSSRows int
	// WorkerTasks is the number of pre-filled TaskCreated events of the
	// worker stage (and of tasks pgbench processes). Defaults to 10000.
	WorkerTasks int
	// E2ERates are the fixed rates (tasks/s) of the end-to-end ladder; the
	// ladder stops at the first rate that misses the 1 s p99 target, but
	// 500/s is always measured. Defaults to 100, 200, 300, 400, 500, 750,
	// 1000, 1500, 2000.
	E2ERates []float64
	// E2EStep is the sending time of each end-to-end step. Defaults to 8s.
	E2EStep time.Duration
	// Partitions of the task-events topics of the worker and end-to-end
	// stages. Defaults to 4, the pipeline's default.
	Partitions int
	// WorkerConcurrency is worker.Config.Concurrency in the worker and
	// end-to-end stages, and the client count of the worker stage's
	// pgbench. Defaults to 4, the worker's default.
	WorkerConcurrency int
	// DocSize is the size in bytes of every generated document. Defaults to
	// 1024.
	DocSize int
	// PeerTasks is the number of tasks of each run of the peer stage
	// (converge against River, same job). Defaults to 20000.
	PeerTasks int
	// RetentionReconcilers is the number of reconcilers removing the peer
	// stage's tasks in its retention measurement (PeerResult.Retention):
	// the pipeline's own and RetentionReconcilers-1 more in this process,
	// on the same database and artifact directory, as replicas of
	// `converge reconciler` would run. Defaults to 1.
	RetentionReconcilers int
	// RiverDir is the source directory of the peer stage's River program
	// (a module of its own). Defaults to
	// cmd/converge/internal/bench/riverpeer, relative to the working
	// directory (make bench runs from the repository root).
	RiverDir string
	// Loadgen is the converge executable whose `converge loadgen` the peer
	// and ab stages run. Defaults to this executable.
	Loadgen string
	// ABBinaries are the two converge executables (A, B) the ab stage runs
	// side by side; required by, and only used by, that stage.
	ABBinaries []string
	// Dir holds the cluster, broker and artifact data; removed at the end
	// when it was created by Run. Defaults to a new temporary directory.
	Dir string
	// RelayCommand starts a relay process (the RSS stage); the relay's
	// settings are passed as CONVERGE_* environment variables. Defaults to
	// this executable with the argument "relay" (converge relay).
	RelayCommand []string
	// ProfileDir, when set, receives CPU profiles of this process: create
	// at 16 clients, the first relay and worker runs, the first run of
	// every end-to-end rate.
	ProfileDir string
	// NoFsync turns fsync off in PostgreSQL and kfake. Only for the test
	// that proves the driver works; results are meaningless with it.
	NoFsync bool
	// Statements loads pg_stat_statements into the cluster and reports,
	// for every peer run, the costliest statements of its database per
	// task (PeerRun.Statements). Off by default: the module's bookkeeping
	// is a cost of its own in every statement.
	Statements bool
	// Logger receives the components' logs (they log at info level as in
	// production). Defaults to a text logger on Dir/components.log.
	Logger *slog.Logger
	// Progress receives one line per measurement. Defaults to io.Discard.
	Progress io.Writer
}

// Quick returns a configuration that runs every stage in about two minutes.
func Quick() Config {
	return Config{Runs: 3, CreateClients: []int{1, 4, 16, 64}, CreateDuration: 2 * time.Second, RelayRows: 20000, RSSRows: 50000,
		WorkerTasks: 1500, E2ERates: []float64{100, 250, 500}, E2EStep: 3 * time.Second, PeerTasks: 2000}
}

// Tiny returns the smallest configuration, for the test that proves the
// driver still works (seconds, not minutes). It leaves the peer stage out:
// building River needs the module proxy.
func Tiny() Config {
	return Config{Runs: 1, CreateClients: []int{1, 4}, CreateDuration: time.Second, RelayRows: 300, RSSRows: 1000,
		WorkerTasks: 60, E2ERates: []float64{20}, E2EStep: time.Second,
		Stages: []string{StageCreate, StageRelay, StageRSS, StageWorker, StageE2E}}
}

func (c *Config) setDefaults() {
	if len(c.Stages) == 0 {
		c.Stages = AllStages
	}
	if c.Runs <= 0 {
		c.Runs = 3
	}
	if len(c.CreateClients) == 0 {
		c.CreateClients = []int{1, 4, 16, 64}
	}
	if c.CreateDuration < time.Second {
		c.CreateDuration = 5 * time.Second
	}
	c.CreateDuration = c.CreateDuration.Round(time.Second)
	if c.RelayRows <= 0 {
		c.RelayRows = 200000
	}
	if c.RSSRows <= 0 {
		c.RSSRows = 1000000
	}
	if c.WorkerTasks <= 0 {
		c.WorkerTasks = 10000
	}
	if len(c.E2ERates) == 0 {
		c.E2ERates = []float64{100, 200, 300, 400, 500, 750, 1000, 1500, 2000}
	}
	if c.E2EStep <= 0 {
		c.E2EStep = 8 * time.Second
	}
	if c.DocSize <= 0 {
		c.DocSize = 1024
	}
	if c.Partitions <= 0 {
		c.Partitions = 4
	}
	if c.RetentionReconcilers <= 0 {
		c.RetentionReconcilers = 1
	}
	if c.PeerTasks <= 0 {
		c.PeerTasks = 20000
	}
	if c.RiverDir == "" {
		c.RiverDir = filepath.Join("cmd", "converge", "internal", "bench", "riverpeer")
	}
	if c.WorkerConcurrency <= 0 {
		c.WorkerConcurrency = 4
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
}

// Validate reports an unknown stage, and an ab stage without two
// executables, executables without the ab stage, or an executable that is
// not one; it makes ABBinaries absolute paths.
func (c *Config) Validate() error {
	for _, s := range c.Stages {
		if !slices.Contains(knownStages, s) {
			return fmt.Errorf("bench: unknown stage %q (want %s)", s, strings.Join(knownStages, ", "))
		}
	}
	ab := slices.Contains(c.Stages, StageAB)
	switch {
	case ab && len(c.ABBinaries) != 2:
		return fmt.Errorf("bench: the ab stage needs two converge executables (--ab-binaries A,B), got %d", len(c.ABBinaries))
	case !ab && len(c.ABBinaries) > 0:
		return errors.New("bench: --ab-binaries is for the ab stage (--stages ab)")
	}
	// Each executable found now (a name without a slash in PATH), as an
	// absolute path: not after the cluster started.
	bins := slices.Clone(c.ABBinaries)
	for i, b := range bins {
		p, err := exec.LookPath(b)
		if err != nil {
			return fmt.Errorf("bench: --ab-binaries: %w", err)
		}
		if bins[i], err = filepath.Abs(p); err != nil {
			return err
		}
	}
	c.ABBinaries = bins
	return nil
}

// Results is everything one run measured; it is written as JSON.
type Results struct {
	Date     string        `json:"date"`
	Command  string        `json:"command"`
	Machine  Machine       `json:"machine"`
	Settings Settings      `json:"settings"`
	Create   []CreatePoint `json:"create,omitempty"`
	Relay    *RelayResult  `json:"relay,omitempty"`
	RSS      *RSSResult    `json:"relay_rss,omitempty"`
	Worker   *WorkerResult `json:"worker,omitempty"`
	E2E      *E2EResult    `json:"end_to_end,omitempty"`
	Peer     *PeerResult   `json:"peer,omitempty"`
	AB       *ABResult     `json:"ab,omitempty"`
	// Errors of stages that could not finish (the others still ran).
	Errors map[string]string `json:"errors,omitempty"`
	// TotalSeconds of the run.
	TotalSeconds float64 `json:"total_seconds"`
}

// dropStage removes the results of stage.
func (r *Results) dropStage(stage string) {
	switch stage {
	case StageCreate:
		r.Create = nil
	case StageRelay:
		r.Relay = nil
	case StageRSS:
		r.RSS = nil
	case StageWorker:
		r.Worker = nil
	case StageE2E:
		r.E2E = nil
	case StagePeer:
		r.Peer = nil
	case StageAB:
		r.AB = nil
	}
}

// Settings records the sizes used.
type Settings struct {
	Runs            int       `json:"runs"`
	CreateClients   []int     `json:"create_clients"`
	CreateSeconds   float64   `json:"create_seconds"`
	RelayRows       int       `json:"relay_rows"`
	RSSRows         int       `json:"rss_rows"`
	WorkerTasks     int       `json:"worker_tasks"`
	E2ERates        []float64 `json:"e2e_rates"`
	E2EStepSeconds  float64   `json:"e2e_step_seconds"`
	DocSize         int       `json:"doc_size"`
	Fsync           bool      `json:"fsync"`
	PostgresVersion string    `json:"postgres_version"`
	GoVersion       string    `json:"go_version"`
}

// Run executes the configured stages and returns their results. A stage
// that fails is recorded in Results.Errors and the next one runs; Run
// returns an error only when the environment cannot be started.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	res := &Results{Date: start.UTC().Format(time.RFC3339), Command: strings.Join(os.Args, " "), Machine: machine(),
		Errors: map[string]string{}}
	res.Settings = Settings{Runs: cfg.Runs, CreateClients: cfg.CreateClients, CreateSeconds: cfg.CreateDuration.Seconds(),
		RelayRows: cfg.RelayRows, RSSRows: cfg.RSSRows, WorkerTasks: cfg.WorkerTasks, E2ERates: cfg.E2ERates,
		E2EStepSeconds: cfg.E2EStep.Seconds(), DocSize: cfg.DocSize, Fsync: !cfg.NoFsync, GoVersion: runtime.Version()}
	e, err := startEnv(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	defer e.close()
	_ = e.admin.QueryRow(ctx, "SHOW server_version").Scan(&res.Settings.PostgresVersion)

	stages := map[string]func(context.Context, *env, *Results) error{
		StageCreate: runCreate,
		StageRelay:  runRelay,
		StageRSS:    runRSS,
		StageWorker: runWorker,
		StageE2E:    runE2E,
		StagePeer:   runPeer,
		StageAB:     runAB,
	}
	for _, s := range knownStages {
		if !slices.Contains(cfg.Stages, s) || ctx.Err() != nil {
			continue
		}
		e.progress("== stage %s (load %s)", s, loadavg())
		err := stages[s](ctx, e, res)
		switch {
		case ctx.Err() != nil:
			// Interrupted: its runs so far are not its measurement (their
			// medians would count the unfinished runs as zeros).
			res.dropStage(s)
			res.Errors[s] = "interrupted: its partial measurements were dropped"
			e.progress("stage %s interrupted", s)
		case err != nil:
			res.Errors[s] = err.Error()
			e.progress("stage %s failed: %v", s, err)
		}
		e.settle(ctx)
	}
	res.Machine.LoadAvgAfter = loadavg()
	res.TotalSeconds = time.Since(start).Seconds()
	return res, ctx.Err()
}

// settle ends a stage so that the next one does not pay for it: it drops
// the stage's databases (their replication slots first) and runs a
// CHECKPOINT. Without it, autovacuum of the relay stages' 1.2 million
// updated outbox rows and the checkpoint of their WAL ran during the
// end-to-end stage and took a core from it.
//
// It runs also after an interrupt (ctx ended): its statements have a
// context of their own, so that a kept cluster (--dir) is left without the
// stage's databases.
func (e *env) settle(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	e.reconnectAdmin(ctx)
	start := time.Now()
	n := 0
	for _, db := range e.dbs {
		dropSlots(e, db)
		if _, err := e.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)"); err != nil {
			e.progress("settle: drop database %s: %v", db, err)
			continue
		}
		n++
	}
	e.dbs = nil
	if _, err := e.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		e.progress("settle: checkpoint: %v", err)
	}
	e.progress("settle: dropped %d databases, checkpoint, %.1fs", n, time.Since(start).Seconds())
}

// env is the shared environment of a run.
type env struct {
	dbs      []string // databases created by newDB since the last settle
	peerDirs []string // artifact directories of the River runs (removed when the peer stage ends)
	cfg      *Config
	dir      string
	ownDir   bool
	log      *slog.Logger
	logFile  *os.File
	pg       *localpg.Cluster
	pgData   string
	admin    *pgx.Conn
	kafka    *kfake.Cluster
	brokers  []string
	redis    *localredis.Server
	redisURL string
}

func startEnv(ctx context.Context, cfg *Config) (_ *env, err error) {
	e := &env{cfg: cfg, dir: cfg.Dir}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.dir == "" {
		if e.dir, err = os.MkdirTemp("", "converge-bench-"); err != nil {
			return nil, err
		}
		e.ownDir = true
	}
	// PostgreSQL runs as the postgres user when we are root: it must be
	// able to enter the directory. A --dir that does not exist is made;
	// one that exists keeps its mode (a sticky /tmp stays sticky), with
	// search permission added when it lacks it.
	if err := os.MkdirAll(e.dir, 0o755); err != nil {
		return nil, err
	}
	fi, err := os.Stat(e.dir)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o011 != 0o011 {
		if err := os.Chmod(e.dir, fi.Mode()|0o011); err != nil {
			return nil, err
		}
	}
	e.log = cfg.Logger
	if e.log == nil {
		if e.logFile, err = os.Create(filepath.Join(e.dir, "components.log")); err != nil {
			return nil, err
		}
		e.log = slog.New(slog.NewTextHandler(e.logFile, nil))
	}
	if _, err := exec.LookPath("pgbench"); err != nil {
		bin, berr := localpg.BinDir()
		if berr != nil {
			return nil, berr
		}
		if _, err := os.Stat(filepath.Join(bin, "pgbench")); err != nil {
			return nil, fmt.Errorf("pgbench not found next to the PostgreSQL server binaries in %s", bin)
		}
	}
	port, err := freeport.Pick()
	if err != nil {
		return nil, err
	}
	e.pgData = filepath.Join(e.dir, "pg")
	var settings map[string]string
	if cfg.Statements {
		settings = statementsSettings
	}
	e.pg, err = localpg.Start(ctx, localpg.Config{DataDir: e.pgData, Port: port, Fsync: !cfg.NoFsync, Settings: settings, Logger: e.log})
	if err != nil {
		return nil, fmt.Errorf("start PostgreSQL: %w", err)
	}
	if e.admin, err = pgx.Connect(ctx, e.pg.URL("postgres")); err != nil {
		return nil, err
	}
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.DataDir(filepath.Join(e.dir, "kafka")), kfake.DefaultNumPartitions(4)}
	if !cfg.NoFsync {
		opts = append(opts, kfake.SyncWrites())
	}
	if e.kafka, err = kfake.NewCluster(opts...); err != nil {
		return nil, fmt.Errorf("start kfake: %w", err)
	}
	e.brokers = e.kafka.ListenAddrs()
	rport, err := freeport.Pick()
	if err != nil {
		return nil, err
	}
	if e.redis, err = localredis.Start(ctx, localredis.Config{Port: rport, Dir: filepath.Join(e.dir, "redis")}); err != nil {
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	e.redisURL = e.redis.URL()
	return e, nil
}

func (e *env) close() {
	if e.redis != nil {
		e.redis.Stop()
	}
	if e.kafka != nil {
		e.kafka.Close()
	}
	if e.admin != nil {
		e.admin.Close(context.Background())
	}
	if e.pg != nil {
		e.pg.Stop()
	}
	if e.logFile != nil {
		e.logFile.Close()
	}
	if e.ownDir {
		os.RemoveAll(e.dir)
	}
}

func (e *env) progress(format string, args ...any) {
	fmt.Fprintf(e.cfg.Progress, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// loadgenExecutable is Config.Loadgen, or this executable.
func (e *env) loadgenExecutable() (string, error) {
	if e.cfg.Loadgen != "" {
		return e.cfg.Loadgen, nil
	}
	return os.Executable()
}

// reconnectAdmin replaces the admin connection when it is closed: pgx
// closes a connection whose context ends during a statement, as an
// interrupt does, and settle must still drop the stage's databases.
func (e *env) reconnectAdmin(ctx context.Context) {
	if !e.admin.IsClosed() {
		return
	}
	conn, err := pgx.Connect(ctx, e.pg.URL("postgres"))
	if err != nil {
		e.progress("settle: reconnect: %v", err)
		return
	}
	e.admin = conn
}

// createDB creates database name, empty, for the current stage (settle
// drops it). A database of that name left by an interrupted run in the same
// --dir is dropped first, with its replication slots.
func (e *env) createDB(ctx context.Context, name string) error {
	dropSlots(e, name)
	if _, err := e.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop the earlier database %s: %w", name, err)
	}
	if _, err := e.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	e.dbs = append(e.dbs, name)
	return nil
}

// newDB creates and migrates database name and returns its URL and a pool.
func (e *env) newDB(ctx context.Context, name string) (string, *pgxpool.Pool, error) {
	if err := e.createDB(ctx, name); err != nil {
		return "", nil, err
	}
	u := e.pg.URL(name)
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		return "", nil, err
	}
	if err := schemas.Migrate(ctx, pool); err != nil {
		pool.Close()
		return "", nil, err
	}
	return u, pool, nil
}

// benchTenant adds the tenant a stage's load is sent as (no quota) and
// returns it with its API token.
func benchTenant(ctx context.Context, pool *pgxpool.Pool) (tenant.Tenant, string, error) {
	t, tok, err := tenant.Add(ctx, pool, "bench", false, nil)
	if err != nil {
		return tenant.Tenant{}, "", fmt.Errorf("bench tenant: %w", err)
	}
	return t, tok, nil
}

// benchTenants adds n tenants without quota (bench-1 … bench-n) and
// returns their API tokens.
func benchTenants(ctx context.Context, pool *pgxpool.Pool, n int) ([]string, error) {
	toks := make([]string, n)
	for i := range toks {
		_, tok, err := tenant.Add(ctx, pool, fmt.Sprintf("bench-%d", i+1), false, nil)
		if err != nil {
			return nil, fmt.Errorf("bench tenant %d: %w", i+1, err)
		}
		toks[i] = tok
	}
	return toks, nil
}

// profile starts a CPU profile named name when ProfileDir is set; the
// returned function stops it. Beside name.pprof it writes the process's
// cumulative allocation profile at the start and at the stop
// (name.allocs-start.pprof, name.allocs.pprof): the stage's allocations are
// `go tool pprof -base name.allocs-start.pprof name.allocs.pprof`.
func (e *env) profile(name string) func() {
	if e.cfg.ProfileDir == "" {
		return func() {}
	}
	if err := os.MkdirAll(e.cfg.ProfileDir, 0o755); err != nil {
		return func() {}
	}
	f, err := os.Create(filepath.Join(e.cfg.ProfileDir, name+".pprof"))
	if err != nil {
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return func() {}
	}
	e.writeAllocs(name + ".allocs-start")
	return func() {
		pprof.StopCPUProfile()
		f.Close()
		e.writeAllocs(name + ".allocs")
	}
}

// writeAllocs writes the cumulative allocation profile to ProfileDir/name.pprof;
// a failure only loses that file.
func (e *env) writeAllocs(name string) {
	f, err := os.Create(filepath.Join(e.cfg.ProfileDir, name+".pprof"))
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup("allocs").WriteTo(f, 0)
}

// median returns the median of xs (the mean of the two middle values for an
// even count), 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
