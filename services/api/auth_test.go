package api

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/internal/testenv"
)

// Every /v1/ request needs a valid bearer token: missing, malformed,
// unknown, rotated-out and disabled tokens are one 401 answer with
// WWW-Authenticate (RFC 6750); the token never reaches the logs; admin
// routes need an admin tenant (403); health and metrics need nothing.
func TestAuthentication(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	var mu sync.Mutex
	b := setup(t, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	_, disabled := b.addTenant(t, "gone", false, nil)
	if err := tenant.Disable(context.Background(), b.db.Pool, "gone"); err != nil {
		t.Fatal(err)
	}
	_, rotated := b.addTenant(t, "rotating", false, nil)
	if _, err := tenant.Rotate(context.Background(), b.db.Pool, "rotating"); err != nil {
		t.Fatal(err)
	}
	unknown, _ := tenant.NewToken()
	cases := map[string]http.Header{
		"missing":        {"Authorization": {""}},
		"basic scheme":   {"Authorization": {"Basic dXNlcjpwYXNz"}},
		"malformed":      {"Authorization": {"Bearer not-a-token"}},
		"unknown":        bearer(unknown),
		"disabled":       bearer(disabled),
		"rotated out":    bearer(rotated),
		"bearer, no arg": {"Authorization": {"Bearer"}},
		"two headers":    {"Authorization": {"Bearer " + b.token, "Bearer " + b.token}},
	}
	for name, h := range cases {
		for _, path := range []string{"/v1/tasks/01890a5d-ac96-774b-bcce-b302099a8057", "/v1/admin/dead-letters"} {
			r := b.do(t, http.MethodGet, path, h, nil)
			wantProblem(t, r, http.StatusUnauthorized, CodeUnauthenticated)
			if got := r.header.Get("WWW-Authenticate"); !strings.HasPrefix(got, "Bearer") {
				t.Errorf("%s %s: WWW-Authenticate %q", name, path, got)
			}
		}
		h := h.Clone()
		h.Set("Content-Type", "application/json")
		h.Set("Idempotency-Key", "auth-key-1")
		wantProblem(t, b.do(t, http.MethodPost, "/v1/tasks", h, wrap(`{"a":1}`)), http.StatusUnauthorized, CodeUnauthenticated)
	}
	if n := b.count(t, "task"); n != 0 {
		t.Errorf("%d tasks created without a valid token", n)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/admin/dead-letters", bearer(b.token), nil), http.StatusForbidden, CodeForbidden)
	if r := b.do(t, http.MethodGet, "/v1/admin/dead-letters", nil, nil); r.status == http.StatusUnauthorized || r.status == http.StatusForbidden {
		t.Errorf("admin token on an admin route: %d %s", r.status, r.body)
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		if r := b.do(t, http.MethodGet, path, http.Header{"Authorization": {""}}, nil); r.status != http.StatusOK {
			t.Errorf("%s without a token: %d", path, r.status)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, tok := range []string{b.token, b.adminToken, disabled, rotated, unknown} {
		if strings.Contains(logs.String(), tok) || strings.Contains(logs.String(), tok[len(tenant.TokenPrefix):]) {
			t.Errorf("a token appears in the logs")
		}
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// A tenant reads only its own tasks and artifacts: another tenant's are
// 404 TASK_NOT_FOUND, as unknown ids are (no oracle), from PostgreSQL and
// from the Redis view alike; an admin reads every task. The same
// Idempotency-Key in two tenants is two tasks.
func TestTenantIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, other := b.addTenant(t, "team-b", false, nil)
	post := func(token, key, doc string) *response {
		h := bearer(token)
		h.Set("Content-Type", "application/json")
		h.Set("Idempotency-Key", key)
		return b.do(t, http.MethodPost, "/v1/tasks", h, wrap(doc))
	}
	a := post(b.token, "shared-key-1", `{"owner":"a"}`)
	bb := post(other, "shared-key-1", `{"owner":"b"}`) // a different document: no 422, another intent
	if a.status != http.StatusAccepted || bb.status != http.StatusAccepted {
		t.Fatalf("creates: %d %s / %d %s", a.status, a.body, bb.status, bb.body)
	}
	idA, idB := a.json(t)["task_id"].(string), bb.json(t)["task_id"].(string)
	if idA == idB || a.header.Get("Idempotent-Replayed") != "" || bb.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("same key in two tenants: tasks %s and %s", idA, idB)
	}
	for range 2 { // the second read is served from the view the first back-filled
		wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+idA, bearer(other), nil), http.StatusNotFound, CodeTaskNotFound)
		if r := b.do(t, http.MethodGet, "/v1/tasks/"+idA, nil, nil); r.status != http.StatusOK || r.json(t)["tenant_id"] != b.tenant.ID {
			t.Fatalf("owner's read: %d %s", r.status, r.body)
		}
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+idA+"/artifact", bearer(other), nil), http.StatusNotFound, CodeTaskNotFound)
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+idA+"/artifact", nil, nil), http.StatusConflict, CodeArtifactNotReady)
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+idB, bearer(b.adminToken), nil); r.status != http.StatusOK {
		t.Errorf("admin read of another tenant's task: %d", r.status)
	}
	// A task of before tenants (no owner) is an admin's only.
	legacy := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"legacy":true}`))
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+legacy.Task.TaskID, nil, nil), http.StatusNotFound, CodeTaskNotFound)
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+legacy.Task.TaskID, bearer(b.adminToken), nil); r.status != http.StatusOK {
		t.Errorf("admin read of a task without tenant: %d", r.status)
	}
}

// Seed 2.2 through the API: 50 concurrent creates against a quota of 10 —
// exactly 10 tasks (each with its record and outbox row), 40 × 429
// QUOTA_EXHAUSTED with nothing written, remaining 0; a replay of a created
// key still answers 202 and consumes nothing.
func TestQuotaThroughTheAPI(t *testing.T) {
	t.Parallel()
	b := setup(t)
	q := int64(10)
	limited, tok := b.addTenant(t, "limited", false, &q)
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[int]int{}
	var firstKey string
	for i := range 50 {
		wg.Go(func() {
			h := bearer(tok)
			h.Set("Content-Type", "application/json")
			h.Set("Idempotency-Key", "quota-key-"+testenv.Itoa(i))
			r, err := b.try(http.MethodPost, "/v1/tasks", h, wrap(`{"n":`+testenv.Itoa(i)+`}`))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			statuses[r.status]++
			if r.status == http.StatusAccepted && firstKey == "" {
				firstKey = "quota-key-" + testenv.Itoa(i)
			}
			mu.Unlock()
			if r.status == http.StatusTooManyRequests {
				if p := r.json(t); p["code"] != CodeQuotaExhausted {
					t.Errorf("429 code %v", p["code"])
				}
			}
		})
	}
	wg.Wait()
	if statuses[http.StatusAccepted] != 10 || statuses[http.StatusTooManyRequests] != 40 {
		t.Fatalf("statuses %v, want 10 × 202 and 40 × 429", statuses)
	}
	ctx := context.Background()
	var tasks, records, outbox int
	var remaining int64
	if err := b.db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM task WHERE tenant_id = $1),
  (SELECT count(*) FROM idempotency_record WHERE scope = $2),
  (SELECT count(*) FROM outbox_event),
  (SELECT remaining FROM quota WHERE tenant_id = $1)`, limited.ID, tenant.CreateScope(limited.ID)).Scan(&tasks, &records, &outbox, &remaining); err != nil {
		t.Fatal(err)
	}
	if tasks != 10 || records != 10 || outbox != 10 || remaining != 0 {
		t.Errorf("tasks %d, records %d, outbox rows %d, remaining %d; want 10, 10, 10, 0", tasks, records, outbox, remaining)
	}
	h := bearer(tok)
	h.Set("Content-Type", "application/json")
	h.Set("Idempotency-Key", firstKey)
	var n string
	for i := range 50 {
		if "quota-key-"+testenv.Itoa(i) == firstKey {
			n = testenv.Itoa(i)
		}
	}
	if r := b.do(t, http.MethodPost, "/v1/tasks", h, wrap(`{"n":`+n+`}`)); r.status != http.StatusAccepted || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("replay with the quota used up: %d %s", r.status, r.body)
	}
}

// stalledPost starts a POST /v1/tasks as token whose body never ends until
// the returned func is called; it returns once the server is reading it.
func (b *testBundle) stalledPost(t *testing.T, token, key string, want int) (finish func() *response) {
	t.Helper()
	pr, pw := io.Pipe()
	req, err := http.NewRequest(http.MethodPost, b.ts.URL+"/v1/tasks", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.Header = http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {key}, "Authorization": {"Bearer " + token}}
	done := make(chan *response, 1)
	go func() {
		resp, err := b.ts.Client().Do(req)
		if err != nil {
			done <- &response{status: -1, body: []byte(err.Error())}
			return
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		done <- &response{status: resp.StatusCode, header: resp.Header, body: data}
	}()
	// Never leave the request hanging (the server's Close would wait for
	// it): cleanups run before the bundle's, which were registered first.
	t.Cleanup(func() { pw.CloseWithError(io.ErrClosedPipe) })
	// Whitespace fills the transport's buffer, so headers and the first
	// chunk reach the server now; then wait until the handler reads it.
	start := append([]byte(`{"document":`), bytes.Repeat([]byte(" "), 16<<10)...)
	go func() { _, _ = pw.Write(start) }()
	testenv.Eventually(t, 10*time.Second, "the stalled request in process", func() bool {
		b.srv.limits.mu.Lock()
		defer b.srv.limits.mu.Unlock()
		return b.srv.limits.bytes > 0 && len(b.srv.limits.inFlight) > 0 && b.srv.limits.inFlight[b.tenantOf(t, token)] >= want
	})
	return func() *response {
		// The server may have stopped reading (a timeout): never block on
		// the pipe.
		go func() {
			_, _ = pw.Write([]byte(`{"stalled":true}}`))
			pw.Close()
		}()
		select {
		case r := <-done:
			pw.CloseWithError(io.ErrClosedPipe)
			return r
		case <-time.After(20 * time.Second):
			pw.CloseWithError(io.ErrClosedPipe)
			t.Error("no response 20s after the body ended")
			return &response{status: -1}
		}
	}
}

// One tenant cannot take every handler: beyond MaxInFlightPerTenant
// requests in process its next is 429 RATE_LIMITED with Retry-After, while
// another tenant is still served.
func TestInFlightLimitPerTenant(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxInFlightPerTenant = 2 })
	_, other := b.addTenant(t, "team-b", false, nil)
	f1 := b.stalledPost(t, b.token, "stall-key-1", 1)
	f2 := b.stalledPost(t, b.token, "stall-key-2", 2)
	testenv.Eventually(t, 10*time.Second, "the tenant's third request refused", func() bool {
		r := b.post(t, "stall-key-3", wrap(`{"third":true}`))
		if r.status == http.StatusTooManyRequests {
			wantProblem(t, r, http.StatusTooManyRequests, CodeRateLimited)
			if r.header.Get("Retry-After") == "" {
				t.Error("429 RATE_LIMITED without Retry-After")
			}
			return true
		}
		return false
	})
	h := bearer(other)
	h.Set("Content-Type", "application/json")
	h.Set("Idempotency-Key", "other-tenant-1")
	if r := b.do(t, http.MethodPost, "/v1/tasks", h, wrap(`{"other":true}`)); r.status != http.StatusAccepted {
		t.Fatalf("another tenant while the first is at its limit: %d %s", r.status, r.body)
	}
	for _, f := range []func() *response{f1, f2} {
		if r := f(); r.status != http.StatusAccepted {
			t.Errorf("stalled request after its body ended: %d %s", r.status, r.body)
		}
	}
	if r := b.post(t, "stall-key-3", wrap(`{"third":true}`)); r.status != http.StatusAccepted {
		t.Errorf("after the others ended: %d %s", r.status, r.body)
	}
}

// Request bodies in flight are bounded in bytes: with the bound taken by a
// body being read, the next create is 503 OVERLOADED with Retry-After,
// before its body is read; a body that stops arriving is 408
// REQUEST_TIMEOUT, not 400.
func TestBodyLimits(t *testing.T) {
	t.Parallel()
	t.Run("bytes in flight", func(t *testing.T) {
		t.Parallel()
		b := setup(t, func(c *Config) { c.MaxBodyBytes = 1 << 20; c.MaxBodyBytesInFlight = 1 << 20 })
		f := b.stalledPost(t, b.token, "big-stall-1", 1) // chunked: reserves MaxBodyBytes
		testenv.Eventually(t, 10*time.Second, "a second body refused", func() bool {
			r := b.post(t, "small-1", wrap(`{"small":true}`))
			if r.status == http.StatusServiceUnavailable {
				wantProblem(t, r, http.StatusServiceUnavailable, CodeOverloaded)
				return r.header.Get("Retry-After") != ""
			}
			return false
		})
		if r := f(); r.status != http.StatusAccepted {
			t.Errorf("the first body: %d %s", r.status, r.body)
		}
		if r := b.post(t, "small-1", wrap(`{"small":true}`)); r.status != http.StatusAccepted {
			t.Errorf("after the first ended: %d %s", r.status, r.body)
		}
	})
	t.Run("a tenant's share", func(t *testing.T) {
		t.Parallel()
		// One tenant holding its share (a quarter) of the bytes in flight
		// is refused more, and another tenant is still read.
		b := setup(t, func(c *Config) { c.MaxBodyBytes = 1 << 20; c.MaxBodyBytesInFlight = 4 << 20 })
		_, other := b.addTenant(t, "team-b", false, nil)
		f := b.stalledPost(t, b.token, "share-stall-1", 1)
		wantProblem(t, b.post(t, "share-small-1", wrap(`{"small":true}`)), http.StatusServiceUnavailable, CodeOverloaded)
		h := bearer(other)
		h.Set("Content-Type", "application/json")
		h.Set("Idempotency-Key", "share-other-1")
		if r := b.do(t, http.MethodPost, "/v1/tasks", h, wrap(`{"other":true}`)); r.status != http.StatusAccepted {
			t.Errorf("another tenant while the first holds its share: %d %s", r.status, r.body)
		}
		if r := f(); r.status != http.StatusAccepted {
			t.Errorf("the stalled body: %d %s", r.status, r.body)
		}
	})
	t.Run("body slower than the request timeout", func(t *testing.T) {
		t.Parallel()
		b := setup(t, func(c *Config) { c.RequestTimeout = 500 * time.Millisecond })
		f := b.stalledPost(t, b.token, "slower-than-request-1", 1)
		time.Sleep(time.Second)
		r := f()
		wantProblem(t, r, http.StatusRequestTimeout, CodeRequestTimeout)
		if n := b.count(t, "task"); n != 0 {
			t.Errorf("%d tasks from a body that timed out", n)
		}
	})
	t.Run("slow body", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		srv := httptest.NewUnstartedServer(b.srv.Handler())
		srv.Config.ReadTimeout = 300 * time.Millisecond
		srv.Start()
		t.Cleanup(srv.Close)
		b.ts = srv
		f := b.stalledPost(t, b.token, "slow-body-1", 1)
		time.Sleep(time.Second)
		r := f()
		if r.status != http.StatusRequestTimeout {
			t.Fatalf("slow body: %d %s, want 408", r.status, r.body)
		}
		wantProblem(t, r, http.StatusRequestTimeout, CodeRequestTimeout)
		if n := b.count(t, "task"); n != 0 {
			t.Errorf("%d tasks from a body that timed out", n)
		}
	})
}

// The admin endpoints are served only on the admin plane's listener, the
// public API only on its own; /metrics and /healthz on both.
func TestAdminPlaneApart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	get := func(base, path, token string) int {
		req, _ := http.NewRequest(http.MethodGet, base+path, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := get(b.ts.URL, "/v1/admin/dead-letters", b.adminToken); st != http.StatusNotFound {
		t.Errorf("admin endpoint on the public listener: %d, want 404", st)
	}
	if st := get(b.adminTS.URL, "/v1/tasks/01890a5d-ac96-774b-bcce-b302099a8057", b.token); st != http.StatusNotFound {
		t.Errorf("public endpoint on the admin listener: %d, want 404", st)
	}
	if st := get(b.adminTS.URL, "/v1/admin/dead-letters", b.adminToken); st == http.StatusNotFound || st == http.StatusUnauthorized {
		t.Errorf("admin endpoint on the admin listener: %d", st)
	}
	for _, base := range []string{b.ts.URL, b.adminTS.URL} {
		for _, path := range []string{"/metrics", "/healthz"} {
			if st := get(base, path, ""); st != http.StatusOK {
				t.Errorf("%s%s: %d", base, path, st)
			}
		}
	}
}

// The tenant admin endpoints (admin plane, admin token): add shows the
// token once and it works; list never shows tokens; rotate replaces it;
// disable stops it; names are checked; a non-admin is 403.
func TestAdminTenants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	jh := http.Header{"Content-Type": {"application/json"}}
	r := b.do(t, http.MethodPost, "/v1/admin/tenants", jh, []byte(`{"name":"team-z","quota":3}`))
	if r.status != http.StatusCreated {
		t.Fatalf("add: %d %s", r.status, r.body)
	}
	tok, _ := r.json(t)["token"].(string)
	if !tenant.WellFormed(tok) {
		t.Fatalf("add answered token %q", tok)
	}
	if g := b.do(t, http.MethodGet, "/v1/tasks/01890a5d-ac96-774b-bcce-b302099a8057", bearer(tok), nil); g.status != http.StatusNotFound {
		t.Errorf("new token: %d, want 404 (authenticated)", g.status)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants", jh, []byte(`{"name":"team-z"}`)), http.StatusConflict, CodeTenantExists)
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants", jh, []byte(`{"name":"Bad Name"}`)), http.StatusBadRequest, CodeInvalidAdminRequest)
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants", jh, []byte(`{"name":"x","quota":-1}`)), http.StatusBadRequest, CodeInvalidAdminRequest)
	l := b.do(t, http.MethodGet, "/v1/admin/tenants", nil, nil)
	if l.status != http.StatusOK || bytes.Contains(l.body, []byte(tok)) || !bytes.Contains(l.body, []byte(`"team-z"`)) {
		t.Fatalf("list: %d %s", l.status, l.body)
	}
	rot := b.do(t, http.MethodPost, "/v1/admin/tenants/team-z/rotate", nil, nil)
	newTok, _ := rot.json(t)["token"].(string)
	if rot.status != http.StatusOK || !tenant.WellFormed(newTok) || newTok == tok {
		t.Fatalf("rotate: %d %s", rot.status, rot.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants/nobody/rotate", nil, nil), http.StatusNotFound, CodeTenantNotFound)
	if d := b.do(t, http.MethodPost, "/v1/admin/tenants/team-z/disable", nil, nil); d.status != http.StatusOK || d.json(t)["disabled_at"] == nil {
		t.Fatalf("disable: %d %s", d.status, d.body)
	}
	h := http.Header{"Authorization": {"Bearer " + b.token}}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/admin/tenants", h, nil), http.StatusForbidden, CodeForbidden)
}

// A create refused before its body is read (here: its tenant's share of
// body bytes is taken) is answered at once, even while the client is still
// in the middle of a chunked body, and the connection is closed.
func TestRejectionDoesNotWaitForTheBody(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxBodyBytes = 1 << 20; c.MaxBodyBytesInFlight = 4 << 20 })
	f := b.stalledPost(t, b.token, "reject-stall-1", 1)
	defer f()
	conn, err := net.Dial("tcp", strings.TrimPrefix(b.ts.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := "POST /v1/tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b.token +
		"\r\nContent-Type: application/json\r\nIdempotency-Key: reject-stall-2\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"doc\r\n"
	if _, err := conn.Write([]byte(req)); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer while the body stalls: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !resp.Close {
		t.Errorf("status %d, close %v; want 503 and Connection: close", resp.StatusCode, resp.Close)
	}
}

// Admin bodies are strict: a repeated member is refused, not "last wins".
func TestAdminBodiesRefuseRepeatedMembers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	jh := http.Header{"Content-Type": {"application/json"}}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants", jh, []byte(`{"name":"team-d","name":"team-e"}`)), http.StatusBadRequest, CodeInvalidAdminRequest)
	if _, err := tenant.Get(context.Background(), b.db.Pool, "team-e"); err == nil {
		t.Error("a tenant was created from a body with a repeated member")
	}
	if err := tenant.Disable(context.Background(), b.db.Pool, "team-a"); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/tenants/team-a/rotate", nil, nil), http.StatusConflict, CodeTenantDisabled)
}
