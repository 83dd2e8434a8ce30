package api

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/projections/taskview"
)

func TestGetTaskCacheAside(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/018f6b2e-0000-7000-8000-000000000000", nil, nil), http.StatusNotFound, CodeTaskNotFound)
	for _, garbage := range []string{"%ff%fe", "x%00y", "..%2f..", "a%20b", "-dash-first", "%22quoted%22"} {
		wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+garbage, nil, nil), http.StatusNotFound, CodeTaskNotFound)
		wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+garbage+"/artifact", nil, nil), http.StatusNotFound, CodeTaskNotFound)
	}

	created := b.post(t, "get-task-0001", wrap(`{"a":1}`))
	id := created.json(t)["task_id"].(string)

	miss := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if miss.status != http.StatusOK || miss.header.Get("Cache-Status") != "converge; fwd=miss; stored" {
		t.Fatalf("first read: %d Cache-Status %q", miss.status, miss.header.Get("Cache-Status"))
	}
	body := miss.json(t)
	if body["task_id"] != id || body["status"] != "queued" || body["version"] != float64(0) || miss.header.Get("ETag") != `"0"` {
		t.Fatalf("first read body %v etag %s", body, miss.header.Get("ETag"))
	}
	if links, _ := body["links"].(map[string]any); links["self"] != "/v1/tasks/"+id {
		t.Fatalf("links %v", body["links"])
	}
	hit := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if hit.status != http.StatusOK || hit.header.Get("Cache-Status") != "converge; hit" || string(hit.body) != string(miss.body) {
		t.Fatalf("second read: %d %q %s", hit.status, hit.header.Get("Cache-Status"), hit.body)
	}
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+id, http.Header{"If-None-Match": {`"0"`}}, nil); r.status != http.StatusNotModified {
		t.Fatalf("If-None-Match: %d", r.status)
	}

	// A newer projection (v5) wins; a stale one (v3) is refused; the read
	// returns the view with its version.
	cache, err := taskview.NewCache(b.rdb, taskview.CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v5 := taskevent.Task{TaskID: id, TenantID: b.tenant.ID, Status: taskevent.StatusRunning, Version: 5, Attempt: 1, OutputFormat: "jcs",
		InputSHA256: body["input_sha256"].(string), InputSize: 7, CreatedAt: time.Now().UTC(), UpdatedAt: time.Now().UTC()}
	if stored, err := cache.Put(ctx, v5); err != nil || !stored {
		t.Fatalf("put v5: %v %v", stored, err)
	}
	v3 := v5
	v3.Version, v3.Status = 3, taskevent.StatusQueued
	if stored, err := cache.Put(ctx, v3); err != nil || stored {
		t.Fatalf("put v3 after v5: stored=%v %v", stored, err)
	}
	r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if r.json(t)["version"] != float64(5) || r.json(t)["status"] != "running" || r.header.Get("ETag") != `"5"` {
		t.Fatalf("view after projections: %s", r.body)
	}

	// After an invalidation the next read back-fills from PostgreSQL.
	if err := cache.Invalidate(ctx, id); err != nil {
		t.Fatal(err)
	}
	r = b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if r.header.Get("Cache-Status") != "converge; fwd=miss; stored" || r.json(t)["version"] != float64(0) {
		t.Fatalf("after invalidate: %q %s", r.header.Get("Cache-Status"), r.body)
	}
	for result, want := range map[string]float64{"hit": 3, "miss": 3} {
		if n := counterValue(t, b.reg, "converge_cache_requests_total", map[string]string{"result": result}); n != want {
			t.Errorf("cache_requests{result=%s} = %v, want %v", result, n, want)
		}
	}
	// A UUID is case-insensitive on input (RFC 9562): the upper-case form
	// names the same task.
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+strings.ToUpper(id), nil, nil); r.status != http.StatusOK || r.json(t)["task_id"] != id {
		t.Fatalf("upper-case id: %d %s", r.status, r.body)
	}
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+strings.ToUpper(id)+"/artifact", nil, nil); r.status != http.StatusConflict {
		t.Fatalf("artifact by upper-case id: %d %s", r.status, r.body)
	}
}

// brokenLimiter fails every Redis command while on.
type brokenLimiter struct{ on atomic.Bool }

func (l *brokenLimiter) Allow() error {
	if l.on.Load() {
		return errors.New("redis down (test)")
	}
	return nil
}
func (l *brokenLimiter) ReportResult(error) {}

func TestGetTaskRedisDownFallsBackToDatabase(t *testing.T) {
	t.Parallel()
	url, _ := testenv.Redis(t)
	opt, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	lim := &brokenLimiter{}
	opt.Limiter = lim
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	b := setup(t, func(c *Config) { c.Redis = rdb })

	id := b.post(t, "redis-down-0001", wrap(`{"x":[]}`)).json(t)["task_id"].(string)
	lim.on.Store(true)
	r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if r.status != http.StatusOK || r.header.Get("Cache-Status") != "converge; fwd=miss; detail=error" || r.json(t)["task_id"] != id {
		t.Fatalf("read with Redis down: %d %q %s", r.status, r.header.Get("Cache-Status"), r.body)
	}
	// Redis is a derived view: down, it degrades readiness, it does not
	// remove it (issue 13).
	if r := b.do(t, http.MethodGet, "/readyz", nil, nil); r.status != http.StatusOK || r.json(t)["status"] != "ready" ||
		fmt.Sprint(r.json(t)["degraded"]) != "[redis]" {
		t.Fatalf("readyz with Redis down: %d %s; want 200 ready, degraded [redis]", r.status, r.body)
	}
	if n := counterValue(t, b.reg, "converge_cache_requests_total", map[string]string{"result": "error"}); n != 1 {
		t.Fatalf("cache errors %v", n)
	}
	lim.on.Store(false)
	if r := b.do(t, http.MethodGet, "/readyz", nil, nil); r.status != http.StatusOK {
		t.Fatalf("readyz after recovery: %d %s", r.status, r.body)
	}
}

// A Redis that accepts connections and never answers (hung) costs a read
// at most CacheTimeout before PostgreSQL answers, and /readyz answers
// within its own bound, ready and degraded (issue 13: go-redis's default
// 3 s read timeout and ignored deadlines made these take 5-10 s).
func TestHungRedisBoundedByDeadlines(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var held []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // read nothing, answer nothing
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	opt, err := taskview.ClientOptions("redis://" + ln.Addr().String() + "/0")
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	b := setup(t, func(c *Config) { c.Redis = rdb; c.CacheTimeout = 200 * time.Millisecond })
	id := b.post(t, "redis-hung-0001", wrap(`{"x":1}`)).json(t)["task_id"].(string)

	start := time.Now()
	r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if took := time.Since(start); r.status != http.StatusOK || took > 2*time.Second {
		t.Fatalf("read with Redis hung: %d after %s; want 200 well within 2s (two 200ms cache budgets)", r.status, took)
	}
	start = time.Now()
	r = b.do(t, http.MethodGet, "/readyz", nil, nil)
	if took := time.Since(start); r.status != http.StatusOK || fmt.Sprint(r.json(t)["degraded"]) != "[redis]" || took > 900*time.Millisecond {
		t.Fatalf("readyz with Redis hung: %d %s after %s; want 200 degraded well within its 1s bound (CacheTimeout)", r.status, r.body, took)
	}
}

func TestGetTaskWithoutRedis(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.Redis = nil })
	id := b.post(t, "no-redis-0001", wrap(`true`)).json(t)["task_id"].(string)
	r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil)
	if r.status != http.StatusOK || r.header.Get("Cache-Status") != "" {
		t.Fatalf("%d %q", r.status, r.header.Get("Cache-Status"))
	}
}

// Answers of Go's HTTP server that never reach converge (README, Errors):
// an invalid percent-escape in the path and a control character in a header
// value are 400 text/plain; a header section over http.DefaultMaxHeaderBytes
// (1 MiB) is 431 text/plain.
func TestServerLevelBadRequests(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, c := range map[string]struct {
		req  string
		want int
	}{
		"invalid escape":        {"GET /v1/tasks/%zz HTTP/1.1\r\nHost: x\r\n\r\n", http.StatusBadRequest},
		"NUL in a header value": {"GET /v1/tasks/x HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", http.StatusBadRequest},
		"header over 1 MiB": {"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nIdempotency-Key: " + strings.Repeat("k", http.DefaultMaxHeaderBytes+8192) + "\r\n\r\n",
			http.StatusRequestHeaderFieldsTooLarge},
	} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(b.ts.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write([]byte(c.req)); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if resp.StatusCode != c.want || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
			t.Errorf("%s: %d %s, want %d text/plain", name, resp.StatusCode, resp.Header.Get("Content-Type"), c.want)
		}
		resp.Body.Close()
		conn.Close()
	}
}
