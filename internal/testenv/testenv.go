// Package testenv is converge's shared test harness: real PostgreSQL (with
// wal_level=logical), real Kafka protocol (a franz-go kfake cluster per test)
// and a real redis-server.
//
// PostgreSQL: CONVERGE_TEST_DATABASE_URL when set (a superuser URL of a
// server with wal_level=logical), else one ephemeral cluster per test binary,
// started on first use on a free port. Each test gets its own database,
// cloned from a migrated template, so tests run in parallel.
//
// Redis: CONVERGE_TEST_REDIS_URL when set, else one redis-server per test
// binary on a free port. Keys are namespaced by task id, which is unique.
//
// When a service cannot be had, the test is skipped, except under CI=true,
// where it fails: a green CI run that skipped everything is a defect.
//
// Every package that uses the harness calls testenv.Main from TestMain so the
// processes are stopped when the binary ends.
package testenv

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"

	"github.com/converge-run/converge/internal/freeport"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/schemas"
)

var (
	pgOnce     sync.Once
	pgCluster  *localpg.Cluster
	pgAdminURL string
	pgErr      error
	pgTmpDir   string
	tmplMu     sync.Mutex
	dbSeq      atomic.Int64

	redisOnce   sync.Once
	redisServer *localredis.Server
	redisTmpDir string
	redisURL    string
	redisErr    error
)

const templateDB = "converge_template"

// Main runs the tests, fails the binary when goroutines leaked (goleak, as
// every River package's TestMain does), and stops the processes the harness
// started.
func Main(m *testing.M) {
	code := m.Run()
	if pgCluster != nil {
		pgCluster.Stop()
	}
	if pgTmpDir != "" {
		os.RemoveAll(pgTmpDir)
	}
	if redisServer != nil {
		redisServer.Stop()
	}
	if redisTmpDir != "" {
		os.RemoveAll(redisTmpDir)
	}
	if code == 0 {
		if err := goleak.Find(LeakOptions()...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: goroutines leaked by the tests: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// LeakOptions are the goroutines a test binary may leave behind without a
// leak: none of converge's own.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		// pgx's pools close their connections in the background after Close.
		goleak.IgnoreTopFunction("github.com/jackc/puddle/v2.(*Pool).backgroundHealthCheck"),
	}
}

// InCI reports whether CI=true: missing services fail instead of skipping.
func InCI() bool { return os.Getenv("CI") == "true" }

func unavailable(t testing.TB, what string, err error) {
	t.Helper()
	if InCI() {
		t.Fatalf("%s unavailable under CI=true (tests never skip in CI): %v", what, err)
	}
	t.Skipf("%s unavailable: %v", what, err)
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago,
// outside the kernel's ephemeral range where it can tell: a test that
// binds it again later (a restart) does not find it taken by an outgoing
// connection of a parallel test, which the kernel gives ephemeral ports
// (net.ipv4.ip_local_port_range).
func FreePort(t testing.TB) int {
	t.Helper()
	p, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func startPG() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if u := os.Getenv("CONVERGE_TEST_DATABASE_URL"); u != "" {
		pgAdminURL = u
	} else {
		dir, err := os.MkdirTemp("", "converge-pg-")
		if err != nil {
			pgErr = err
			return
		}
		os.Chmod(dir, 0o755)
		pgTmpDir = dir
		port, err := freeport.Pick()
		if err != nil {
			pgErr = err
			return
		}
		c, err := localpg.Start(ctx, localpg.Config{DataDir: filepath.Join(dir, "data"), Port: port,
			Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			pgErr = err
			return
		}
		pgCluster = c
		pgAdminURL = c.URL("postgres")
	}
	conn, err := pgx.Connect(ctx, pgAdminURL)
	if err != nil {
		pgErr = err
		return
	}
	defer conn.Close(ctx)
	var level string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil || level != "logical" {
		pgErr = fmt.Errorf("wal_level is %q, want logical (%v)", level, err)
		return
	}
	tmpl := fmt.Sprintf("%s_%d", templateDB, os.Getpid())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+tmpl); err != nil {
		pgErr = fmt.Errorf("create template database: %w", err)
		return
	}
	pool, err := pgxpool.New(ctx, withDB(pgAdminURL, tmpl))
	if err != nil {
		pgErr = err
		return
	}
	defer pool.Close()
	if err := schemas.Migrate(ctx, pool); err != nil {
		pgErr = err
	}
}

func withDB(raw, db string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	u.Path = "/" + db
	return u.String()
}

// DB is one test's own database.
type DB struct {
	// URL connects to the test's database (also usable for replication
	// connections with replication=database).
	URL string
	// Name is the database name, unique across the cluster: use it to name
	// replication slots and publications.
	Name string
	Pool *pgxpool.Pool
}

// NewDB creates a fresh, migrated database for t and drops it (and any
// replication slot in it) when t ends.
func NewDB(t testing.TB) *DB {
	t.Helper()
	pgOnce.Do(startPG)
	if pgErr != nil {
		unavailable(t, "PostgreSQL", pgErr)
	}
	ctx := context.Background()
	name := fmt.Sprintf("t%d_%d", os.Getpid(), dbSeq.Add(1))
	tmpl := fmt.Sprintf("%s_%d", templateDB, os.Getpid())
	admin, err := pgx.Connect(ctx, pgAdminURL)
	if err != nil {
		t.Fatalf("connect admin: %v", err)
	}
	tmplMu.Lock()
	_, err = admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, tmpl))
	tmplMu.Unlock()
	admin.Close(ctx)
	if err != nil {
		t.Fatalf("create test database: %v", err)
	}
	u := withDB(pgAdminURL, name)
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgx.Connect(ctx, pgAdminURL)
		if err != nil {
			return
		}
		defer admin.Close(ctx)
		// Slots pin WAL and block DROP DATABASE: end their senders, drop them.
		_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, name)
		for i := 0; i < 50; i++ {
			_, err = admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, name)
			if err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	return &DB{URL: u, Name: name, Pool: pool}
}

func startRedis() {
	if u := os.Getenv("CONVERGE_TEST_REDIS_URL"); u != "" {
		redisURL = u
	} else {
		port, err := freeport.Pick()
		if err != nil {
			redisErr = err
			return
		}
		dir, err := os.MkdirTemp("", "converge-redis-")
		if err != nil {
			redisErr = err
			return
		}
		redisTmpDir = dir
		s, err := localredis.Start(context.Background(), localredis.Config{Port: port, Dir: dir})
		if err != nil {
			redisErr = err
			return
		}
		redisServer = s
		redisURL = s.URL()
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		redisErr = err
		return
	}
	cl := redis.NewClient(opt)
	defer cl.Close()
	redisErr = cl.Ping(context.Background()).Err()
}

// Redis returns the Redis URL and a client closed when t ends.
func Redis(t testing.TB) (string, *redis.Client) {
	t.Helper()
	redisOnce.Do(startRedis)
	if redisErr != nil {
		unavailable(t, "Redis", redisErr)
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	cl := redis.NewClient(opt)
	t.Cleanup(func() { cl.Close() })
	return redisURL, cl
}

// Kafka is a kfake cluster for one test, with the task-events topic created.
type Kafka struct {
	Cluster *kfake.Cluster
	Brokers []string
	Topic   string
}

// Partitions is the partition count of the topics NewKafka creates.
const Partitions = 4

// NewKafka starts a kfake cluster listening on a loopback port with the
// task-events topic (Partitions partitions) and its dead-letter topic, and
// closes it when t ends.
func NewKafka(t testing.TB) *Kafka {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(Partitions, taskevent.DefaultTopic, taskevent.DefaultTopic+".dlq"))
	if err != nil {
		unavailable(t, "Kafka (kfake)", err)
	}
	t.Cleanup(c.Close)
	return &Kafka{Cluster: c, Brokers: c.ListenAddrs(), Topic: taskevent.DefaultTopic}
}

// Client returns a franz-go client for the cluster, closed when t ends.
func (k *Kafka) Client(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// Eventually polls cond every 20 ms until it returns true or timeout passes,
// then fails t with msg. Use it instead of sleeping for an outcome.
func Eventually(t testing.TB, timeout time.Duration, msg string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s: %s", timeout, msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// SessionsEnded waits (up to 20 s) until no session of application name
// app is connected to db's database: a session reports its statistics
// (pg_stat_user_tables, pg_stat_user_indexes) before it leaves
// pg_stat_activity, so after SessionsEnded every row and index entry those
// sessions read is counted. Close their pool first.
func (db *DB) SessionsEnded(t testing.TB, app string) {
	t.Helper()
	Eventually(t, 20*time.Second, "the sessions of "+app+" ended", func() bool {
		var left int
		err := db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1`, app).Scan(&left)
		return err == nil && left == 0
	})
}

// Itoa is strconv.Itoa, for building names in tests.
func Itoa(i int) string { return strconv.Itoa(i) }

// CommitHold is a PostgreSQL cluster of one test whose commits can be held
// invisible: while held, a transaction's commit record is written, flushed
// and decoded by logical replication (the relay streams it), but the
// committing session waits for a synchronous standby that does not exist,
// so no other session sees its rows until Release. This is the window
// PostgreSQL always has between a commit's WAL flush and the backend leaving
// the proc array, widened at will (issue 9). The cluster is the test's own,
// so holding commits does not stall other tests.
type CommitHold struct {
	// DB is the test's migrated database on the private cluster.
	DB       *DB
	adminURL string
}

// NewCommitHold starts a private cluster (synchronous_commit on, fsync off)
// with a migrated database, stopped when t ends.
func NewCommitHold(t testing.TB) *CommitHold {
	t.Helper()
	cl, db := newCluster(t, "held")
	h := &CommitHold{DB: db, adminURL: cl.c.URL("postgres")}
	// Cleanups run last-registered first: release held commits before the
	// pool waits for its connections.
	t.Cleanup(func() { _ = h.apply("''") })
	if _, err := db.Pool.Exec(context.Background(), "CREATE TABLE converge_hold_probe (n int)"); err != nil {
		t.Fatal(err)
	}
	return h
}

// Hold makes every commit from now on wait, invisible, until Release
// (synchronous_standby_names names a standby that never connects).
// Transactions that wrote nothing, and rollbacks, do not wait. It returns
// once a probe commit was seen waiting: a backend waits only after the
// checkpointer reloaded the setting, which a new session's SHOW does not
// prove.
func (h *CommitHold) Hold(t testing.TB) {
	t.Helper()
	h.set(t, "'converge_no_such_standby'")
	deadline := time.Now().Add(20 * time.Second)
	for {
		held, err := h.probe()
		if err != nil {
			t.Fatalf("probe the commit hold: %v", err)
		}
		if held {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("commits are not held 20s after synchronous_standby_names was set")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// probe commits a transaction that writes WAL (a transaction that only
// took an id does not wait) and reports whether its COMMIT waited for the synchronous standby
// (pg_stat_activity wait_event SyncRep); a waiting probe is cancelled,
// which commits it locally.
func (h *CommitHold) probe() (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, h.DB.URL)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	admin, err := pgx.Connect(ctx, h.adminURL)
	if err != nil {
		return false, err
	}
	defer admin.Close(context.Background())
	pid := conn.PgConn().PID()
	done := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, "INSERT INTO converge_hold_probe VALUES (1)")
		done <- err
	}()
	for {
		select {
		case err := <-done:
			return false, err // committed without waiting: not held yet
		case <-time.After(10 * time.Millisecond):
		}
		var waiting bool
		if err := admin.QueryRow(ctx, `SELECT COALESCE(wait_event = 'SyncRep', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting); err != nil {
			return false, err
		}
		if waiting {
			if _, err := admin.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
				return false, err
			}
			<-done // cancelled wait: committed locally, with a warning
			return true, nil
		}
	}
}

// Release lets the held commits finish and become visible.
func (h *CommitHold) Release(t testing.TB) { h.set(t, "''") }

func (h *CommitHold) set(t testing.TB, names string) {
	t.Helper()
	if err := h.apply(names); err != nil {
		t.Fatal(err)
	}
}

// apply sets synchronous_standby_names and waits until a new session sees
// the value.
func (h *CommitHold) apply(names string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, h.adminURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = "+names); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return err
	}
	want := strings.Trim(names, "'")
	for {
		var v string
		if err := admin.QueryRow(ctx, "SHOW synchronous_standby_names").Scan(&v); err != nil {
			return err
		}
		if v == want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("synchronous_standby_names still %q, want %q", v, want)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Cluster is a private PostgreSQL cluster of one test (wal_level=logical,
// fsync off, synchronous_commit on), which the test may crash and start
// again; it is stopped and removed when the test ends.
type Cluster struct {
	cfg localpg.Config
	c   *localpg.Cluster
	dir string
}

// NewCluster initializes and starts a private cluster with one migrated
// database, returned as a DB (Name "crash").
func NewCluster(t testing.TB) (*Cluster, *DB) {
	t.Helper()
	return newCluster(t, "crash")
}

// newCluster starts a private cluster (synchronous_commit on: the tests'
// shared cluster has it off; here a commit acknowledged before a crash
// survives it, as in production, and CommitHold holds commits) with one
// migrated database named db; both go when t ends.
func newCluster(t testing.TB, db string) (*Cluster, *DB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "converge-pg-"+db+"-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	cl := &Cluster{cfg: localpg.Config{DataDir: filepath.Join(dir, "data"), Port: port,
		Settings: map[string]string{"synchronous_commit": "on"}, Logger: slog.New(slog.DiscardHandler)}, dir: dir}
	if cl.c, err = localpg.Start(ctx, cl.cfg); err != nil {
		os.RemoveAll(dir)
		unavailable(t, "PostgreSQL", err)
	}
	t.Cleanup(func() {
		cl.c.Stop()
		os.RemoveAll(dir)
	})
	admin, err := pgx.Connect(ctx, cl.c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		t.Fatal(err)
	}
	u := cl.c.URL(db)
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := schemas.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return cl, &DB{URL: u, Name: db, Pool: pool}
}

// Migrations returns a goose provider of the embedded migrations on db,
// for tests that move its schema down and up; closed when t ends.
func (db *DB) Migrations(t testing.TB) *goose.Provider {
	t.Helper()
	p, err := goose.NewProvider(goose.DialectPostgres, stdlib.OpenDBFromPool(db.Pool), schemas.Migrations())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// Crash stops the cluster as a crash would: an immediate shutdown
// (SIGQUIT to the postmaster), with no shutdown checkpoint, so the next
// start runs crash recovery from the last checkpoint.
func (cl *Cluster) Crash(t testing.TB) {
	t.Helper()
	if err := syscall.Kill(cl.c.PID(), syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cl.c.Exited():
	case <-time.After(30 * time.Second):
		t.Fatal("PostgreSQL did not exit within 30s of SIGQUIT")
	}
}

// Start starts the cluster again on its data directory and port.
func (cl *Cluster) Start(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := localpg.Start(ctx, cl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	cl.c = c
}
