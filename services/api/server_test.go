package api

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/internal/testenv"
)

func TestRoutesAndProblems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	wantProblem(t, b.do(t, http.MethodGet, "/nope", nil, nil), http.StatusNotFound, CodeNotFound)
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks", nil, nil), http.StatusMethodNotAllowed, CodeMethodNotAllowed)
	r := b.do(t, http.MethodDelete, "/v1/tasks/abc", nil, nil)
	wantProblem(t, r, http.StatusMethodNotAllowed, CodeMethodNotAllowed)
	if allow := r.header.Get("Allow"); !strings.Contains(allow, "GET") {
		t.Fatalf("Allow %q", allow)
	}
	if r := b.do(t, http.MethodGet, "/healthz", nil, nil); r.status != http.StatusOK {
		t.Fatalf("healthz %d", r.status)
	}
	if r := b.do(t, http.MethodGet, "/readyz", nil, nil); r.status != http.StatusOK {
		t.Fatalf("readyz %d %s", r.status, r.body)
	}
	b.post(t, "metrics-key-1", wrap(`1`))
	m := b.do(t, http.MethodGet, "/metrics", nil, nil)
	for _, name := range []string{
		`converge_api_requests_total{code="202",method="POST",route="/v1/tasks"} 1`,
		`converge_api_requests_total{code="404",method="GET",route="unmatched"} 1`,
		`converge_api_request_duration_seconds_bucket{method="POST",route="/v1/tasks"`,
		`converge_api_idempotency_total{outcome="created"} 1`,
		`converge_cache_requests_total{result="hit"} 0`,
		`converge_cache_stale_writes_rejected_total 0`,
	} {
		if !strings.Contains(string(m.body), name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
}

func TestPanicBecomesInternalProblem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.srv.mux.HandleFunc("GET /test/panic", func(http.ResponseWriter, *http.Request) { panic("boom") })
	wantProblem(t, b.do(t, http.MethodGet, "/test/panic", nil, nil), http.StatusInternalServerError, CodeInternal)
}

func TestDatabaseUnavailable(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://nobody@127.0.0.1:%d/none?connect_timeout=1", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b := setup(t, func(c *Config) { c.Pool = pool })
	wantProblem(t, b.post(t, "db-down-0001", wrap(`1`)), http.StatusServiceUnavailable, CodeDatabaseUnavailable)
	r := b.do(t, http.MethodGet, "/v1/tasks/018f6b2e-0000-7000-8000-000000000001", nil, nil)
	wantProblem(t, r, http.StatusServiceUnavailable, CodeDatabaseUnavailable)
	if r.header.Get("Retry-After") == "" {
		t.Fatal("503 without Retry-After")
	}
	wantProblem(t, b.do(t, http.MethodGet, "/readyz", nil, nil), http.StatusServiceUnavailable, CodeDatabaseUnavailable)
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	if _, err := New(Config{}); err == nil {
		t.Fatal("nil Pool accepted")
	}
	db := testenv.NewDB(t)
	auth := tenant.NewAuthenticator(db.Pool, 0)
	if _, err := New(Config{Pool: db.Pool}); err == nil {
		t.Fatal("nil Auth accepted")
	}
	if _, err := New(Config{Pool: db.Pool, Auth: auth, Registerer: struct{ prometheus.Registerer }{prometheus.NewRegistry()}}); err == nil {
		t.Fatal("Registerer without Gatherer accepted")
	}
	s, err := New(Config{Pool: db.Pool, Auth: auth})
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.MaxBodyBytes != 8<<20 || s.cfg.IdempotencyTTL != 24*time.Hour {
		t.Fatalf("defaults %d %s", s.cfg.MaxBodyBytes, s.cfg.IdempotencyTTL)
	}
}

func TestServeShutsDownOnCancel(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	s, err := New(Config{Pool: db.Pool, Auth: tenant.NewAuthenticator(db.Pool, 0), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	url := "http://" + ln.Addr().String() + "/healthz"
	testenv.Eventually(t, 5*time.Second, "server answers", func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve returned %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after cancel")
	}
	if _, err := http.Get(url); err == nil {
		t.Fatal("still serving after shutdown")
	}
}
