package main

import (
	"context"
	"crypto/rand"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/devbroker"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/schemas"
)

//go:embed examples/*.json
var examples embed.FS

// DevCmd runs the whole pipeline in one process. Each external service is
// started locally unless its URL is given.
type DevCmd struct {
	Services
	Pipeline
	APIServer
	WorkerTuning
	Retention
	DataDir     string `env:"CONVERGE_DATA_DIR" default:".converge" help:"Directory of the embedded services' data (PostgreSQL cluster, Kafka log, Redis, artifacts)."`
	PGPort      int    `name:"pg-port" env:"CONVERGE_DEV_PG_PORT" default:"54329" help:"Port of the embedded PostgreSQL."`
	KafkaPort   int    `env:"CONVERGE_DEV_KAFKA_PORT" default:"19092" help:"Port of the embedded Kafka-protocol broker (kfake)."`
	RedisPort   int    `env:"CONVERGE_DEV_REDIS_PORT" default:"56379" help:"Port of the embedded redis-server."`
	NoExamples  bool   `env:"CONVERGE_DEV_NO_EXAMPLES" help:"Do not submit the example documents at start-up."`
	KafkaNoSync bool   `env:"CONVERGE_DEV_KAFKA_NO_SYNC" help:"Do not fsync every produced batch in the embedded broker (faster, loses acknowledged records on a machine crash)."`
}

// Run starts the embedded services, the pipeline, submits the examples and
// serves until interrupted.
func (c *DevCmd) Run(env *runEnv) error {
	ctx, log := env.ctx, env.log
	if err := c.Retention.check(); err != nil {
		return err
	}
	dataDir, err := filepath.Abs(c.DataDir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return err
	}
	// The PostgreSQL server runs as the postgres user when we are root: it
	// must be able to enter the data directory.
	_ = os.Chmod(dataDir, 0o755)
	unlock, err := lockDataDir(dataDir)
	if err != nil {
		return err
	}
	defer unlock()

	// The API's addresses first: an address in use fails the start at
	// once, before the embedded services take their seconds to start (and
	// requests that arrive meanwhile wait in the listen backlog).
	ln, err := net.Listen("tcp", c.HTTPAddr)
	if err != nil {
		return fmt.Errorf("API listen %s: %w", c.HTTPAddr, err)
	}
	defer ln.Close()
	apiURL := "http://" + ln.Addr().String()
	adminLn, err := net.Listen("tcp", c.AdminAddr)
	if err != nil {
		return fmt.Errorf("admin API listen %s: %w", c.AdminAddr, err)
	}
	defer adminLn.Close()

	var supervised []pipeline.Component
	dbURL := c.DatabaseURL
	if dbURL == "" {
		pw, err := devSecret(dataDir, "postgres.password")
		if err != nil {
			return err
		}
		sup, pg, err := embeddedPostgres(ctx, localpg.Config{DataDir: filepath.Join(dataDir, "pg"), Port: c.PGPort, Fsync: true, Password: pw, Logger: log}, log)
		if err != nil {
			return fmt.Errorf("embedded PostgreSQL: %w", err)
		}
		defer sup.Stop()
		supervised = append(supervised, sup.Component())
		if err := ensureDatabase(ctx, pg.URL("postgres"), "converge"); err != nil {
			return err
		}
		dbURL = pg.URL("converge")
	}

	// Schema and tenants before anything serves: the dev stack's tenants
	// (dev, admin) and their tokens in the data directory, and its database
	// URL for `converge tenants` (files of mode 0600).
	tokens, err := prepareDevDatabase(ctx, dbURL, dataDir)
	if err != nil {
		return err
	}

	reg := newRegistry()
	brokers := c.KafkaBrokers
	if len(brokers) == 0 {
		opts := []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(c.KafkaPort),
			kfake.ClusterID("converge-dev"), kfake.DefaultNumPartitions(int(c.TopicPartitions))}
		if !c.KafkaNoSync {
			opts = append(opts, kfake.SyncWrites())
		}
		// kfake plus a reaper of consumer-group members whose process is
		// gone (issue 9): a `converge worker` killed mid-join against
		// this broker would otherwise wedge the group for minutes.
		kb, err := devbroker.Start(devbroker.Config{Opts: opts, DataDir: filepath.Join(dataDir, "kafka"), Logger: log.With("component", "devbroker"), Registerer: reg,
			Groups: []string{worker.DefaultGroup, taskview.DefaultGroup, reconciler.DefaultDeadLetterGroup}})
		if err != nil {
			return fmt.Errorf("embedded Kafka broker on port %d: %w", c.KafkaPort, err)
		}
		defer kb.Close()
		brokers = kb.ListenAddrs()
	}

	redisURL := c.RedisURL
	if redisURL == "" {
		pw, err := devSecret(dataDir, "redis.password")
		if err != nil {
			return err
		}
		sup, rs, err := embeddedRedis(ctx, localredis.Config{Port: c.RedisPort, Dir: filepath.Join(dataDir, "redis"), Password: pw}, log)
		if err != nil {
			return fmt.Errorf("embedded Redis: %w", err)
		}
		defer sup.Stop()
		supervised = append(supervised, sup.Component())
		redisURL = rs.URL()
	}

	artifactDir := c.ArtifactDir
	if artifactDir == "" {
		artifactDir = filepath.Join(dataDir, "artifacts")
	}

	// The banner's commands find this data directory themselves only when
	// it is the default one.
	dirPrefix := ""
	if filepath.Clean(c.DataDir) != ".converge" {
		dirPrefix = "CONVERGE_DATA_DIR=" + dataDir + " "
	}
	cfg := pipeline.Config{
		// The embedded PostgreSQL stops with dev, so a publication altered
		// by hand could not be fixed before the relay checks it again at
		// the next start; while dev runs, the relay repairs it when it opens
		// its session after finding the mismatch.
		RepairPublication: true,
		// Only the embedded database is dev's alone; a database given with
		// --database-url may serve other releases' binaries.
		Finalize:    c.DatabaseURL == "",
		DatabaseURL: dbURL, Brokers: brokers, RedisURL: redisURL, ArtifactDir: artifactDir,
		Topic: c.Topic, Partitions: c.TopicPartitions, SlotName: c.SlotName, PublicationName: c.PublicationName,
		Listener: ln, AdminListener: adminLn, MaxBodyBytes: c.MaxBodyBytes, MaxInFlightPerTenant: c.MaxInFlight, CreateBatchMax: c.CreateBatchMax, CreateTransactions: c.CreateTx, Faults: env.faults, Logger: log, Registry: reg,
		Worker:     worker.Config{VisibilityTimeout: c.WorkerVisibilityTimeout},
		Reconciler: reconciler.Config{OutboxRetention: c.OutboxRetention, TaskRetention: c.TaskRetention},
		Supervised: supervised,
		Ready: func(addr string) {
			fmt.Printf(`
converge is running (Ctrl-C stops it cleanly)
  API          %s   (POST /v1/tasks, GET /v1/tasks/{id}, /metrics, /healthz, /readyz)
  admin API    http://%s   (/v1/admin/dead-letters, /v1/admin/outbox, /v1/admin/tenants; admin token)
  PostgreSQL   %s
  Kafka        %v   (topic %s; any Kafka client can connect)
  Redis        %s
  artifacts    %s
  tenants      dev    %s
               admin  %s   (admin endpoints; tokens in %s)
Submit documents:  %s./bin/converge submit --api-url %s PATH...   (sends the dev token from the data directory)
Read a task:       curl -H "Authorization: Bearer $(cat %s)" %s/v1/tasks/<task_id>
Manage tenants:    %s./bin/converge tenants add|list|rotate|disable|enable|quota

`, apiURL, adminLn.Addr().String(), redact(dbURL), brokers, c.Topic, redactRedis(redisURL), artifactDir, tokens["dev"], tokens["admin"], filepath.Join(dataDir, devTokenDir),
				dirPrefix, apiURL, filepath.Join(dataDir, devTokenDir, "dev.token"), apiURL, dirPrefix)
		},
	}
	errc := make(chan error, 1)
	go func() { errc <- pipeline.Run(ctx, cfg) }()

	if !c.NoExamples {
		go submitExamples(ctx, apiURL, dataDir, tokens["dev"])
	}
	return <-errc
}

// submitExamples writes the embedded example documents to the data
// directory and submits them, so a newcomer sees tasks complete.
func submitExamples(ctx context.Context, apiURL, dataDir, token string) {
	dir := filepath.Join(dataDir, "examples")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return
	}
	_ = fs.WalkDir(examples, "examples", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, _ := examples.ReadFile(p)
		return os.WriteFile(filepath.Join(dir, filepath.Base(p)), b, 0o644)
	})
	cl := &submit.Client{BaseURL: apiURL, Token: token}
	if !waitReady(ctx, apiURL) {
		return
	}
	fmt.Println("Submitting the example documents in", dir)
	s, err := submit.Run(ctx, os.Stdout, cl, []string{dir}, 4, 60*time.Second)
	if err != nil {
		fmt.Println("examples:", err)
		return
	}
	if s.OK() {
		fmt.Println("All examples completed. Fetch an artifact: curl -s -H \"Authorization: Bearer $(cat " + filepath.Join(dataDir, devTokenDir, "dev.token") + ")\" " + apiURL + "/v1/tasks/<task_id>/artifact")
	}
}

// prepareDevDatabase migrates the dev database, writes its URL into the
// data directory and makes sure the dev tenants exist (ensureDevTenants).
func prepareDevDatabase(ctx context.Context, dbURL, dataDir string) (map[string]string, error) {
	pool, err := connectDB(ctx, dbURL, "dev")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if err := schemas.Migrate(ctx, pool); err != nil {
		return nil, err
	}
	if _, err := schemas.Check(ctx, pool); err != nil { // a newer release migrated it: change nothing
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dataDir, devDatabaseURLFile), []byte(dbURL+"\n"), 0o600); err != nil {
		return nil, err
	}
	return ensureDevTenants(ctx, pool, dataDir)
}

func waitReady(ctx context.Context, apiURL string) bool {
	cl := &submit.Client{BaseURL: apiURL}
	for i := 0; i < 300; i++ {
		if _, err := cl.Get(ctx, "00000000-0000-0000-0000-000000000000"); err == nil || !isConnErr(err) {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(100 * time.Millisecond):
		}
	}
	return false
}

func isConnErr(err error) bool {
	var ne net.Error
	var oe *net.OpError
	return errors.As(err, &oe) || errors.As(err, &ne)
}

func ensureDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return err
	}
	if exists {
		return nil
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	return err
}

// redactRedis is a Redis URL without its password.
func redactRedis(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(unparseable URL)"
	}
	p.User = nil
	return p.String()
}

// devSecret returns the password kept in dataDir/secrets/name (mode 0600),
// creating it (32 random bytes, base64url) on first use: the embedded
// PostgreSQL's and redis-server's passwords (issue 12: no trust, no open
// Redis, even in dev).
func devSecret(dataDir, name string) (string, error) {
	dir := filepath.Join(dataDir, "secrets")
	path := filepath.Join(dir, name)
	if b, err := os.ReadFile(path); err == nil {
		if s := strings.TrimSpace(string(b)); s != "" {
			return s, nil
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	var raw [32]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	s := base64.RawURLEncoding.EncodeToString(raw[:])
	if err := os.WriteFile(path, []byte(s+"\n"), 0o600); err != nil {
		return "", err
	}
	return s, nil
}

func redact(u string) string {
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		return "(unparseable URL)"
	}
	return "postgres://" + cfg.User + "@" + cfg.Host + ":" + strconv.Itoa(int(cfg.Port)) + "/" + cfg.Database
}

// lockDataDir takes an exclusive lock on dataDir/dev.lock for the life of
// the process (the kernel releases it when the process ends, SIGKILL
// included), so a second `converge dev` on the same data directory says
// that one is running instead of waiting for its PostgreSQL. It tries for
// devLockWait: a process just killed holds the lock until the kernel has
// torn it down, after kill(1) returned.
func lockDataDir(dataDir string) (unlock func(), err error) {
	path := filepath.Join(dataDir, "dev.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(devLockWait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if errors.Is(err, syscall.EWOULDBLOCK) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		owner, _ := os.ReadFile(path)
		f.Close()
		return nil, fmt.Errorf("another converge dev is running on %s (pid %s): stop it, or give this one another CONVERGE_DATA_DIR and ports", dataDir, strings.TrimSpace(string(owner)))
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return func() { f.Close() }, nil
}

// devLockWait bounds lockDataDir's tries.
const devLockWait = 3 * time.Second
