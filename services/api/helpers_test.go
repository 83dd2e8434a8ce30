package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/internal/testenv"
)

type testBundle struct {
	db        *testenv.DB
	rdb       *redis.Client
	reg       *prometheus.Registry
	artifacts *artifact.Store
	srv       *Server
	ts        *httptest.Server
	adminTS   *httptest.Server // the admin plane (AdminHandler): /v1/admin/ requests go here
	// tenant and token: the tenant requests are sent as (Authorization:
	// Bearer token) unless a test sets Authorization itself; admin routes
	// use adminToken.
	tenant     tenant.Tenant
	token      string
	adminToken string
}

// setup starts a Server over a fresh database and the shared Redis; opts
// adjust the Config before New.
func setup(t *testing.T, opts ...func(*Config)) *testBundle {
	t.Helper()
	return setupWith(t, func(_ *testBundle, c *Config) {
		for _, o := range opts {
			o(c)
		}
	})
}

// setupWith is setup whose option sees the bundle (its database, tenants
// and tokens) as well as the Config.
func setupWith(t *testing.T, opt func(*testBundle, *Config)) *testBundle {
	t.Helper()
	db := testenv.NewDB(t)
	_, rdb := testenv.Redis(t)
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	b := &testBundle{db: db, rdb: rdb, reg: prometheus.NewRegistry(), artifacts: store}
	b.tenant, b.token = b.addTenant(t, "team-a", false, nil)
	_, b.adminToken = b.addTenant(t, "ops", true, nil)
	cfg := Config{Pool: db.Pool, Redis: rdb, ArtifactStore: store, Registerer: b.reg,
		Auth: tenant.NewAuthenticator(db.Pool, 0), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	opt(b, &cfg)
	b.srv, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.ts = httptest.NewServer(b.srv.Handler())
	t.Cleanup(b.ts.Close)
	b.adminTS = httptest.NewServer(b.srv.AdminHandler())
	t.Cleanup(b.adminTS.Close)
	return b
}

// addTenant adds a tenant to the bundle's database and returns it with its
// token.
func (b *testBundle) addTenant(t *testing.T, name string, admin bool, quota *int64) (tenant.Tenant, string) {
	t.Helper()
	ten, tok, err := tenant.Add(context.Background(), b.db.Pool, name, admin, quota)
	if err != nil {
		t.Fatal(err)
	}
	return ten, tok
}

// tenantOf returns the tenant id of token.
func (b *testBundle) tenantOf(t *testing.T, token string) string {
	t.Helper()
	p, err := tenant.Lookup(context.Background(), b.db.Pool, token)
	if err != nil {
		t.Fatal(err)
	}
	return p.TenantID
}

// bearer is the Authorization header of token.
func bearer(token string) http.Header { return http.Header{"Authorization": {"Bearer " + token}} }

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r *response) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("response body %q: %v", r.body, err)
	}
	return m
}

func (b *testBundle) do(t *testing.T, method, path string, header http.Header, body []byte) *response {
	t.Helper()
	resp, err := b.try(method, path, header, body)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func (b *testBundle) try(method, path string, header http.Header, body []byte) (*response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	base := b.ts.URL
	if strings.HasPrefix(path, "/v1/admin/") {
		base = b.adminTS.URL
	}
	req, err := http.NewRequest(method, base+path, rd)
	if err != nil {
		return nil, err
	}
	if strings.HasPrefix(path, "/v1/admin/") {
		req.Header.Set("Authorization", "Bearer "+b.adminToken)
	} else {
		req.Header.Set("Authorization", "Bearer "+b.token)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := b.ts.Client().Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return &response{status: resp.StatusCode, header: resp.Header, body: data}, nil
}

// post sends POST /v1/tasks with a JSON content type and the key (none
// when key is "").
func (b *testBundle) post(t *testing.T, key string, body []byte) *response {
	t.Helper()
	h := http.Header{"Content-Type": {"application/json"}}
	if key != "" {
		h.Set("Idempotency-Key", key)
	}
	return b.do(t, http.MethodPost, "/v1/tasks", h, body)
}

func wrap(doc string) []byte { return []byte(`{"document":` + doc + `}`) }

func (b *testBundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	if err := b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// wantProblem checks a problem+json answer with status and code.
func wantProblem(t *testing.T, r *response, status int, code string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d (body %s)", r.status, status, clip(string(r.body), 300))
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q, want application/problem+json", ct)
	}
	p := r.json(t)
	if p["code"] != code {
		t.Fatalf("code %v, want %s (detail %v)", p["code"], code, p["detail"])
	}
	wantType := "https://converge.dev/problems/" + strings.ReplaceAll(strings.ToLower(code), "_", "-")
	if p["type"] != wantType || p["status"] != float64(status) || p["title"] == "" {
		t.Fatalf("problem members: %v", p)
	}
}

// counterValue returns a counter (vector children matching labels) from reg.
func counterValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	return testenv.MetricSum(t, reg, name, labels)
}
