package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/cmd/converge/internal/loadgen"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api"
)

// CreatePoint compares the API with pgbench at one client count.
type CreatePoint struct {
	Clients int `json:"clients"`
	// APIRate is requests/s of each run (closed model, every request a new
	// task), APIMedian their median.
	APIRate   []float64 `json:"api_requests_per_sec"`
	APIMedian float64   `json:"api_median"`
	// APIP50 and APIP99 are the create latencies (ms) of the median run.
	APIP50 float64 `json:"api_p50_ms"`
	APIP99 float64 `json:"api_p99_ms"`
	// APIErrors sums the failed requests of all runs by code.
	APIErrors map[string]int `json:"api_errors,omitempty"`
	// PgbenchTPS is transactions/s of each pgbench run, PgbenchMedian
	// their median.
	PgbenchTPS    []float64 `json:"pgbench_tps"`
	PgbenchMedian float64   `json:"pgbench_median"`
	PgbenchLatMS  float64   `json:"pgbench_latency_avg_ms"`
	// Ratio is APIMedian / PgbenchMedian.
	Ratio float64 `json:"ratio"`
	// PipelinedTPS is pgbench running the API's statements as the API
	// sends them: two pipelines (\startpipeline) per transaction instead
	// of one round trip per statement; PipelinedMedian their median,
	// PipelinedRatio = APIMedian / PipelinedMedian. The stricter limit.
	PipelinedTPS    []float64 `json:"pgbench_pipelined_tps"`
	PipelinedMedian float64   `json:"pgbench_pipelined_median"`
	PipelinedRatio  float64   `json:"pipelined_ratio"`
	// WidePoolRate is requests/s of the same API with a pool of as many
	// connections as clients (measured above 4 clients only: the default
	// pool has max(4, cores) connections), WidePoolMedian their median and
	// WidePoolRatio its ratio to pgbench. It shows how much of the gap the
	// pool size explains.
	WidePoolRate   []float64 `json:"api_wide_pool_requests_per_sec,omitempty"`
	WidePoolMedian float64   `json:"api_wide_pool_median,omitempty"`
	WidePoolRatio  float64   `json:"api_wide_pool_ratio,omitempty"`
	// CPU of the last API run and of the last pgbench run, in cores.
	APICPU     CPU `json:"api_cpu"`
	PgbenchCPU CPU `json:"pgbench_cpu"`
}

// runCreate is stage 1.
func runCreate(ctx context.Context, e *env, res *Results) error {
	dbURL, pool, err := e.newDB(ctx, "bench_create")
	if err != nil {
		return err
	}
	ten, token, err := benchTenant(ctx, pool)
	if err != nil {
		pool.Close()
		return err
	}
	pool.Close()
	// The API's pool as `converge api` opens it (dbpool: pgxpool defaults
	// and converge's session settings).
	apiPool, err := dbpool.New(ctx, dbURL, "converge-api")
	if err != nil {
		return err
	}
	defer apiPool.Close()
	maxClients := int32(slices.Max(e.cfg.CreateClients))
	wideCfg, err := dbpool.ParseConfig(dbURL, "converge-api")
	if err != nil {
		return err
	}
	wideCfg.MaxConns = max(maxClients, wideCfg.MaxConns)
	widePool, err := pgxpool.NewWithConfig(ctx, wideCfg)
	if err != nil {
		return err
	}
	defer widePool.Close()
	ropt, err := redis.ParseURL(e.redisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(ropt)
	defer rdb.Close()
	store, err := artifact.Open(filepath.Join(e.dir, "artifacts-create"), nil)
	if err != nil {
		return err
	}
	serve := func(pool *pgxpool.Pool) (string, *http.Server, error) {
		srv, err := api.New(api.Config{Pool: pool, Redis: rdb, ArtifactStore: store, Auth: tenant.NewAuthenticator(pool, 0), Logger: e.log.With("component", "api"),
			Registerer: prometheus.NewRegistry()})
		if err != nil {
			return "", nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", nil, err
		}
		hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go hs.Serve(ln)
		return "http://" + ln.Addr().String(), hs, nil
	}
	baseURL, hs, err := serve(apiPool)
	if err != nil {
		return err
	}
	defer hs.Close()
	wideURL, wideHS, err := serve(widePool)
	if err != nil {
		return err
	}
	defer wideHS.Close()

	fx := newFixtures(e.cfg.DocSize)
	fx.tenantID = ten.ID
	script, pipelined := createScript(fx), createScriptPipelined(fx)
	secs := int(e.cfg.CreateDuration.Seconds())

	// Warm up both sides (connections, prepared statements, caches).
	if _, err := loadgen.Run(ctx, loadgen.Config{BaseURL: baseURL, Token: token, Clients: 16, Duration: time.Second, DocSize: e.cfg.DocSize}); err != nil {
		return err
	}
	if _, err := e.pgbench(ctx, "bench_create", script, 4, 1, 0); err != nil {
		return err
	}
	if _, err := e.pgbench(ctx, "bench_create", pipelined, 4, 1, 0); err != nil {
		return err
	}
	for _, c := range e.cfg.CreateClients {
		p := CreatePoint{Clients: c, APIErrors: map[string]int{}}
		var apiRuns []*loadgen.Result
		for run := range e.cfg.Runs {
			stop := func() {}
			if c == 16 && run == 0 {
				stop = e.profile("create-16")
			}
			m := e.cpuStart()
			lr, err := loadgen.Run(ctx, loadgen.Config{BaseURL: baseURL, Token: token, Clients: c, Duration: e.cfg.CreateDuration, DocSize: e.cfg.DocSize})
			p.APICPU = m.stop(0)
			stop()
			if err != nil {
				return err
			}
			for k, v := range lr.Errors {
				p.APIErrors[k] += v
			}
			apiRuns = append(apiRuns, lr)
			p.APIRate = append(p.APIRate, round2(lr.RequestsPerSec))

			m = e.cpuStart()
			pr, err := e.pgbench(ctx, "bench_create", script, c, secs, 0)
			p.PgbenchCPU = m.stop(pr.CPU)
			if err != nil {
				return err
			}
			p.PgbenchTPS = append(p.PgbenchTPS, round2(pr.TPS))
			p.PgbenchLatMS = pr.LatencyMS
			pp, err := e.pgbench(ctx, "bench_create", pipelined, c, secs, 0)
			if err != nil {
				return err
			}
			p.PipelinedTPS = append(p.PipelinedTPS, round2(pp.TPS))
			wide := ""
			if c > 4 {
				wr, err := loadgen.Run(ctx, loadgen.Config{BaseURL: wideURL, Token: token, Clients: c, Duration: e.cfg.CreateDuration, DocSize: e.cfg.DocSize})
				if err != nil {
					return err
				}
				for k, v := range wr.Errors {
					p.APIErrors[k] += v
				}
				p.WidePoolRate = append(p.WidePoolRate, round2(wr.RequestsPerSec))
				wide = fmt.Sprintf(", api with %d-connection pool %.0f req/s", wideCfg.MaxConns, wr.RequestsPerSec)
			}
			e.progress("create  clients=%-3d run %d: api %.0f req/s (p99 %.1f ms, %d errors), pgbench %.0f tps, pgbench pipelined %.0f tps%s; cpu api %+v pgbench %+v",
				c, run+1, lr.RequestsPerSec, lr.CreateLatency.P99, lr.Requests-lr.Accepted, pr.TPS, pp.TPS, wide, p.APICPU, p.PgbenchCPU)
		}
		if len(p.WidePoolRate) > 0 {
			p.WidePoolMedian = round2(median(p.WidePoolRate))
			p.WidePoolRatio = round2(ratio(p.WidePoolMedian, median(p.PgbenchTPS)))
		}
		p.APIMedian, p.PgbenchMedian = round2(median(p.APIRate)), round2(median(p.PgbenchTPS))
		p.Ratio = round2(ratio(p.APIMedian, p.PgbenchMedian))
		p.PipelinedMedian = round2(median(p.PipelinedTPS))
		p.PipelinedRatio = round2(ratio(p.APIMedian, p.PipelinedMedian))
		for _, lr := range apiRuns {
			if round2(lr.RequestsPerSec) == p.APIMedian || p.APIP50 == 0 {
				p.APIP50, p.APIP99 = lr.CreateLatency.P50, lr.CreateLatency.P99
			}
		}
		if len(p.APIErrors) == 0 {
			p.APIErrors = nil
		}
		res.Create = append(res.Create, p)
	}
	if err := hs.Shutdown(ctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// createScript is the API's create transaction (services/api store.go
// createTask) as a pgbench script: the same four statements on rows of the
// same sizes (the idempotency record inserted complete, its foreign key
// checked at COMMIT: migration 00016; until 2026-12-06 it was inserted
// in_progress and completed by a fifth statement). Ids come from pgbench's client id and a random number; the
// API computes its ids (UUIDv7) in Go.
func createScript(fx *fixtures) string {
	return createReplacer(fx).Replace(`\set r random(1, 1000000000000000)
BEGIN;
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, created_at, expires_at) VALUES ($SCOPE, $ID, $FP, 'succeeded', $ID, 202, $RESP, now(), now() + 86400000 * interval '1 millisecond') ON CONFLICT (scope, idempotency_key) DO NOTHING RETURNING created_at;
INSERT INTO task (task_id, tenant_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at) VALUES ($ID, $TENANT, $FP, 'queued', 0, 0, 'jcs', $INSHA, $INSIZE, now(), now());
INSERT INTO task_input (task_id, document) VALUES ($ID, $DOC);
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at) VALUES ('o' || $ID, $ID, 0, 'TaskCreated', $PAYLOAD, $PSHA, now());
END;
`)
}

// createScriptPipelined is the create transaction exactly as the API sends
// it (services/api store.go: the same statements, in two pipelines with one
// Sync each): BEGIN and the idempotency record insert; then the task,
// task_input and outbox inserts and COMMIT.
func createScriptPipelined(fx *fixtures) string {
	return createReplacer(fx).Replace(`\set r random(1, 1000000000000000)
\startpipeline
BEGIN;
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, created_at, expires_at) VALUES ($SCOPE, $ID, $FP, 'succeeded', $ID, 202, $RESP, now(), now() + 86400000 * interval '1 millisecond') ON CONFLICT (scope, idempotency_key) DO NOTHING RETURNING created_at;
\endpipeline
\startpipeline
INSERT INTO task (task_id, tenant_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at) VALUES ($ID, $TENANT, $FP, 'queued', 0, 0, 'jcs', $INSHA, $INSIZE, now(), now());
INSERT INTO task_input (task_id, document) VALUES ($ID, $DOC);
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at) VALUES ('o' || $ID, $ID, 0, 'TaskCreated', $PAYLOAD, $PSHA, now());
COMMIT;
\endpipeline
`)
}

// createReplacer fills the placeholders of the create scripts: ids from
// pgbench's client id and a random number, rows of the API's sizes.
func createReplacer(fx *fixtures) *strings.Replacer {
	id := `'pgb-' || :client_id::text || '-' || :r::text`
	payload, sha := fx.event(phTask, phOutbox)
	return strings.NewReplacer(
		"$ID", id,
		"$SCOPE", sqlText(tenant.CreateScope(fx.tenantID)),
		"$TENANT", sqlText(fx.tenantID),
		"$FP", "'"+fx.fingerprint+"'",
		"$INSHA", "'"+fx.inputSHA+"'",
		"$INSIZE", fmt.Sprint(fx.inputSize),
		"$DOC", sqlBytea(fx.doc),
		"$PAYLOAD", sqlText(string(payload)),
		"$PSHA", "'"+sha+"'",
		"$RESP", sqlText(string(fx.response)),
	)
}
