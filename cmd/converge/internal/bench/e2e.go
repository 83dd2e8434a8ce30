package bench

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/cmd/converge/internal/loadgen"
	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/consumers/worker"
)

// E2EResult is the end-to-end ladder.
type E2EResult struct {
	Steps []E2EStep `json:"steps"`
	// SustainedRate is the highest rate whose median p99 end-to-end latency
	// stayed under 1 s with every task completed (0: none).
	SustainedRate float64 `json:"sustained_tasks_per_sec"`
	// P99At500 is the median p99 end-to-end latency (ms) at 500 tasks/s,
	// with the tasks still pending after the wait (their latency is
	// unknown and not in the p99).
	P99At500     float64 `json:"p99_ms_at_500"`
	PendingAt500 int     `json:"pending_at_500"`
	// Measured500 is false when 500/s was not among the rates.
	Measured500 bool `json:"measured_500"`
}

// E2EStep is one fixed rate of the ladder.
type E2EStep struct {
	Rate float64 `json:"rate"`
	// Per run: p99 end-to-end latency (ms), completed tasks/s, achieved
	// request rate, tasks not completed after the wait.
	P99        []float64 `json:"p99_ms"`
	P50        []float64 `json:"p50_ms"`
	Completed  []float64 `json:"completed_per_sec"`
	Requests   []float64 `json:"requests_per_sec"`
	CreateP99  []float64 `json:"create_p99_ms"`
	Pending    []int     `json:"pending"`
	Errors     int       `json:"errors"`
	P99Median  float64   `json:"p99_median_ms"`
	Sustained  bool      `json:"sustained"`
	CPU        CPU       `json:"cpu"`
	WaitSecond float64   `json:"wait_seconds_last"`
}

const e2eTarget = time.Second

// e2eTenants is how many tenants the ladder's requests are spread over
// (round-robin): the API bounds each tenant's requests in process
// (MaxInFlightPerTenant, 64), and one tenant at 1,500 requests/s reached
// that bound, so that the ladder measured the bound, not the pipeline.
const e2eTenants = 8

// runE2E is stage 4.
func runE2E(ctx context.Context, e *env, res *Results) error {
	dbURL, pool, err := e.newDB(ctx, "bench_e2e")
	if err != nil {
		return err
	}
	tokens, err := benchTenants(ctx, pool, e2eTenants)
	if err != nil {
		pool.Close()
		return err
	}
	defer pool.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	ready := make(chan struct{})
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- pipeline.Run(pctx, pipeline.Config{DatabaseURL: dbURL, Brokers: e.brokers, RedisURL: e.redisURL,
			ArtifactDir: filepath.Join(e.dir, "artifacts-e2e"), Topic: "bench.e2e", SlotName: "bench_e2e", PublicationName: "bench_e2e",
			Partitions: int32(e.cfg.Partitions), Worker: worker.Config{Concurrency: e.cfg.WorkerConcurrency},
			Listener: ln, Logger: e.log, Finalize: true, Ready: func(string) { close(ready) }})
	}()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			e.progress("e2e     the pipeline did not stop within 30s after cancellation; going on")
		}
		dropSlots(e, "bench_e2e")
	}()
	select {
	case <-ready:
	case err := <-done:
		return fmt.Errorf("pipeline: %v", err)
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("pipeline not ready after 2 minutes")
	}
	baseURL := "http://" + ln.Addr().String()
	tasks := &loadgen.DBTasks{Pool: pool}
	// Warm up: consumer groups joined, statements prepared.
	if _, err := loadgen.Run(ctx, loadgen.Config{BaseURL: baseURL, Tokens: tokens, Rate: 50, Duration: 2 * time.Second, DocSize: e.cfg.DocSize,
		Wait: true, WaitTimeout: time.Minute, Tasks: tasks}); err != nil {
		return err
	}
	er := &E2EResult{}
	rates := e.cfg.E2ERates
	failedAt := 0.0
	for _, rate := range rates {
		if failedAt > 0 && rate > failedAt && rate != 500 {
			continue
		}
		st := E2EStep{Rate: rate}
		for run := range e.cfg.Runs {
			stop := func() {}
			if run == 0 {
				stop = e.profile(fmt.Sprintf("e2e-%.0f", rate))
			}
			m := e.cpuStart()
			lr, err := loadgen.Run(ctx, loadgen.Config{BaseURL: baseURL, Tokens: tokens, Rate: rate, Duration: e.cfg.E2EStep, DocSize: e.cfg.DocSize,
				Wait: true, WaitTimeout: 60 * time.Second, Tasks: tasks})
			st.CPU = m.stop(0)
			stop()
			if err != nil {
				return err
			}
			st.P99 = append(st.P99, lr.EndToEnd.P99)
			st.P50 = append(st.P50, lr.EndToEnd.P50)
			st.Completed = append(st.Completed, round2(lr.CompletedPerSec))
			st.Requests = append(st.Requests, round2(lr.RequestsPerSec))
			st.CreateP99 = append(st.CreateP99, lr.CreateLatency.P99)
			st.Pending = append(st.Pending, lr.Pending)
			st.Errors += lr.Requests - lr.Accepted
			st.WaitSecond = round2(lr.WaitSeconds)
			e.progress("e2e     rate %5.0f run %d: sent %.0f req/s, completed %.0f tasks/s, e2e p50 %.0f ms p99 %.0f ms, create p99 %.0f ms, pending %d, errors %v; cpu %+v",
				rate, run+1, lr.RequestsPerSec, lr.CompletedPerSec, lr.EndToEnd.P50, lr.EndToEnd.P99, lr.CreateLatency.P99, lr.Pending, lr.Errors, st.CPU)
			if err := drain(ctx, pool, 5*time.Minute); err != nil {
				return err
			}
		}
		st.P99Median = median(st.P99)
		pending := 0
		for _, p := range st.Pending {
			pending += p
		}
		// Sustained: the p99 target held, every task completed, no request
		// failed and the requests sent kept up with the rate. A backlog
		// that grows through a step shows in the p99 of a long enough step
		// (8 s by default; --quick's 3 s steps are a smoke test).
		st.Sustained = st.P99Median < float64(e2eTarget/time.Millisecond) && pending == 0 && st.Errors == 0 &&
			median(st.Requests) >= 0.95*rate
		if st.Sustained && rate > er.SustainedRate && failedAt == 0 {
			er.SustainedRate = rate
		}
		if !st.Sustained && failedAt == 0 {
			failedAt = rate
		}
		if rate == 500 {
			er.P99At500, er.PendingAt500, er.Measured500 = st.P99Median, pending, true
		}
		er.Steps = append(er.Steps, st)
	}
	res.E2E = er
	return nil
}

// drain waits until no task is queued or running (the backlog of a step
// must not leak into the next one).
func drain(ctx context.Context, pool *pgxpool.Pool, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM task WHERE status IN ('queued', 'running')").Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d tasks still not terminal after %s", n, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
