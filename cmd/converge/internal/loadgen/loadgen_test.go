package loadgen

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestHistogramQuantiles(t *testing.T) {
	t.Parallel()
	var h Histogram
	for i := 100; i >= 1; i-- {
		h.Record(time.Duration(i) * time.Millisecond)
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{
		{0.5, 50 * time.Millisecond},
		{0.9, 90 * time.Millisecond},
		{0.99, 99 * time.Millisecond},
		{1, 100 * time.Millisecond},
		{0, time.Millisecond},
	} {
		if got := h.Quantile(tc.q); got != tc.want {
			t.Errorf("Quantile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	s := h.Summary()
	if s.Count != 100 || s.P99 != 99 || s.Max != 100 || s.Mean != 50.5 {
		t.Errorf("Summary = %+v", s)
	}
	var empty Histogram
	if empty.Quantile(0.99) != 0 || empty.Summary() != (Summary{}) {
		t.Error("empty histogram is not zero")
	}
}

// fakeAPI accepts creates (every tenth one is refused with a problem code),
// answers GET with a completed task, and can be slowed down.
type fakeAPI struct {
	mu      sync.Mutex
	keys    map[string]bool
	n       atomic.Int64
	delay   time.Duration
	created time.Time
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/healthz" {
		io.WriteString(w, `{"status":"ok"}`)
		return
	}
	if r.Method == http.MethodGet {
		c := f.created.Add(30 * time.Millisecond)
		json.NewEncoder(w).Encode(map[string]any{"status": "completed", "created_at": f.created, "completed_at": c})
		return
	}
	body, _ := io.ReadAll(r.Body)
	time.Sleep(f.delay)
	key := r.Header.Get("Idempotency-Key")
	f.mu.Lock()
	dup := f.keys[key]
	f.keys[key] = true
	f.mu.Unlock()
	n := f.n.Add(1)
	if dup || !strings.HasPrefix(string(body), `{"output_format":"jcs","document":{`) {
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"code":"UNEXPECTED"}`)
		return
	}
	if n%10 == 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"code":"DATABASE_UNAVAILABLE"}`)
		return
	}
	w.WriteHeader(http.StatusAccepted)
	json.NewEncoder(w).Encode(map[string]string{"task_id": "t-" + key})
}

func TestRunClosedCount(t *testing.T) {
	t.Parallel()
	api := &fakeAPI{keys: map[string]bool{}, created: time.Now()}
	ts := httptest.NewServer(api)
	defer ts.Close()
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Clients: 4, Count: 50, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests != 50 || res.Accepted != 45 || res.Errors["DATABASE_UNAVAILABLE"] != 5 || len(res.Errors) != 1 {
		t.Fatalf("requests %d accepted %d errors %v", res.Requests, res.Accepted, res.Errors)
	}
	if res.Completed != 45 || res.Pending != 0 || res.EndToEnd.P99 != 30 {
		t.Errorf("completed %d pending %d e2e %+v", res.Completed, res.Pending, res.EndToEnd)
	}
}

// TestRunOpenChargesQueueing: at a rate the server cannot keep up with, the
// latency from the intended send time grows beyond the service time
// (coordinated omission accounted for).
func TestRunOpenChargesQueueing(t *testing.T) {
	t.Parallel()
	api := &fakeAPI{keys: map[string]bool{}, created: time.Now(), delay: 20 * time.Millisecond}
	ts := httptest.NewServer(api)
	defer ts.Close()
	// 1 in flight at 20 ms each serves 50/s; 200/s for 40 requests queues.
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Rate: 200, Clients: 1, Count: 40})
	if err != nil {
		t.Fatal(err)
	}
	if res.Model != "open" || res.Requests != 40 {
		t.Fatalf("model %s requests %d", res.Model, res.Requests)
	}
	// The last request is due at 195 ms and answered after about 800 ms.
	if res.CreateLatency.Max < 400 {
		t.Errorf("max latency %.1f ms: queueing not charged", res.CreateLatency.Max)
	}
	if res.RequestsPerSec > 100 {
		t.Errorf("achieved %.1f requests/s, more than the server can do", res.RequestsPerSec)
	}
}

// TestValidateRejects: every bad setting is an error naming its flag, never a
// default silently taken or a run that ignores its duration.
func TestValidateRejects(t *testing.T) {
	t.Parallel()
	ok := Config{BaseURL: "http://127.0.0.1:8080", Duration: time.Second}
	for name, tc := range map[string]struct {
		mutate func(*Config)
		want   string
	}{
		"no url":             {func(c *Config) { c.BaseURL = "" }, "--api-url is required"},
		"url without scheme": {func(c *Config) { c.BaseURL = "not-a-url" }, "--api-url"},
		"ftp url":            {func(c *Config) { c.BaseURL = "ftp://h:1" }, "--api-url"},
		"rate NaN":           {func(c *Config) { c.Rate = math.NaN() }, "--rate NaN"},
		"rate +Inf":          {func(c *Config) { c.Rate = math.Inf(1) }, "--rate +Inf"},
		"rate negative":      {func(c *Config) { c.Rate = -5 }, "--rate -5 is negative"},
		"rate too small":     {func(c *Config) { c.Rate = 1e-11 }, "want 0.001 to"},
		"rate too large":     {func(c *Config) { c.Rate = 1e9 }, "want 0.001 to"},
		"duration negative":  {func(c *Config) { c.Duration = -5 * time.Second }, "--duration -5s is negative"},
		"count negative":     {func(c *Config) { c.Count = -5 }, "--count -5 is negative"},
		"neither":            {func(c *Config) { c.Duration = 0 }, "set --duration or --count"},
		"clients negative":   {func(c *Config) { c.Clients = -3 }, "--clients -3 is negative"},
		"doc size negative":  {func(c *Config) { c.DocSize = -1 }, "--doc-size -1 is negative"},
		"wait negative":      {func(c *Config) { c.WaitTimeout = -time.Second }, "--wait-timeout -1s is negative"},
		"key prefix short":   {func(c *Config) { c.KeyPrefix = "lgA-" }, "--key-prefix \"lgA-\""},
		"key prefix chars":   {func(c *Config) { c.KeyPrefix = "lg run/" }, "--key-prefix"},
		"key prefix long":    {func(c *Config) { c.KeyPrefix = strings.Repeat("k", 254); c.Count = 11 }, "--key-prefix"},
	} {
		c := ok
		tc.mutate(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want an error containing %q", name, err, tc.want)
		}
	}
	if err := ok.Validate(); err != nil {
		t.Errorf("valid config: %v", err)
	}
	long := ok
	long.KeyPrefix, long.Count = strings.Repeat("k", 246), 3 // keys of 247 characters
	if err := long.Validate(); err != nil {
		t.Errorf("a long prefix whose keys the API accepts: %v", err)
	}
}

// TestRunUnreachableAPI: a stopped API is one clear error before any load.
func TestRunUnreachableAPI(t *testing.T) {
	t.Parallel()
	ts := httptest.NewServer(http.NotFoundHandler())
	url := ts.URL
	ts.Close() // nothing listens there any more
	res, err := Run(context.Background(), Config{BaseURL: url, Duration: 2 * time.Second})
	if err == nil || !strings.Contains(err.Error(), "does not answer") || res != nil {
		t.Fatalf("Run = %v, %v; want no result and an error saying the API does not answer", res, err)
	}
	// Something that is not a converge API answers /healthz with 404.
	other := httptest.NewServer(http.NotFoundHandler())
	defer other.Close()
	if _, err := Run(context.Background(), Config{BaseURL: other.URL, Count: 1}); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("Run against a non-API = %v, want the /healthz status", err)
	}
}

// TestRunOpenStopsAtDuration: when the API is slower than the rate, the
// sending phase still ends at --duration; the requests that were due but
// never sent are reported, not sent late.
func TestRunOpenStopsAtDuration(t *testing.T) {
	t.Parallel()
	api := &fakeAPI{keys: map[string]bool{}, created: time.Now(), delay: 200 * time.Millisecond}
	ts := httptest.NewServer(api)
	defer ts.Close()
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Rate: 200, Clients: 2, Duration: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// 2 clients × 200 ms per request: about 6 requests fit in 500 ms, 100 were due.
	if res.Requests > 20 || res.Unsent < 80 || res.Requests+res.Unsent != 100 {
		t.Fatalf("requests %d unsent %d, want few sent and the rest of the 100 due reported unsent", res.Requests, res.Unsent)
	}
}

// TestPreflightRefusesMetricsPort: a converge component's metrics server
// answers /healthz with a plain "ok"; loadgen refuses it before any load.
func TestPreflightRefusesMetricsPort(t *testing.T) {
	t.Parallel()
	var posts atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			posts.Add(1)
		}
		io.WriteString(w, "ok")
	}))
	defer ts.Close()
	_, err := Run(context.Background(), Config{BaseURL: ts.URL, Count: 5})
	if err == nil || !strings.Contains(err.Error(), "not a metrics port") || posts.Load() != 0 {
		t.Fatalf("Run = %v after %d POSTs, want a refusal before any request", err, posts.Load())
	}
}

type failingTasks struct{}

func (failingTasks) Tasks(context.Context, []string) (map[string]TaskState, error) {
	return nil, errors.New("connection refused")
}

// TestWaitReportsReadFailures: when the tasks cannot be read during the
// wait, the result says so instead of only counting them pending.
func TestWaitReportsReadFailures(t *testing.T) {
	t.Parallel()
	api := &fakeAPI{keys: map[string]bool{}, created: time.Now()}
	ts := httptest.NewServer(api)
	defer ts.Close()
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Count: 3, Wait: true, WaitTimeout: 300 * time.Millisecond, Tasks: failingTasks{}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Pending != 3 || !strings.Contains(res.WaitError, "connection refused") {
		t.Fatalf("pending %d wait error %q, want 3 and the read error", res.Pending, res.WaitError)
	}
}

// TestRunSpreadsRequestsOverTokens: with several Tokens, request i is sent
// as Tokens[i mod n], and the wait reads each task as the tenant that
// created it (the API answers 404 for another tenant's task).
func TestRunSpreadsRequestsOverTokens(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	owner := map[string]string{} // task id → token that created it
	perToken := map[string]int{}
	created := time.Now()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			io.WriteString(w, `{"status":"ok"}`)
			return
		}
		tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		mu.Lock()
		defer mu.Unlock()
		if r.Method == http.MethodGet {
			if owner[strings.TrimPrefix(r.URL.Path, "/v1/tasks/")] != tok {
				w.WriteHeader(http.StatusNotFound)
				return
			}
			json.NewEncoder(w).Encode(map[string]any{"status": "completed", "created_at": created, "completed_at": created.Add(time.Millisecond)})
			return
		}
		io.Copy(io.Discard, r.Body)
		id := "t-" + r.Header.Get("Idempotency-Key")
		owner[id] = tok
		perToken[tok]++
		w.WriteHeader(http.StatusAccepted)
		json.NewEncoder(w).Encode(map[string]string{"task_id": id})
	}))
	defer ts.Close()
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Tokens: []string{"a", "b", "c"}, Clients: 4, Count: 30, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Accepted != 30 || res.Completed != 30 || res.Pending != 0 || res.WaitError != "" {
		t.Fatalf("accepted %d completed %d pending %d wait error %q", res.Accepted, res.Completed, res.Pending, res.WaitError)
	}
	mu.Lock()
	defer mu.Unlock()
	if perToken["a"] != 10 || perToken["b"] != 10 || perToken["c"] != 10 || len(perToken) != 3 {
		t.Errorf("requests per token %v, want 10 each of a, b, c", perToken)
	}
	for i := range 30 {
		want := []string{"a", "b", "c"}[i%3]
		if got := owner["t-"+res.KeyPrefix+strconv.Itoa(i)]; got != want {
			t.Errorf("request %d sent as %q, want %q", i, got, want)
		}
	}
}

// A closed-model client whose request failed in transport (the API went
// away after the preflight: restarted, killed) waits before its next
// request, longer after each failure in a row, instead of spending the
// run's requests (and a core) on connection errors.
func TestClosedClientsBackOffAfterTransportErrors(t *testing.T) {
	t.Parallel()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			io.WriteString(w, `{"status":"ok"}`)
			return
		}
		conn, _, err := w.(http.Hijacker).Hijack() // the connection drops: no answer
		if err == nil {
			conn.Close()
		}
	}))
	defer ts.Close()
	res, err := Run(context.Background(), Config{BaseURL: ts.URL, Clients: 16, Duration: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// Without a backoff each client sends again at once (thousands of
	// requests here); with it, a client sends about 7 in 500 ms (waits of
	// 10, 20, 40 ... ms).
	if res.Requests > 16*10 || res.Errors["TRANSPORT"] != res.Requests {
		t.Fatalf("%d requests, errors %v: want at most %d, all TRANSPORT", res.Requests, res.Errors, 16*10)
	}
}

// The summary prints no percentiles of nothing (a run in which no task
// completed), and says that an unanswered request may still have created
// its task (a review found tasks behind TRANSPORT errors: the API
// committed, then died before answering).
func TestPrintSaysWhatItDoesNotKnow(t *testing.T) {
	t.Parallel()
	res := &Result{Model: "closed", Clients: 1, Requests: 3, Errors: map[string]int{"TRANSPORT": 3},
		FirstErrors: map[string]string{"TRANSPORT": "connection refused"}, WaitSeconds: 1}
	var b strings.Builder
	res.Print(&b)
	out := b.String()
	for _, want := range []string{"create latency   no answered request", "end to end       no completed task",
		"error            TRANSPORT × 3", "may still have created its task"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "0.00 ms") {
		t.Errorf("summary prints percentiles of no sample:\n%s", out)
	}
}

// When the tasks could not be read after the run (the API was killed), the
// summary does not say that none completed.
func TestPrintDoesNotGuessWhenTasksWereNotRead(t *testing.T) {
	t.Parallel()
	res := &Result{Model: "closed", Clients: 1, Requests: 5, Accepted: 5, Pending: 5, WaitSeconds: 15,
		WaitError: "connection refused"}
	var b strings.Builder
	res.Print(&b)
	out := b.String()
	for _, want := range []string{"end to end       not known", "at least 0.0 tasks/s"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "no completed task") {
		t.Errorf("summary says no task completed though none could be read:\n%s", out)
	}
}
