// Command riverpeer runs converge's job on River (riverqueue/river), the
// PostgreSQL job queue a team would compare converge with, for the "peer"
// stage of `make bench` (issue 11). It is a module of its own, so that
// converge's module never depends on River; it does converge's job exactly:
//
//   - the job's arguments are a task id and the same generated ~1 KiB
//     document as converge's load generator (internal/docgen);
//   - each insert runs in its own transaction, from --clients concurrent
//     clients, back to back (a closed model, like `converge loadgen
//     --clients`);
//   - the worker canonicalizes the document with converge's own RFC 8785
//     implementation (internal/canon), writes the artifact durably (a
//     temporary file, fsync, rename into place, directory fsync), reads it
//     back and compares its SHA-256.
//
// It prints one JSON object: the run's tasks, the time from the first
// insert to the last completion, and the transactions PostgreSQL
// committed for the database meanwhile (pg_stat_database.xact_commit).
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/docgen"
)

// convertArgs are the job's arguments: the task and its document.
type convertArgs struct {
	TaskID   string          `json:"task_id"`
	Document json.RawMessage `json:"document"`
}

func (convertArgs) Kind() string { return "convert" }

// convertWorker is converge's job: RFC 8785, a durable artifact, read back.
type convertWorker struct {
	river.WorkerDefaults[convertArgs]
	dir string
}

func (w *convertWorker) Work(ctx context.Context, job *river.Job[convertArgs]) error {
	out, err := canon.Transform(job.Args.Document)
	if err != nil {
		return river.JobCancel(err) // deterministic: never retried
	}
	want := sha256.Sum256(out)
	path := filepath.Join(w.dir, "objects", job.Args.TaskID+".json")
	if err := writeDurably(w.dir, path, out); err != nil {
		return err
	}
	back, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if got := sha256.Sum256(back); got != want {
		return fmt.Errorf("artifact %s: read back %s, want %s", path, hex.EncodeToString(got[:]), hex.EncodeToString(want[:]))
	}
	return nil
}

// writeDurably writes data to path atomically and durably: a temporary file
// fsynced, renamed into place, the directory fsynced.
func writeDurably(dir, path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Join(dir, "tmp"), "put-*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Result is what riverpeer prints.
type Result struct {
	Tasks       int     `json:"tasks"`
	Clients     int     `json:"clients"`
	Tuned       bool    `json:"tuned"`
	MaxWorkers  int     `json:"max_workers"`
	Seconds     float64 `json:"seconds"` // first insert -> last completion
	TasksPerSec float64 `json:"tasks_per_sec"`
	InsertSecs  float64 `json:"insert_seconds"` // first insert -> last insert committed
	Failed      int     `json:"failed"`
	XactCommits int64   `json:"xact_commits"` // pg_stat_database.xact_commit of the run (every session's, flushed at its exit)
	XIDs        int64   `json:"xids"`         // transaction ids assigned in the cluster meanwhile: write transactions
}

func main() {
	var (
		dbURL   = flag.String("database-url", "", "PostgreSQL database of the run (River's tables are migrated into it). Required.")
		tasks   = flag.Int("tasks", 2000, "tasks to insert")
		clients = flag.Int("clients", 16, "concurrent inserting clients, each insert in its own transaction")
		docSize = flag.Int("doc-size", 1024, "size in bytes of a generated document")
		dir     = flag.String("artifact-dir", "", "artifact directory. Required.")
		tuned   = flag.Bool("tuned", false, "River tuned for throughput: MaxWorkers 2000, FetchCooldown 2ms, FetchPollInterval 20ms (else River's defaults, MaxWorkers 100)")
		timeout = flag.Duration("timeout", 10*time.Minute, "longest run")
	)
	flag.Parse()
	res, err := run(*dbURL, *tasks, *clients, *docSize, *dir, *tuned, *timeout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "riverpeer:", err)
		os.Exit(1)
	}
	_ = json.NewEncoder(os.Stdout).Encode(res)
}

func run(dbURL string, n, clients, docSize int, dir string, tuned bool, timeout time.Duration) (*Result, error) {
	if dbURL == "" || dir == "" || n <= 0 || clients <= 0 {
		return nil, errors.New("--database-url, --artifact-dir, positive --tasks and --clients are required")
	}
	for _, d := range []string{"objects", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	poolCfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	// Room for every inserting client and River's own connections
	// (producer, completer, leader, notifier).
	poolCfg.MaxConns = int32(clients + 8)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return nil, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return nil, fmt.Errorf("migrate River: %w", err)
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &convertWorker{dir: dir})
	maxWorkers := 100
	cfg := &river.Config{Workers: workers, Logger: nil}
	if tuned {
		maxWorkers = 2000
		cfg.FetchCooldown = 2 * time.Millisecond
		cfg.FetchPollInterval = 20 * time.Millisecond
	}
	cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		return nil, err
	}
	events, unsubscribe := client.Subscribe(river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled)
	defer unsubscribe()
	if err := client.Start(ctx); err != nil {
		return nil, err
	}
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer scancel()
		_ = client.Stop(sctx)
	}()

	xactBefore, err := xactCommit(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	xidBefore, err := nextXID(ctx, pool)
	if err != nil {
		return nil, err
	}
	res := &Result{Tasks: n, Clients: clients, Tuned: tuned, MaxWorkers: maxWorkers}
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	prefix := "rp-" + strconv.FormatInt(start.UnixNano(), 36) + "-"
	for range clients {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				tx, err := pool.Begin(ctx)
				if err == nil {
					_, err = client.InsertTx(ctx, tx, convertArgs{TaskID: prefix + strconv.Itoa(i), Document: docgen.Document(i, docSize)}, nil)
					if err == nil {
						err = tx.Commit(ctx)
					} else {
						_ = tx.Rollback(ctx)
					}
				}
				if err != nil {
					errs <- fmt.Errorf("insert %d: %w", i, err)
					return
				}
			}
		})
	}
	insertsDone := make(chan struct{})
	go func() { wg.Wait(); close(insertsDone) }()
	finished, last := 0, start
	for finished < n {
		select {
		case ev := <-events:
			if ev == nil {
				return nil, errors.New("River closed the event subscription")
			}
			finished++
			if ev.Kind != river.EventKindJobCompleted {
				res.Failed++
			}
			last = time.Now()
		case <-insertsDone:
			res.InsertSecs = time.Since(start).Seconds()
			insertsDone = nil
		case err := <-errs:
			return nil, err
		case <-ctx.Done():
			return nil, fmt.Errorf("%d of %d jobs finished: %w", finished, n, ctx.Err())
		}
	}
	res.Seconds = last.Sub(start).Seconds()
	res.TasksPerSec = float64(n) / res.Seconds
	xidAfter, err := nextXID(ctx, pool)
	if err != nil {
		return nil, err
	}
	res.XIDs = xidAfter - xidBefore - 1 // the first nextXID's own read is not one
	// A session's statistics reach pg_stat_database when it exits: stop
	// River and close the pool, then read until the count settles.
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	_ = client.Stop(sctx)
	scancel()
	pool.Close()
	xactAfter, err := settledXactCommit(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	res.XactCommits = xactAfter - xactBefore - 1 // the first read's own transaction
	return res, nil
}

// nextXID is the next transaction id PostgreSQL will assign (it assigns
// none itself).
func nextXID(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&n)
	return n, err
}

// xactCommit reads pg_stat_database.xact_commit of the database, on a
// connection of its own.
func xactCommit(ctx context.Context, url string) (int64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int64
	err = conn.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// settledXactCommit reads xact_commit until two reads 300 ms apart agree
// (the sessions that just ended flush their statistics as they exit).
func settledXactCommit(ctx context.Context, url string) (int64, error) {
	prev := int64(-1)
	for range 50 {
		n, err := xactCommit(ctx, url)
		if err != nil {
			return 0, err
		}
		if n == prev {
			return n - 1, nil // the previous read's own transaction
		}
		prev = n
		time.Sleep(300 * time.Millisecond)
	}
	return prev, nil
}
