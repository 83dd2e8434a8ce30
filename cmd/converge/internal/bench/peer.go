package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
)

// The peer stage (issue 11): converge against River (riverqueue/river), the
// PostgreSQL job queue a team would pick instead, on the same job, in the
// same run, alternating: River at its defaults, River tuned, converge; Runs
// times. Each does PeerTasks tasks from 16 closed-loop clients; the time is
// first create -> last completion. River runs as a separate program
// (riverpeer/, a Go module of its own so converge never depends on River),
// built by this stage with `go build`; converge runs its whole pipeline in
// this process, and its load generator in a process of its own (`converge
// loadgen --database-url`), so that the load generator's CPU is not
// charged to converge.

// PeerResult is the peer stage.
type PeerResult struct {
	Tasks   int `json:"tasks"`
	Clients int `json:"clients"`
	// Runs, in the order they ran.
	Runs []PeerRun `json:"runs"`
	// Medians per system (keys: converge, river, river_tuned).
	Median map[string]PeerRun `json:"median"`
	// Ratios of converge's median tasks/s to River's.
	RatioToRiver      float64 `json:"ratio_to_river"`
	RatioToRiverTuned float64 `json:"ratio_to_river_tuned"`
	// Retention is the removal of the last converge run's tasks by the
	// pipeline's reconciler, once they are past every retention window
	// (nil when it was not measured).
	Retention *RetentionRun `json:"retention,omitempty"`
}

// RetentionRun is what removing tasks past their retention costs: the
// reconciler's idempotency, outbox and task retention (with each task's
// artifact, through its ledger entry) over every task of a peer run, aged
// past the windows at once. What a deployment spends on each task a second
// time, a retention window after its processing.
type RetentionRun struct {
	Tasks int `json:"tasks"`
	// Reconcilers removing them (Config.RetentionReconcilers).
	Reconcilers int     `json:"reconcilers"`
	Seconds     float64 `json:"seconds"` // aged -> no task left
	TasksPerSec float64 `json:"tasks_per_sec"`
	// CPUMsPerTask: the converge process and PostgreSQL, per removed task;
	// PostgresMsPerTask is PostgreSQL's part.
	CPUMsPerTask      float64 `json:"cpu_ms_per_task"`
	PostgresMsPerTask float64 `json:"postgres_ms_per_task"`
	CommitsPerTask    float64 `json:"commits_per_task"`
}

// PeerRun is one run of one system.
type PeerRun struct {
	System      string  `json:"system"`
	Seconds     float64 `json:"seconds"` // first create -> last completion
	TasksPerSec float64 `json:"tasks_per_sec"`
	// CreateSeconds is first create -> last create committed: how long the
	// clients took, against Seconds, how long the system took.
	CreateSeconds float64 `json:"create_seconds"`
	// CPUMsPerTask is the CPU of the system's processes and PostgreSQL over
	// the run, per task (converge's load generator excluded; River's
	// inserting clients, which are its API, included).
	CPUMsPerTask float64 `json:"cpu_ms_per_task"`
	// XIDsPerTask are the transaction ids PostgreSQL assigned per task:
	// write transactions, committed or not, in the whole cluster.
	XIDsPerTask float64 `json:"xids_per_task"`
	// CommitsPerTask is pg_stat_database.xact_commit of the system's
	// database per task (read-only transactions included).
	CommitsPerTask float64 `json:"commits_per_task"`
	// Statements are the run's costliest statements (Config.Statements).
	Statements []StatementCost `json:"statements,omitempty"`
	// PostgresMsPerTask splits PostgreSQL's CPU of a converge run by the
	// application_name of the backends of the run's database (converge-api,
	// converge-worker, converge-reconciler, converge-relay: its pool and
	// its walsender), milliseconds per task; "other" is the rest of the
	// cluster's (WAL writer, checkpointer, autovacuum, other databases).
	PostgresMsPerTask map[string]float64 `json:"postgres_ms_per_task,omitempty"`
}

const (
	peerConverge   = "converge"
	peerRiver      = "river"
	peerRiverTuned = "river_tuned"
	peerClients    = 16
)

// runPeer is stage 5.
func runPeer(ctx context.Context, e *env, res *Results) error {
	riverBin, err := e.buildRiverPeer(ctx)
	if err != nil {
		return err
	}
	pr := &PeerResult{Tasks: e.cfg.PeerTasks, Clients: peerClients, Median: map[string]PeerRun{}}
	res.Peer = pr
	// River's artifact directories are removed after the last run, not
	// after each: on a file system without a journal (ext4 in nojournal
	// mode, as on the machine BENCHMARKS.md reports), inodes freed in the
	// last 60 to 360 s are skipped by every inode allocation, so removing
	// 10,000 files made the next run pay up to 0.9 ms of CPU per file it
	// created (BENCHMARKS.md, "Session of 2026-12-03").
	defer func() {
		for _, dir := range e.peerDirs {
			_ = os.RemoveAll(dir)
		}
	}()
	for run := range e.cfg.Runs {
		for _, system := range []string{peerRiver, peerRiverTuned, peerConverge} {
			var r PeerRun
			db := e.peerDB(system, run)
			var err error
			if system == peerConverge {
				// The first run is profiled as well as the last: in full
				// runs of 2026-12-04 the first runs were the slow ones
				// (BENCHMARKS.md, "Recorded results").
				stop := func() {}
				if run == 0 || run == e.cfg.Runs-1 {
					stop = e.profile(fmt.Sprintf("peer-converge-run%d", run+1))
				}
				// A pipeline of its own per run, on a fresh database and
				// artifact directory, as each River run has: a run never
				// works on the rows and files of the runs before it.
				var conv *peerPipeline
				// Statements are counted from after the warm-up (and the
				// migrations), as River's run has neither.
				if conv, err = e.startPeerPipeline(ctx, run); err == nil {
					if err = e.resetStatements(ctx); err == nil {
						r, err = conv.run(ctx, run)
					}
					// One CPU profile at a time: the run's ends here. Its
					// statements are read before retention's are added.
					stop()
					stop = func() {}
					if err == nil {
						r.Statements, err = e.readStatements(ctx, db, e.cfg.PeerTasks)
					}
					if err == nil && run == e.cfg.Runs-1 {
						stopRetention := e.profile("peer-converge-retention")
						pr.Retention, err = conv.retention(ctx)
						stopRetention()
						if err == nil {
							e.progress("peer    converge    retention: %d tasks removed by %d reconciler(s) in %.1fs = %.0f tasks/s; %.2f ms CPU (PostgreSQL %.2f), %.2f commits per task",
								pr.Retention.Tasks, pr.Retention.Reconcilers, pr.Retention.Seconds, pr.Retention.TasksPerSec, pr.Retention.CPUMsPerTask, pr.Retention.PostgresMsPerTask, pr.Retention.CommitsPerTask)
						}
					}
					conv.stop()
				}
				stop()
			} else if err = e.resetStatements(ctx); err == nil {
				r, err = e.runRiver(ctx, riverBin, system == peerRiverTuned, run)
			}
			if err != nil {
				return fmt.Errorf("%s run %d: %w", system, run+1, err)
			}
			if system != peerConverge {
				if r.Statements, err = e.readStatements(ctx, db, e.cfg.PeerTasks); err != nil {
					return fmt.Errorf("%s run %d: %w", system, run+1, err)
				}
			}
			e.progress("peer    %-11s run %d: %d tasks in %.2fs (created in %.2fs) = %.0f tasks/s; %.2f ms CPU, %.2f xids, %.2f commits per task",
				system, run+1, e.cfg.PeerTasks, r.Seconds, r.CreateSeconds, r.TasksPerSec, r.CPUMsPerTask, r.XIDsPerTask, r.CommitsPerTask)
			e.printStatements(system, run, r.Statements)
			pr.Runs = append(pr.Runs, r)
		}
	}
	for _, system := range []string{peerConverge, peerRiver, peerRiverTuned} {
		pr.Median[system] = medianRun(pr.Runs, system)
	}
	if v := pr.Median[peerRiver].TasksPerSec; v > 0 {
		pr.RatioToRiver = round2(pr.Median[peerConverge].TasksPerSec / v)
	}
	if v := pr.Median[peerRiverTuned].TasksPerSec; v > 0 {
		pr.RatioToRiverTuned = round2(pr.Median[peerConverge].TasksPerSec / v)
	}
	return nil
}

func medianRun(runs []PeerRun, system string) PeerRun {
	var tps, cpu, xids, commits, secs []float64
	for _, r := range runs {
		if r.System == system {
			tps, cpu, xids, commits, secs = append(tps, r.TasksPerSec), append(cpu, r.CPUMsPerTask),
				append(xids, r.XIDsPerTask), append(commits, r.CommitsPerTask), append(secs, r.Seconds)
		}
	}
	// The split of PostgreSQL's CPU by component: each component's median.
	var byApp map[string]float64
	for _, r := range runs {
		if r.System != system {
			continue
		}
		for app := range r.PostgresMsPerTask {
			if byApp == nil {
				byApp = map[string]float64{}
			}
			if _, done := byApp[app]; done {
				continue
			}
			var v []float64
			for _, q := range runs {
				if q.System == system {
					v = append(v, q.PostgresMsPerTask[app])
				}
			}
			byApp[app] = medianOf(v)
		}
	}
	return PeerRun{System: system, TasksPerSec: medianOf(tps), CPUMsPerTask: medianOf(cpu), XIDsPerTask: medianOf(xids),
		CommitsPerTask: medianOf(commits), Seconds: medianOf(secs), PostgresMsPerTask: byApp}
}

func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// peerDB is the database of one run of system.
func (e *env) peerDB(system string, run int) string {
	return fmt.Sprintf("bench_peer_%s_%d", system, run)
}

// buildRiverPeer builds riverpeer/ into the working directory (its module
// comes from the Go module proxy on first use).
func (e *env) buildRiverPeer(ctx context.Context) (string, error) {
	src := e.cfg.RiverDir
	if _, err := os.Stat(filepath.Join(src, "go.mod")); err != nil {
		return "", fmt.Errorf("River peer sources not found at %s (run make bench from the repository root, or pass --river-dir): %w", src, err)
	}
	bin := filepath.Join(e.dir, "riverpeer")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	cmd.Dir = src
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the River peer in %s (needs Go and the module proxy): %w\n%s", src, err, out)
	}
	return bin, nil
}

// runRiver runs the River program once on a fresh database.
func (e *env) runRiver(ctx context.Context, bin string, tuned bool, run int) (PeerRun, error) {
	system := peerRiver
	if tuned {
		system = peerRiverTuned
	}
	db := e.peerDB(system, run)
	if err := e.createDB(ctx, db); err != nil {
		return PeerRun{}, err
	}
	dir := filepath.Join(e.dir, "artifacts-"+db)
	e.peerDirs = append(e.peerDirs, dir)
	args := []string{"--database-url", e.pg.URL(db), "--tasks", strconv.Itoa(e.cfg.PeerTasks), "--clients", strconv.Itoa(peerClients),
		"--doc-size", strconv.Itoa(e.cfg.DocSize), "--artifact-dir", dir}
	if tuned {
		args = append(args, "--tuned")
	}
	var out, errOut bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &out, &errOut
	m := e.cpuStart()
	if err := cmd.Run(); err != nil {
		return PeerRun{}, fmt.Errorf("%v: %s", err, errOut.String())
	}
	wall := time.Since(m.start)
	cpu := m.stop(childCPU(cmd))
	var r struct {
		Seconds     float64 `json:"seconds"`
		InsertSecs  float64 `json:"insert_seconds"`
		XactCommits int64   `json:"xact_commits"`
		XIDs        int64   `json:"xids"`
		Failed      int     `json:"failed"`
	}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		return PeerRun{}, fmt.Errorf("River peer output %q: %w", out.String(), err)
	}
	if r.Failed > 0 {
		return PeerRun{}, fmt.Errorf("%d River jobs failed", r.Failed)
	}
	n := float64(e.cfg.PeerTasks)
	return PeerRun{System: system, Seconds: round2(r.Seconds), TasksPerSec: round2(n / r.Seconds), CreateSeconds: round2(r.InsertSecs),
		// The whole process (migration and start included), PostgreSQL over the same wall time.
		CPUMsPerTask: round2((cpu.Other + cpu.Postgres) * wall.Seconds() * 1000 / n),
		XIDsPerTask:  round2(float64(r.XIDs) / n), CommitsPerTask: round2(float64(r.XactCommits) / n)}, nil
}

// childCPU is the user+system CPU time of a finished child process.
func childCPU(cmd *exec.Cmd) time.Duration {
	if cmd.ProcessState == nil {
		return 0
	}
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	return 0
}

// peerPipeline is converge's side of one run of the peer stage: the
// pipeline, on a database, slot, topic and artifact directory of the run's
// own, and the load generator run as a process of its own.
type peerPipeline struct {
	e         *env
	dbURL     string
	db        string
	artifacts string // the artifact store's directory
	token     string // the API token of the load generator's tenant
	pool      *pgxpool.Pool
	baseURL   string
	cancel    context.CancelFunc
	done      chan error
}

func (e *env) startPeerPipeline(ctx context.Context, run int) (*peerPipeline, error) {
	db := e.peerDB(peerConverge, run)
	slot := fmt.Sprintf("bench_peer_%d", run)
	artifacts := filepath.Join(e.dir, fmt.Sprintf("artifacts-peer-%d", run))
	e.peerDirs = append(e.peerDirs, artifacts)
	dbURL, pool, err := e.newDB(ctx, db)
	if err != nil {
		return nil, err
	}
	_, token, err := benchTenant(ctx, pool)
	if err != nil {
		pool.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		pool.Close()
		return nil, err
	}
	p := &peerPipeline{e: e, dbURL: dbURL, db: db, artifacts: artifacts, pool: pool, token: token, baseURL: "http://" + ln.Addr().String(), done: make(chan error, 1)}
	ready := make(chan struct{})
	pctx, cancel := context.WithCancel(ctx)
	p.cancel = cancel
	go func() {
		p.done <- pipeline.Run(pctx, pipeline.Config{DatabaseURL: dbURL, Brokers: e.brokers, RedisURL: e.redisURL,
			ArtifactDir: artifacts, Topic: fmt.Sprintf("bench.peer.%d", run), SlotName: slot, PublicationName: "bench_peer",
			Partitions: int32(e.cfg.Partitions), Worker: worker.Config{Concurrency: e.cfg.WorkerConcurrency},
			Listener: ln, Logger: e.log, Finalize: true, Ready: func(string) { close(ready) }})
	}()
	select {
	case <-ready:
	case err := <-p.done:
		pool.Close()
		return nil, fmt.Errorf("pipeline: %v", err)
	case <-time.After(2 * time.Minute):
		p.stop()
		return nil, fmt.Errorf("pipeline not ready after 2 minutes")
	}
	// Warm up: consumer groups joined, statements prepared.
	if _, err := p.loadgen(ctx, "warm-", 200); err != nil {
		p.stop()
		return nil, err
	}
	return p, nil
}

func (p *peerPipeline) stop() {
	p.cancel()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.e.progress("peer    the pipeline did not stop within 30s after cancellation; going on")
	}
	p.pool.Close()
	dropSlots(p.e, p.db) // the run's slot, so that settle can drop its database
}

// loadgen runs `converge loadgen` with 16 closed-loop clients for n tasks
// and waits for them (runLoadgen); it returns the process's CPU time.
func (p *peerPipeline) loadgen(ctx context.Context, prefix string, n int) (time.Duration, error) {
	_, cpu, err := p.e.runLoadgen(ctx, p.baseURL, p.dbURL, prefix, n, "--token", p.token)
	return cpu, err
}

// runLoadgen runs `converge loadgen` (Config.Loadgen, by default this
// executable) against the API at apiURL with 16 closed-loop clients for n
// tasks under keys starting with prefix, and waits for them (one query per
// poll on dbURL); auth are the flags naming the API token (--token T, or
// --data-dir D of a converge dev). It returns the load generator's output
// and CPU time; the process is killed if this one dies.
func (e *env) runLoadgen(ctx context.Context, apiURL, dbURL, prefix string, n int, auth ...string) ([]byte, time.Duration, error) {
	self, err := e.loadgenExecutable()
	if err != nil {
		return nil, 0, err
	}
	args := append([]string{"loadgen", "--api-url", apiURL, "--clients", strconv.Itoa(peerClients),
		"--count", strconv.Itoa(n), "--duration", "0", "--doc-size", strconv.Itoa(e.cfg.DocSize),
		"--wait-timeout", "5m", "--database-url", dbURL, "--key-prefix", prefix, "--log-level", "warn"}, auth...)
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // not left polling after this process died
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, 0, fmt.Errorf("converge loadgen: %v\n%s", err, out)
	}
	return out, childCPU(cmd), nil
}

// run is one converge run: PeerTasks tasks through the API from the load
// generator process, measured from the first task's created_at to the last
// one's completed_at.
func (p *peerPipeline) run(ctx context.Context, run int) (PeerRun, error) {
	e := p.e
	prefix := fmt.Sprintf("peer-%d-%d-", run, time.Now().UnixNano())
	xact0, err := settledXactCommit(ctx, p.pool, p.db)
	if err != nil {
		return PeerRun{}, err
	}
	xid0, err := nextXID(ctx, p.pool)
	if err != nil {
		return PeerRun{}, err
	}
	c0 := p.workerCounts(ctx)
	m := e.cpuStart()
	byApp0, err := backendCPU(ctx, p.pool, p.db)
	if err != nil {
		return PeerRun{}, err
	}
	lgCPU, err := p.loadgen(ctx, prefix, e.cfg.PeerTasks)
	if err != nil {
		return PeerRun{}, err
	}
	byApp1, err := backendCPU(ctx, p.pool, p.db)
	if err != nil {
		return PeerRun{}, err
	}
	wall := time.Since(m.start)
	cpu := m.stop(0)
	xid1, err := nextXID(ctx, p.pool)
	if err != nil {
		return PeerRun{}, err
	}
	var secs, createSecs float64
	var done int
	err = p.pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE t.status = 'completed'),
       COALESCE(EXTRACT(EPOCH FROM max(t.completed_at) - min(t.created_at)), 0)::float8,
       COALESCE(EXTRACT(EPOCH FROM max(t.created_at) - min(t.created_at)), 0)::float8
FROM idempotency_record i JOIN task t ON t.task_id = i.task_id
WHERE i.idempotency_key LIKE $1 || '%'`, prefix).Scan(&done, &secs, &createSecs)
	if err != nil {
		return PeerRun{}, err
	}
	if done != e.cfg.PeerTasks || secs <= 0 {
		return PeerRun{}, fmt.Errorf("%d of %d tasks completed", done, e.cfg.PeerTasks)
	}
	xact1, err := settledXactCommit(ctx, p.pool, p.db)
	if err != nil {
		return PeerRun{}, err
	}
	n := float64(e.cfg.PeerTasks)
	_ = lgCPU // the load generator's CPU is not converge's
	c1 := p.workerCounts(ctx)
	if c1.processed > c0.processed {
		msg := fmt.Sprintf("%.0f%% of the worker's records went through runs (batch.go)", 100*(c1.batched-c0.batched)/(c1.processed-c0.processed))
		if g := c1.groups - c0.groups; g > 0 {
			msg += fmt.Sprintf(", %.1f records per group of runs (%.0f groups)", (c1.grouped-c0.grouped)/g, g)
		}
		e.progress("peer    converge    run %d: %s", run+1, msg)
	}
	pgByApp := map[string]float64{}
	var named time.Duration
	for pid, b := range byApp1 {
		d := b.cpu - byApp0[pid].cpu // a backend started during the run: all of its CPU
		named += d
		pgByApp[b.app] += float64(d.Microseconds()) / 1000 / n
	}
	pgByApp["other"] = (cpu.Postgres*wall.Seconds() - named.Seconds()) * 1000 / n
	for k, v := range pgByApp {
		pgByApp[k] = round2(v)
	}
	e.progress("peer    converge    run %d: PostgreSQL ms per task by application_name: %v", run+1, pgByApp)
	return PeerRun{System: peerConverge, Seconds: round2(secs), TasksPerSec: round2(n / secs), CreateSeconds: round2(createSecs),
		CPUMsPerTask: round2((cpu.Converge + cpu.Postgres) * wall.Seconds() * 1000 / n),
		XIDsPerTask:  round2(float64(xid1-xid0-1) / n), CommitsPerTask: round2(float64(xact1-xact0) / n),
		PostgresMsPerTask: pgByApp}, nil
}

// retention ages every task of the pipeline's database past the retention
// windows (task, idempotency record and outbox row: the reconciler's
// defaults, 30 days, 24 hours and 7 days) and measures the pipeline's
// reconciler removing them all, with their artifacts: the rate, and the
// CPU and commits per removed task. It fails when tasks are still left
// after 10 minutes.
func (p *peerPipeline) retention(ctx context.Context) (*RetentionRun, error) {
	e := p.e
	var n int
	if err := p.pool.QueryRow(ctx, `SELECT count(*) FROM task`).Scan(&n); err != nil || n == 0 {
		return nil, fmt.Errorf("retention: %d tasks (%v)", n, err)
	}
	xact0, err := settledXactCommit(ctx, p.pool, p.db)
	if err != nil {
		return nil, err
	}
	// The ages are written in one transaction, before the measurement
	// starts (the reconciler may start on them a few milliseconds before
	// it).
	if _, err := p.pool.Exec(ctx, `
UPDATE task SET created_at = created_at - interval '31 days', updated_at = updated_at - interval '31 days';
UPDATE idempotency_record SET created_at = created_at - interval '2 days', expires_at = now() - interval '1 minute';
UPDATE outbox_event SET created_at = created_at - interval '8 days'`); err != nil {
		return nil, fmt.Errorf("retention: age the rows: %w", err)
	}
	if err := e.resetStatements(ctx); err != nil {
		return nil, err
	}
	m := e.cpuStart()
	more, err := p.moreReconcilers(ctx, e.cfg.RetentionReconcilers-1)
	if err != nil {
		return nil, err
	}
	defer more()
	deadline := time.Now().Add(10 * time.Minute)
	for left := n; left > 0; {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("retention: %d of %d tasks left after 10 minutes", left, n)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		if err := p.pool.QueryRow(ctx, `SELECT count(*) FROM task`).Scan(&left); err != nil {
			return nil, err
		}
	}
	wall := time.Since(m.start)
	cpu := m.stop(0)
	xact1, err := settledXactCommit(ctx, p.pool, p.db)
	if err != nil {
		return nil, err
	}
	st, err := e.readStatements(ctx, p.db, n)
	if err != nil {
		return nil, err
	}
	e.printStatements("converge-retention", 0, st)
	return &RetentionRun{Tasks: n, Reconcilers: e.cfg.RetentionReconcilers, Seconds: round2(wall.Seconds()), TasksPerSec: round2(float64(n) / wall.Seconds()),
		CPUMsPerTask:      round2((cpu.Converge + cpu.Postgres) * wall.Seconds() * 1000 / float64(n)),
		PostgresMsPerTask: round2(cpu.Postgres * wall.Seconds() * 1000 / float64(n)),
		CommitsPerTask:    round2(float64(xact1-xact0) / float64(n))}, nil
}

// moreReconcilers starts n reconcilers in this process besides the
// pipeline's, on its database and artifact directory, with the default
// settings, the pipeline's Redis (their removals delete the task views as
// the pipeline's reconciler does) and no broker (retention needs none), and
// returns the function
// that stops them.
func (p *peerPipeline) moreReconcilers(ctx context.Context, n int) (stop func(), err error) {
	if n <= 0 {
		return func() {}, nil
	}
	store, err := artifact.Open(p.artifacts, nil)
	if err != nil {
		return nil, err
	}
	ropt, err := redis.ParseURL(p.e.redisURL)
	if err != nil {
		return nil, err
	}
	rdb := redis.NewClient(ropt)
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	stop = func() {
		cancel()
		wg.Wait()
		_ = rdb.Close()
	}
	for i := range n {
		name := "reconciler-" + strconv.Itoa(i+2)
		r, err := reconciler.New(reconciler.Config{DatabaseURL: p.dbURL + "&application_name=" + name, ArtifactStore: store,
			Redis: rdb, Logger: p.e.log.With("component", name), Registerer: prometheus.NewRegistry()})
		if err != nil {
			stop()
			return nil, err
		}
		wg.Go(func() { _ = r.Run(rctx) })
	}
	return stop, nil
}

// backend is one PostgreSQL backend's application_name and CPU time so far.
type backend struct {
	app string
	cpu time.Duration
}

// backendCPU reads the backends of database db (pg_stat_activity: client
// backends and the relay's walsender) and their CPU time (/proc), by pid.
// The bench's own sessions (no application_name of converge's) are left
// out.
func backendCPU(ctx context.Context, pool *pgxpool.Pool, db string) (map[int]backend, error) {
	rows, err := pool.Query(ctx, `SELECT pid, application_name FROM pg_stat_activity
WHERE datname = $1 AND application_name LIKE 'converge-%'`, db)
	if err != nil {
		return nil, fmt.Errorf("read backends of %s: %w", db, err)
	}
	out := map[int]backend{}
	var pid int
	var app string
	_, err = pgx.ForEachRow(rows, []any{&pid, &app}, func() error {
		if cpu, _, ok := procCPU(strconv.Itoa(pid)); ok {
			out[pid] = backend{app: app, cpu: cpu}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read backends of %s: %w", db, err)
	}
	return out, nil
}

// workerCounts are the worker's counters that the peer stage reports.
type workerCounts struct {
	batched, processed float64 // records through runs; records processed
	groups, grouped    float64 // groups of runs whose intake committed; their records
}

// workerCounts scrapes the pipeline's /metrics for the worker's counters
// (zeros when unreadable), parsed by Prometheus's text parser.
func (p *peerPipeline) workerCounts(ctx context.Context) (c workerCounts) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.baseURL+"/metrics", nil)
	if err != nil {
		return c
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return c
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return c
	}
	for _, m := range mfs["converge_worker_batched_records_total"].GetMetric() {
		c.batched += m.GetCounter().GetValue()
	}
	for _, m := range mfs["converge_worker_messages_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "outcome" && l.GetValue() == worker.OutcomeProcessed {
				c.processed += m.GetCounter().GetValue()
			}
		}
	}
	for _, m := range mfs["converge_worker_group_records"].GetMetric() {
		c.groups += float64(m.GetHistogram().GetSampleCount())
		c.grouped += m.GetHistogram().GetSampleSum()
	}
	return c
}

// nextXID is the next transaction id PostgreSQL will assign (reading it
// assigns none).
func nextXID(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&n)
	return n, err
}

// settledXactCommit reads pg_stat_database.xact_commit of db after 11 s: a
// session flushes its statistics within 10 s of going idle (PostgreSQL 15's
// PGSTAT_IDLE_INTERVAL). The pipeline's periodic work (reconciler passes,
// heartbeats) keeps committing meanwhile; it is counted too, a few
// hundredths of a commit per task at the sizes measured.
func settledXactCommit(ctx context.Context, pool *pgxpool.Pool, db string) (int64, error) {
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(11 * time.Second):
	}
	var n int64
	err := pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = $1`, db).Scan(&n)
	return n, err
}
