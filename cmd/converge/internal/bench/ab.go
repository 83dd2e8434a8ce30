package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/freeport"
)

// The ab stage: two converge builds (two executables, e.g. of two commits)
// on the same job AT THE SAME TIME, on the same PostgreSQL cluster, so that
// both see the same machine. On the 2-core machines BENCHMARKS.md reports,
// the machine's speed drifts between runs by more than the changes left to
// measure (10,000-task runs of the same build spread over ±10 %, and River
// tuned's median over 864–1,431 tasks/s in one day); runs side by side
// share that drift, which the ratio of their rates cancels (the schema-cost
// kit's paired runs: ±2 %, BENCHMARKS.md, sessions of 2026-12-07).
//
// Each side is `<binary> migrate --finalize`, then `<binary> dev` on a
// database of its own in the stage's cluster, with its own embedded broker
// and Redis (so neither's consumer groups or keys meet the other's), and
// the same load generator for both (`converge loadgen` of Config.Loadgen)
// with 16 closed-loop clients and PeerTasks tasks. A round starts both
// sides (the start order alternating), warms both up at once, then starts
// both load generators at once. Each side's rate is counted in the window
// in which both were completing tasks: from the later of the two first
// completions to the earlier of the two last ones (completed_at, one
// clock), tasks completed in the window over its length. A round in which
// a side completed nothing in that window fails (the sides barely
// overlapped: too few tasks). Each side's CPU per task is its process tree
// (dev, its redis-server) and its database's backends over the whole
// round. B over A is reported per round and as the median.
//
// What it measures is which build does more of the job on a shared
// machine: a proxy for CPU per task, not either build's rate alone (each
// gets about half the machine), so it is no replacement for the peer stage.

// ABResult is the ab stage.
type ABResult struct {
	// Binaries are A and B, as given.
	Binaries []string  `json:"binaries"`
	Tasks    int       `json:"tasks"`
	Clients  int       `json:"clients"`
	Rounds   []ABRound `json:"rounds"`
	// RatioMedian is the median over rounds of B's rate over A's (above 1:
	// B does more of the job in the same time).
	RatioMedian float64 `json:"ratio_median"`
	// CPURatioMedian is the median of B's CPU per task over A's (below 1: B
	// is cheaper).
	CPURatioMedian float64 `json:"cpu_ratio_median"`
}

// ABRound is one round: A and B side by side.
type ABRound struct {
	// First is the side started first ("a" or "b").
	First string `json:"first"`
	// WindowSeconds is the length of the window in which both sides were
	// completing tasks.
	WindowSeconds float64 `json:"window_seconds"`
	// TasksPerSec are A's and B's tasks completed per second in the window.
	TasksPerSec [2]float64 `json:"tasks_per_sec"`
	// CPUMsPerTask are A's and B's CPU per task over the round (process
	// tree and database backends).
	CPUMsPerTask [2]float64 `json:"cpu_ms_per_task"`
	Ratio        float64    `json:"ratio"`
	CPURatio     float64    `json:"cpu_ratio"`
}

// abSide is one side of a round: a `converge dev` of one binary.
type abSide struct {
	e      *env
	name   string // "a" or "b"
	bin    string
	db     string
	dbURL  string
	dir    string
	apiURL string
	cmd    *exec.Cmd
	exited chan error
}

// runAB is the ab stage.
func runAB(ctx context.Context, e *env, res *Results) error {
	bins := e.cfg.ABBinaries
	if len(bins) != 2 {
		return fmt.Errorf("the ab stage needs two converge executables (--ab-binaries A,B), got %d", len(bins))
	}
	pool, err := pgxpool.New(ctx, e.pg.URL("postgres"))
	if err != nil {
		return err
	}
	defer pool.Close()
	// The start order alternates: an even number of rounds starts each
	// side first equally often.
	rounds := e.cfg.Runs + e.cfg.Runs%2
	if rounds != e.cfg.Runs {
		e.progress("ab      %d rounds, not %d: each side is started first equally often", rounds, e.cfg.Runs)
	}
	ab := &ABResult{Binaries: bins, Tasks: e.cfg.PeerTasks, Clients: peerClients}
	res.AB = ab
	// The sides' directories go at the end of the stage, not after each
	// round (see runPeer: freed inodes slow the next allocations on the
	// file system BENCHMARKS.md reports).
	failed := false
	defer func() {
		if failed {
			if e.ownDir {
				e.progress("ab      give --dir to keep the sides' logs and load generator reports after a failure")
			} else {
				e.progress("ab      the sides' directories (logs, load generator reports) are kept in %s", e.dir)
			}
			return
		}
		for round := range rounds {
			for _, name := range []string{"a", "b"} {
				_ = os.RemoveAll(e.abDir(name, round))
			}
		}
	}()
	var ratios, cpuRatios []float64
	for round := range rounds {
		r, err := e.abRound(ctx, pool, round)
		e.settle(ctx)
		if err != nil {
			failed = true
			return fmt.Errorf("round %d: %w", round+1, err)
		}
		e.progress("ab      round %d (%s first): A %.0f tasks/s, B %.0f tasks/s in the %.1f s both were completing tasks: B/A %.3f; CPU ms per task A %.2f, B %.2f: B/A %.3f",
			round+1, r.First, r.TasksPerSec[0], r.TasksPerSec[1], r.WindowSeconds, r.Ratio, r.CPUMsPerTask[0], r.CPUMsPerTask[1], r.CPURatio)
		ab.Rounds = append(ab.Rounds, r)
		ratios, cpuRatios = append(ratios, r.Ratio), append(cpuRatios, r.CPURatio)
	}
	ab.RatioMedian, ab.CPURatioMedian = round3(median(ratios)), round3(median(cpuRatios))
	return nil
}

// abRound runs one round: both sides started, warmed up, loaded at once,
// measured, stopped.
func (e *env) abRound(ctx context.Context, pool *pgxpool.Pool, round int) (ABRound, error) {
	out := ABRound{First: "a"}
	order := []int{0, 1}
	if round%2 == 1 {
		out.First, order = "b", []int{1, 0}
	}
	sides := make([]*abSide, 2)
	defer func() {
		for _, s := range sides {
			if s != nil {
				s.stop()
			}
		}
	}()
	for _, i := range order {
		s, err := e.startABSide(ctx, string(rune('a'+i)), e.cfg.ABBinaries[i], round)
		if err != nil {
			return out, err
		}
		sides[i] = s
	}
	// Both warm up at once, so that neither waits idle for the other's
	// warm-up before the measurement starts.
	if err := bothLoad(ctx, sides, order, "warm-", 200); err != nil {
		return out, err
	}

	type meter struct {
		tree     time.Duration
		backends map[int]backend
	}
	read := func(s *abSide) (meter, error) {
		b, err := backendCPU(ctx, pool, s.db)
		return meter{tree: treeCPU(strconv.Itoa(s.cmd.Process.Pid)), backends: b}, err
	}
	var before [2]meter
	for i, s := range sides {
		var err error
		if before[i], err = read(s); err != nil {
			return out, err
		}
	}
	prefix := fmt.Sprintf("ab-%d-%d-", round, time.Now().UnixNano())
	if err := bothLoad(ctx, sides, order, prefix, e.cfg.PeerTasks); err != nil {
		return out, err
	}
	n := float64(e.cfg.PeerTasks)
	for i, s := range sides {
		after, err := read(s)
		if err != nil {
			return out, err
		}
		cpu := after.tree - before[i].tree
		for pid, b := range after.backends {
			cpu += b.cpu - before[i].backends[pid].cpu // a backend started during the round: all of its CPU
		}
		out.CPUMsPerTask[i] = round2(float64(cpu.Microseconds()) / 1000 / n)
	}

	// The window in which both were completing tasks, from each side's own
	// rows.
	var first, last [2]time.Time
	for i, s := range sides {
		var done int
		if err := s.query(ctx, `
SELECT count(*) FILTER (WHERE t.status = 'completed'), min(t.completed_at), max(t.completed_at)
FROM idempotency_record i JOIN task t ON t.task_id = i.task_id
WHERE i.idempotency_key LIKE $1 || '%'`, []any{prefix}, &done, &first[i], &last[i]); err != nil {
			return out, fmt.Errorf("side %s: %w", s.name, err)
		}
		if done != e.cfg.PeerTasks {
			return out, fmt.Errorf("side %s: %d of %d tasks completed (%s); its load generator's report: %s; its log: %s",
				s.name, done, e.cfg.PeerTasks, s.states(ctx, prefix), filepath.Join(s.dir, "loadgen.out"), filepath.Join(s.dir, "dev.log"))
		}
	}
	from, to := maxTime(first[0], first[1]), minTime(last[0], last[1])
	if !to.After(from) {
		return out, fmt.Errorf("the two sides did not complete tasks at the same time (first completions %v, %v; last %v, %v): give more --peer-tasks", first[0], first[1], last[0], last[1])
	}
	out.WindowSeconds = round2(to.Sub(from).Seconds())
	for i, s := range sides {
		var in int
		if err := s.query(ctx, `
SELECT count(*) FROM idempotency_record i JOIN task t ON t.task_id = i.task_id
WHERE i.idempotency_key LIKE $1 || '%' AND t.completed_at BETWEEN $2 AND $3`, []any{prefix, from, to}, &in); err != nil {
			return out, fmt.Errorf("side %s: %w", s.name, err)
		}
		if in == 0 {
			return out, fmt.Errorf("side %s completed no task in the %.2f s both were completing tasks: give more --peer-tasks", s.name, to.Sub(from).Seconds())
		}
		out.TasksPerSec[i] = round2(float64(in) / to.Sub(from).Seconds())
	}
	out.Ratio = round3(out.TasksPerSec[1] / max(out.TasksPerSec[0], 1e-9))
	out.CPURatio = round3(out.CPUMsPerTask[1] / max(out.CPUMsPerTask[0], 1e-9))
	return out, nil
}

// bothLoad runs both sides' load generators at once (started in order)
// for n tasks each under keys starting with prefix.
func bothLoad(ctx context.Context, sides []*abSide, order []int, prefix string, n int) error {
	errs := make(chan error, len(order))
	for _, i := range order {
		go func(s *abSide) { errs <- s.loadgen(ctx, prefix, n) }(sides[i])
	}
	var err error
	for range order {
		err = errors.Join(err, <-errs)
	}
	return err
}

// startABSide makes side name's database, migrates it with bin, and starts
// `bin dev` on it with an embedded broker and Redis of its own; it returns
// once the API answers /readyz.
func (e *env) startABSide(ctx context.Context, name, bin string, round int) (*abSide, error) {
	s := &abSide{e: e, name: name, bin: bin, db: fmt.Sprintf("bench_ab_%s_%d", name, round), exited: make(chan error, 1)}
	if err := e.createDB(ctx, s.db); err != nil {
		return nil, err
	}
	s.dbURL = e.pg.URL(s.db)
	s.dir = e.abDir(name, round)
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return nil, err
	}
	if out, err := exec.CommandContext(ctx, bin, "migrate", "--finalize", "--database-url", s.dbURL, "--log-level", "warn").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("side %s: %s migrate --finalize: %v\n%s", name, bin, err, out)
	}
	var ports [4]int
	for i := range ports {
		p, err := freeport.Pick()
		if err != nil {
			return nil, err
		}
		ports[i] = p
	}
	s.apiURL = fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	logf, err := os.Create(filepath.Join(s.dir, "dev.log"))
	if err != nil {
		return nil, err
	}
	s.cmd = exec.Command(bin, "dev", "--database-url", s.dbURL, "--data-dir", filepath.Join(s.dir, "data"),
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--admin-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--kafka-port", strconv.Itoa(ports[2]), "--redis-port", strconv.Itoa(ports[3]),
		"--slot-name", s.db, "--no-examples", "--log-level", "warn")
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	// dev stops with this process (its own children, PostgreSQL excepted,
	// stop with it). A process group of its own, which stop signals: an
	// executable that is a wrapper script starting converge without exec
	// stops with it.
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("side %s: start %s dev: %w", name, bin, err)
	}
	go func() {
		s.exited <- s.cmd.Wait()
		logf.Close()
	}()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.apiURL+"/readyz", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s, nil
			}
		}
		select {
		case err := <-s.exited:
			s.exited <- err
			s.stop()
			return nil, fmt.Errorf("side %s: %s dev exited before it was ready (%v); its log: %s", name, bin, err, filepath.Join(s.dir, "dev.log"))
		case <-ctx.Done():
			s.stop()
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("side %s: %s dev not ready after 2 minutes; its log: %s", name, bin, filepath.Join(s.dir, "dev.log"))
		}
	}
}

// abDir is the directory of side name in round (dev's data directory,
// artifacts and log).
func (e *env) abDir(name string, round int) string {
	return filepath.Join(e.dir, fmt.Sprintf("ab-%s-%d", name, round))
}

// loadgen runs the load generator against the side for n tasks under
// keys starting with prefix (runLoadgen, with the token of the side's dev);
// its report is kept in the side's directory.
func (s *abSide) loadgen(ctx context.Context, prefix string, n int) error {
	out, _, err := s.e.runLoadgen(ctx, s.apiURL, s.dbURL, prefix, n, "--data-dir", filepath.Join(s.dir, "data"))
	_ = os.WriteFile(filepath.Join(s.dir, "loadgen.out"), out, 0o644)
	if err != nil {
		return fmt.Errorf("side %s: %w", s.name, err)
	}
	return nil
}

// states counts the side's tasks under prefix by status, and its
// idempotency records under prefix (the creates that committed), for an
// error message.
func (s *abSide) states(ctx context.Context, prefix string) string {
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		return err.Error()
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `
SELECT COALESCE(t.status, 'no task'), count(*) FROM idempotency_record i LEFT JOIN task t ON t.task_id = i.task_id
WHERE i.idempotency_key LIKE $1 || '%' GROUP BY 1 ORDER BY 1`, prefix)
	if err != nil {
		return err.Error()
	}
	var parts []string
	var status string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&status, &n}, func() error {
		parts = append(parts, fmt.Sprintf("%s %d", status, n))
		return nil
	})
	if err != nil {
		return err.Error()
	}
	return "idempotency records by task status: " + strings.Join(parts, ", ")
}

// query runs a one-row query on the side's database.
func (s *abSide) query(ctx context.Context, sql string, args []any, dest ...any) error {
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql, args...).Scan(dest...)
}

// stop ends the side's dev (SIGINT, its clean stop; SIGKILL after 30 s)
// and drops its replication slot, so that settle can drop its database.
func (s *abSide) stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	group := -s.cmd.Process.Pid
	_ = syscall.Kill(group, syscall.SIGINT)
	select {
	case err := <-s.exited:
		s.exited <- err
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(group, syscall.SIGKILL)
		s.e.progress("ab      side %s: dev did not stop within 30 s of SIGINT; killed", s.name)
	}
	dropSlots(s.e, s.db)
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
