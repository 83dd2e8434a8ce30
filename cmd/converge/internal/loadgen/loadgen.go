// Package loadgen is `converge loadgen`: it submits create requests
// (POST /v1/tasks) to a converge API and measures them.
//
// Two load models:
//
//   - open (Config.Rate > 0): requests are due at fixed intervals of 1/Rate
//     from the start, whatever the server does. A request's latency is
//     measured from its INTENDED send time, not from when a client was free
//     to send it, so a server that stalls is charged for the whole queue it
//     caused (coordinated omission accounted for). At most Clients requests
//     are in flight; late requests are sent as soon as one finishes.
//   - closed (Rate == 0): Clients clients each send their next request as
//     soon as the previous one is answered; latency is measured from the
//     actual send. A client whose request got no answer (TRANSPORT: the
//     API restarted or was killed) waits before its next one, 10 ms
//     doubling per failure in a row up to 1 s, so that an API restart
//     does not spend the run's requests on connection errors.
//
// Every request carries a unique Idempotency-Key (KeyPrefix + sequence
// number; the prefix is random per run), so each accepted request creates a
// task. After the run, unless Wait is false, loadgen reads every created task
// until it is terminal (or WaitTimeout passes) and reports the end-to-end
// latency from the task's own timestamps (completed_at − created_at, both
// taken by PostgreSQL) and the completion rate.
package loadgen

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/docgen"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/services/api"
)

// Defaults of Config.
const (
	DefaultClosedClients = 16
	DefaultOpenInFlight  = 1000
	DefaultDocSize       = 1024
	DefaultWaitTimeout   = 60 * time.Second
	DefaultPollInterval  = 100 * time.Millisecond
)

// Config describes one load run. Zero values take the defaults noted.
type Config struct {
	// BaseURL of the API, like http://127.0.0.1:8080. Required.
	BaseURL string
	// Token is the API token of the tenant the load is sent as
	// ("Authorization: Bearer <Token>"); empty sends none.
	Token string
	// Tokens, when not empty, replaces Token with several tenants: request
	// i is sent as Tokens[i mod len(Tokens)], so that a rate above one
	// tenant's bound of requests in process (the API's
	// MaxInFlightPerTenant, answered 429 RATE_LIMITED) measures the
	// pipeline rather than that bound. With several tokens and a Tasks of
	// the caller's, that reader must read each task as its own tenant.
	Tokens []string
	// Rate is the fixed arrival rate in requests per second (open model).
	// Zero selects the closed model.
	Rate float64
	// Clients is the number of concurrent clients (closed model, default
	// 16) or the most requests in flight (open model, default 1000).
	Clients int
	// Duration bounds the sending phase. At least one of Duration and Count
	// is required; with both, whichever ends first.
	Duration time.Duration
	// Count bounds the number of requests.
	Count int
	// DocsDir, when set, is walked for *.json files whose bytes are sent
	// as the "document" member, round-robin. Otherwise documents are
	// generated.
	DocsDir string
	// DocSize is the approximate size in bytes of a generated document
	// (a JSON object with a sequence number and padding). Defaults to 1024.
	DocSize int
	// KeyPrefix starts every Idempotency-Key. Defaults to "lg-" + 12 random
	// hex digits + "-", unique per run.
	KeyPrefix string
	// Wait reads the created tasks after the sending phase until they are
	// terminal, for the end-to-end latency.
	Wait bool
	// WaitTimeout bounds that wait. Defaults to 60s.
	WaitTimeout time.Duration
	// Tasks reads task states while waiting. Defaults to GET
	// /v1/tasks/{id} on BaseURL (HTTPTasks).
	Tasks TaskReader
	// HTTP is the client. Defaults to one whose transport keeps Clients
	// idle connections to the API, with a 60s timeout.
	// Progress, when set, receives one line when sending starts (the
	// Idempotency-Key prefix, so that a run that dies can still be traced).
	Progress io.Writer
	HTTP     *http.Client
}

func (c *Config) setDefaults() error {
	if c.Clients <= 0 {
		c.Clients = DefaultClosedClients
		if c.Rate > 0 {
			c.Clients = DefaultOpenInFlight
		}
	}
	if c.DocSize <= 0 {
		c.DocSize = DefaultDocSize
	}
	if c.KeyPrefix == "" {
		var b [6]byte
		if _, err := rand.Read(b[:]); err != nil {
			return err
		}
		c.KeyPrefix = "lg-" + hex.EncodeToString(b[:]) + "-"
	}
	if c.WaitTimeout <= 0 {
		c.WaitTimeout = DefaultWaitTimeout
	}
	if c.HTTP == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns = c.Clients + 16
		tr.MaxIdleConnsPerHost = c.Clients + 16
		c.HTTP = &http.Client{Transport: tr, Timeout: 60 * time.Second}
	}
	if len(c.Tokens) == 0 && c.Token != "" {
		c.Tokens = []string{c.Token}
	}
	if c.Tasks == nil {
		c.Tasks = &HTTPTasks{BaseURL: c.BaseURL, Token: c.token(0), HTTP: c.HTTP}
	}
	return nil
}

// token is the API token request i is sent as ("" for none).
func (c *Config) token(i int) string {
	if len(c.Tokens) == 0 {
		return ""
	}
	return c.Tokens[i%len(c.Tokens)]
}

// Rate bounds of the open model, in requests per second: below MinRate
// the interval between requests overflows a time.Duration's useful range,
// above MaxRate it is under a microsecond and the schedule means nothing.
const (
	MinRate = 0.001
	MaxRate = 1e6
)

// Validate reports a missing, negative or inconsistent field. The messages
// name the converge loadgen flags.
func (c *Config) Validate() error {
	if c.BaseURL == "" {
		return errors.New("loadgen: --api-url is required")
	}
	if u, err := url.Parse(c.BaseURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("loadgen: --api-url %q: want http://host:port or https://host:port", c.BaseURL)
	}
	switch {
	case math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0):
		return fmt.Errorf("loadgen: --rate %g: want a finite number of requests/s (0 selects the closed model)", c.Rate)
	case c.Rate < 0:
		return fmt.Errorf("loadgen: --rate %g is negative", c.Rate)
	case c.Rate > 0 && (c.Rate < MinRate || c.Rate > MaxRate):
		return fmt.Errorf("loadgen: --rate %g: want %g to %g requests/s", c.Rate, MinRate, MaxRate)
	case c.Duration < 0:
		return fmt.Errorf("loadgen: --duration %s is negative", c.Duration)
	case c.Count < 0:
		return fmt.Errorf("loadgen: --count %d is negative", c.Count)
	case c.Duration == 0 && c.Count == 0:
		return errors.New("loadgen: set --duration or --count (or both: whichever ends first)")
	case c.Clients < 0:
		return fmt.Errorf("loadgen: --clients %d is negative", c.Clients)
	case c.DocSize < 0:
		return fmt.Errorf("loadgen: --doc-size %d is negative", c.DocSize)
	case c.WaitTimeout < 0:
		return fmt.Errorf("loadgen: --wait-timeout %s is negative", c.WaitTimeout)
	}
	if c.KeyPrefix != "" {
		// The keys are KeyPrefix + the request's number, from 0: the first
		// and the last must both be keys the API accepts. The last is
		// --count's when given, else one of ten digits.
		last := "9999999999"
		if c.Count > 0 {
			last = strconv.Itoa(c.Count - 1)
		}
		for _, key := range []string{c.KeyPrefix + "0", c.KeyPrefix + last} {
			if !api.ValidIdempotencyKey(key) {
				return fmt.Errorf("loadgen: --key-prefix %q: makes the key %q, which the API refuses (an Idempotency-Key is 6 to 255 characters of A-Z a-z 0-9 _ . : -)",
					c.KeyPrefix, key)
			}
		}
	}
	return nil
}

func clipBody(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "…"
	}
	return string(b)
}

// preflight checks that the API answers GET /healthz before any load is
// sent, so that a wrong URL or a stopped API is one clear error instead of
// a run of failed requests.
func preflight(ctx context.Context, cfg *Config) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cfg.BaseURL+"/healthz", nil)
	if err != nil {
		return fmt.Errorf("loadgen: --api-url %q: %w", cfg.BaseURL, err)
	}
	resp, err := cfg.HTTP.Do(req)
	if err != nil {
		return fmt.Errorf("loadgen: the API at %s does not answer: %w", cfg.BaseURL, err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	var h struct {
		Status string `json:"status"`
	}
	// The API answers {"status":"ok"}; the other components' metrics
	// servers answer a plain "ok" and are refused here.
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &h) != nil || h.Status != "ok" {
		return fmt.Errorf("loadgen: GET %s/healthz answered %s %q: is this the converge API (not a metrics port)?", cfg.BaseURL, resp.Status, clipBody(body))
	}
	return nil
}

// Result is what one run measured. Latencies are in milliseconds.
type Result struct {
	// Model is "open" (fixed rate) or "closed".
	Model string `json:"model"`
	// TargetRate is the open model's rate in requests/s.
	TargetRate float64 `json:"target_rate,omitempty"`
	Clients    int     `json:"clients"`
	// Requests sent (answered or failed) and Accepted (202).
	Requests int `json:"requests"`
	Accepted int `json:"accepted"`
	// SendSeconds is the sending phase: first intended send to last answer.
	SendSeconds float64 `json:"send_seconds"`
	// RequestsPerSec is Requests / SendSeconds.
	RequestsPerSec float64 `json:"requests_per_sec"`
	// CreateLatency of every answered request (any status); in the open
	// model from the intended send time.
	CreateLatency Summary `json:"create_latency_ms"`
	// Errors counts failed requests by problem "code", "HTTP_<status>"
	// when the body had none, or "TRANSPORT" for a request without answer.
	Errors map[string]int `json:"errors"`
	// FirstErrors holds, for codes without a problem body (TRANSPORT), the
	// error of the first such request.
	FirstErrors map[string]string `json:"first_errors,omitempty"`
	// Unsent counts, in the open model, requests due before the end of
	// Duration that were never sent because every client was still busy:
	// the API did not keep up with the rate.
	Unsent int `json:"unsent,omitempty"`
	// WaitError is the last failed task read of the wait when tasks stayed
	// pending: they may have completed while the API could not be read.
	WaitError string `json:"wait_error,omitempty"`
	// KeyPrefix starts the Idempotency-Key of every request of the run
	// (the key of request i is KeyPrefix + i): how to find its tasks.
	KeyPrefix string `json:"key_prefix"`
	// Task outcomes of the accepted requests after the wait (all pending
	// when Wait is false).
	Completed int `json:"tasks_completed"`
	Failed    int `json:"tasks_failed"`
	Pending   int `json:"tasks_pending"`
	// EndToEnd is completed_at − created_at of the completed tasks.
	EndToEnd Summary `json:"end_to_end_ms"`
	// CompletedPerSec is Completed divided by the span from the first
	// task's created_at to the last task's completed_at.
	CompletedPerSec float64 `json:"tasks_completed_per_sec"`
	// WaitSeconds is how long the wait for terminal tasks took.
	WaitSeconds float64 `json:"wait_seconds"`
	// TaskIDs of the accepted requests, in send order (not in JSON).
	TaskIDs []string `json:"-"`
}

// Run executes one load run and returns its result. It returns an error only
// for an invalid config or unreadable documents; failed requests are counted
// in Result.Errors. Cancelling ctx ends the sending phase early (and the
// wait); the partial result is returned.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ownTasks := cfg.Tasks == nil // the default reader, which Run may fill (TokenOf)
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	docs, err := loadDocs(cfg.DocsDir)
	if err != nil {
		return nil, err
	}
	if err := preflight(ctx, &cfg); err != nil {
		return nil, err
	}
	if cfg.Progress != nil {
		fmt.Fprintf(cfg.Progress, "idempotency keys %s<n>; sending\n", cfg.KeyPrefix)
	}
	r := &run{cfg: cfg, docs: docs, errors: map[string]int{}, firstErr: map[string]string{}}
	res := &Result{Model: "closed", Clients: cfg.Clients, KeyPrefix: cfg.KeyPrefix}
	var start, end time.Time
	if cfg.Rate > 0 {
		res.Model, res.TargetRate = "open", cfg.Rate
		start, end = r.open(ctx)
	} else {
		start, end = r.closed(ctx)
	}
	res.Requests = int(r.sent.Load())
	res.Unsent = r.unsent
	res.SendSeconds = end.Sub(start).Seconds()
	if cfg.Rate > 0 {
		// Request i is due at i/Rate: n requests take at least n/Rate.
		res.SendSeconds = max(res.SendSeconds, float64(res.Requests)/cfg.Rate)
	}
	if res.SendSeconds > 0 {
		res.RequestsPerSec = float64(res.Requests) / res.SendSeconds
	}
	res.CreateLatency = r.latency.Summary()
	res.Errors = r.errors
	if len(r.firstErr) > 0 {
		res.FirstErrors = r.firstErr
	}
	slices.SortFunc(r.created, func(a, b created) int { return a.seq - b.seq })
	h, _ := cfg.Tasks.(*HTTPTasks)
	several := ownTasks && h != nil && len(cfg.Tokens) > 1
	if several {
		h.TokenOf = make(map[string]string, len(r.created))
	}
	for _, c := range r.created {
		res.TaskIDs = append(res.TaskIDs, c.taskID)
		if several {
			h.TokenOf[c.taskID] = cfg.token(c.seq)
		}
	}
	res.Accepted = len(res.TaskIDs)
	res.Pending = res.Accepted
	if cfg.Wait && res.Accepted > 0 {
		waitStart := time.Now()
		states, readErr := wait(ctx, cfg, res.TaskIDs)
		res.WaitSeconds = time.Since(waitStart).Seconds()
		summarize(res, states)
		if readErr != nil && res.Pending > 0 {
			res.WaitError = readErr.Error()
		}
	}
	return res, nil
}

// run is the state of one Run.
type run struct {
	cfg      Config
	docs     [][]byte
	sent     atomic.Int64
	latency  Histogram
	mu       sync.Mutex
	errors   map[string]int
	firstErr map[string]string // code → detail of its first occurrence
	unsent   int               // open model: requests due within Duration but never sent
	created  []created
}

type created struct {
	seq    int
	taskID string
}

// open sends request i at start + i/Rate and measures from that instant.
func (r *run) open(ctx context.Context) (start, end time.Time) {
	interval := time.Duration(float64(time.Second) / r.cfg.Rate)
	due := make(chan int, r.cfg.Clients)
	start = time.Now()
	var wg sync.WaitGroup
	var last atomic.Int64
	for range r.cfg.Clients {
		wg.Go(func() {
			for i := range due {
				intended := start.Add(time.Duration(i) * interval)
				r.do(ctx, i, intended)
				last.Store(time.Now().UnixNano())
			}
		})
	}
	// The sending phase ends at start+Duration by the wall clock too: when
	// the API is slower than the rate, requests due before the end but not
	// yet sent then are counted in r.unsent, not sent late forever.
	var stop <-chan time.Time
	if r.cfg.Duration > 0 {
		st := time.NewTimer(r.cfg.Duration)
		defer st.Stop()
		stop = st.C
	}
	t := time.NewTimer(0)
	defer t.Stop()
schedule:
	for i := 0; r.cfg.Count <= 0 || i < r.cfg.Count; i++ {
		at := time.Duration(i) * interval
		if r.cfg.Duration > 0 && at >= r.cfg.Duration {
			break
		}
		if d := time.Until(start.Add(at)); d > 0 {
			t.Reset(d)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		select {
		case due <- i: // waits while Clients requests are in flight: they are late, and charged for it
		case <-stop:
			r.unsent = dueBefore(r.cfg, interval) - i
			break schedule
		case <-ctx.Done():
			break schedule
		}
	}
	close(due)
	wg.Wait()
	if last.Load() == 0 {
		return start, time.Now()
	}
	return start, time.Unix(0, last.Load())
}

// dueBefore is how many requests the open model schedules: those due
// before Duration, at most Count.
func dueBefore(cfg Config, interval time.Duration) int {
	n := int((cfg.Duration + interval - 1) / interval)
	if cfg.Count > 0 && cfg.Count < n {
		n = cfg.Count
	}
	return n
}

// closed runs Clients clients back to back.
func (r *run) closed(ctx context.Context) (start, end time.Time) {
	var next atomic.Int64
	var deadline time.Time
	start = time.Now()
	if r.cfg.Duration > 0 {
		deadline = start.Add(r.cfg.Duration)
	}
	var wg sync.WaitGroup
	for range r.cfg.Clients {
		wg.Go(func() {
			inRow := 0 // transport failures in a row
			for ctx.Err() == nil {
				if !deadline.IsZero() && !time.Now().Before(deadline) {
					return
				}
				i := int(next.Add(1) - 1)
				if r.cfg.Count > 0 && i >= r.cfg.Count {
					return
				}
				if !r.do(ctx, i, time.Now()) {
					inRow = 0
					continue
				}
				// The API did not answer (restarted, killed, overloaded
				// listener): wait before the next request, as a client
				// would, instead of spending the run's requests on
				// connection errors.
				wait := backoff.Delay(transportBackoffMin, transportBackoffMax, inRow)
				if !deadline.IsZero() {
					wait = min(wait, time.Until(deadline))
				}
				inRow++
				if !backoff.Wait(ctx, wait) {
					return
				}
			}
		})
	}
	wg.Wait()
	return start, time.Now()
}

// Closed-model clients wait after a transport failure (closed): the first
// wait is transportBackoffMin, doubling per failure in a row up to
// transportBackoffMax, with jitter (internal/backoff).
const (
	transportBackoffMin = 10 * time.Millisecond
	transportBackoffMax = time.Second
)

// do sends request i and records its latency from from. It reports whether
// the request failed in transport (no answer, ctx still live).
func (r *run) do(ctx context.Context, i int, from time.Time) (transport bool) {
	body := r.body(i)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.cfg.BaseURL+"/v1/tasks", bytes.NewReader(body))
	if err != nil {
		r.failWith("TRANSPORT", err.Error())
		return false // a request that cannot be built: no wait helps
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", r.cfg.KeyPrefix+strconv.Itoa(i))
	if tok := r.cfg.token(i); tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	r.sent.Add(1)
	resp, err := r.cfg.HTTP.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			r.fail("CANCELLED") // interrupted: sent, never answered
			return false
		}
		r.failWith("TRANSPORT", err.Error())
		return true
	}
	rb, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	r.latency.Record(time.Since(from))
	if err != nil {
		r.failWith("TRANSPORT", err.Error())
		return ctx.Err() == nil
	}
	if resp.StatusCode != http.StatusAccepted {
		var p struct {
			Code string `json:"code"`
		}
		_ = json.Unmarshal(rb, &p)
		if p.Code == "" {
			p.Code = "HTTP_" + strconv.Itoa(resp.StatusCode)
		}
		r.fail(p.Code)
		return false
	}
	var c struct {
		TaskID string `json:"task_id"`
	}
	if err := json.Unmarshal(rb, &c); err != nil || c.TaskID == "" {
		r.fail("BAD_RESPONSE")
		return false
	}
	r.mu.Lock()
	r.created = append(r.created, created{seq: i, taskID: c.TaskID})
	r.mu.Unlock()
	return false
}

func (r *run) fail(code string) { r.failWith(code, "") }

// failWith counts a failed request and keeps detail when it is the code's
// first.
func (r *run) failWith(code, detail string) {
	r.mu.Lock()
	r.errors[code]++
	if _, ok := r.firstErr[code]; !ok && detail != "" {
		r.firstErr[code] = detail
	}
	r.mu.Unlock()
}

// body returns the create request of request i.
func (r *run) body(i int) []byte {
	var doc []byte
	if len(r.docs) > 0 {
		doc = r.docs[i%len(r.docs)]
	} else {
		doc = docgen.Document(i, r.cfg.DocSize)
	}
	b := make([]byte, 0, len(doc)+40)
	b = append(b, `{"output_format":"jcs","document":`...)
	b = append(b, doc...)
	return append(b, '}')
}

// loadDocs reads every *.json file under dir (nil when dir is empty).
func loadDocs(dir string) ([][]byte, error) {
	if dir == "" {
		return nil, nil
	}
	var docs [][]byte
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.HasSuffix(d.Name(), ".json") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		docs = append(docs, b)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read documents in %s: %w", dir, err)
	}
	if len(docs) == 0 {
		return nil, fmt.Errorf("loadgen: --docs %s holds no *.json documents", dir)
	}
	return docs, nil
}

// TaskState is what the wait needs of a task.
type TaskState struct {
	Status      string
	CreatedAt   time.Time
	CompletedAt *time.Time
}

// Terminal reports whether the task reached a final status.
func (s TaskState) Terminal() bool {
	return s.Status == "completed" || s.Status == "failed" || s.Status == "compensated" || s.Status == "cancelled"
}

// TaskReader reads the states of tasks. Missing ids are left out of the
// result.
type TaskReader interface {
	Tasks(ctx context.Context, ids []string) (map[string]TaskState, error)
}

// HTTPTasks reads tasks with GET /v1/tasks/{id}, 16 at a time.
type HTTPTasks struct {
	BaseURL string
	Token   string // as Config.Token
	// TokenOf, when it holds a task's id, is the token that task is read
	// with instead of Token (a task is read as the tenant that created it).
	// Run fills it in the reader it creates itself when Config.Tokens names
	// several tenants; a caller's reader is left as given.
	TokenOf map[string]string
	HTTP    *http.Client
}

var _ TaskReader = (*HTTPTasks)(nil)

// Tasks implements TaskReader.
func (h *HTTPTasks) Tasks(ctx context.Context, ids []string) (map[string]TaskState, error) {
	out := make(map[string]TaskState, len(ids))
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for _, id := range ids {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			st, err := h.get(ctx, id)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = err
				}
				return
			}
			out[id] = st
		})
	}
	wg.Wait()
	return out, firstErr
}

func (h *HTTPTasks) get(ctx context.Context, id string) (TaskState, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.BaseURL+"/v1/tasks/"+id, nil)
	if err != nil {
		return TaskState{}, err
	}
	tok := h.Token
	if t, ok := h.TokenOf[id]; ok {
		tok = t
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := h.HTTP.Do(req)
	if err != nil {
		return TaskState{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return TaskState{}, fmt.Errorf("GET /v1/tasks/%s: status %d", id, resp.StatusCode)
	}
	var t struct {
		Status      string     `json:"status"`
		CreatedAt   time.Time  `json:"created_at"`
		CompletedAt *time.Time `json:"completed_at"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&t); err != nil {
		return TaskState{}, fmt.Errorf("decode task %s: %w", id, err)
	}
	return TaskState{Status: t.Status, CreatedAt: t.CreatedAt, CompletedAt: t.CompletedAt}, nil
}

// DBTasks reads task states straight from PostgreSQL (package task), one
// statement per window of the wait, so that waiting for the end-to-end
// latency costs neither the API nor the load generator more than a query
// per window and poll interval (HTTPTasks GETs every pending task, which
// loads the API while it is measured).
type DBTasks struct{ Pool *pgxpool.Pool }

var _ TaskReader = (*DBTasks)(nil)

// Tasks implements TaskReader.
func (d *DBTasks) Tasks(ctx context.Context, ids []string) (map[string]TaskState, error) {
	ts, err := task.GetMany(ctx, d.Pool, ids)
	if err != nil {
		return nil, err
	}
	out := make(map[string]TaskState, len(ts))
	for _, t := range ts {
		out[t.TaskID] = TaskState{Status: t.Status, CreatedAt: t.CreatedAt, CompletedAt: t.CompletedAt}
	}
	return out, nil
}

// waitWindow is how many pending tasks one poll reads: tasks complete
// roughly in creation order, so the oldest pending ones are read until they
// are terminal, then the window moves on.
const waitWindow = 512

// wait polls the tasks until all are terminal or WaitTimeout passes, and
// returns the last state read of each.
func wait(ctx context.Context, cfg Config, ids []string) (map[string]TaskState, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.WaitTimeout)
	defer cancel()
	states := make(map[string]TaskState, len(ids))
	pending := slices.Clone(ids)
	var lastErr error // the last failed read, nil once a read succeeds
	for len(pending) > 0 {
		window := slices.Clone(pending[:min(len(pending), waitWindow)])
		got, err := cfg.Tasks.Tasks(ctx, window)
		if err != nil && ctx.Err() == nil {
			lastErr = err
		} else if err == nil {
			lastErr = nil
		}
		for id, st := range got {
			states[id] = st
		}
		kept := pending[:0]
		for _, id := range pending {
			if st, ok := states[id]; !ok || !st.Terminal() {
				kept = append(kept, id)
			}
		}
		pending = kept
		if len(pending) == 0 {
			break
		}
		if len(got) > 0 && len(pending) > 0 && pending[0] != window[0] {
			continue // progress: read the next window at once
		}
		select {
		case <-ctx.Done():
			// One last read of everything still pending, so the result
			// reflects the end of the wait.
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			got, err := cfg.Tasks.Tasks(rctx, pending)
			rcancel()
			if err != nil {
				lastErr = err
			}
			for id, st := range got {
				states[id] = st
			}
			return states, lastErr
		case <-time.After(DefaultPollInterval):
		}
	}
	return states, nil
}

// summarize fills the task outcome fields of res from states.
func summarize(res *Result, states map[string]TaskState) {
	var e2e Histogram
	var first, last time.Time
	for _, id := range res.TaskIDs {
		st, ok := states[id]
		switch {
		case !ok || !st.Terminal():
			continue
		case st.Status == "completed" && st.CompletedAt != nil:
			res.Completed++
			e2e.Record(st.CompletedAt.Sub(st.CreatedAt))
			if first.IsZero() || st.CreatedAt.Before(first) {
				first = st.CreatedAt
			}
			if st.CompletedAt.After(last) {
				last = *st.CompletedAt
			}
		default:
			res.Failed++
		}
	}
	res.Pending = res.Accepted - res.Completed - res.Failed
	res.EndToEnd = e2e.Summary()
	if span := last.Sub(first).Seconds(); span > 0 {
		res.CompletedPerSec = float64(res.Completed) / span
	}
}

// Print writes a human-readable summary of res.
func (res *Result) Print(w io.Writer) {
	model := fmt.Sprintf("closed, %d clients", res.Clients)
	if res.Model == "open" {
		model = fmt.Sprintf("open, %.0f requests/s target, at most %d in flight", res.TargetRate, res.Clients)
	}
	fmt.Fprintf(w, "model            %s\n", model)
	fmt.Fprintf(w, "idempotency keys %s<n>\n", res.KeyPrefix)
	fmt.Fprintf(w, "requests         %d in %.2fs = %.1f requests/s, %d accepted\n", res.Requests, res.SendSeconds, res.RequestsPerSec, res.Accepted)
	if res.Unsent > 0 {
		fmt.Fprintf(w, "not sent         %d requests due within the duration: the API did not keep up with the rate\n", res.Unsent)
	}
	c := res.CreateLatency
	if c.Count == 0 {
		fmt.Fprintf(w, "create latency   no answered request\n")
	} else {
		fmt.Fprintf(w, "create latency   p50 %.2f ms  p90 %.2f ms  p99 %.2f ms  max %.2f ms\n", c.P50, c.P90, c.P99, c.Max)
	}
	if len(res.Errors) > 0 {
		codes := make([]string, 0, len(res.Errors))
		for k := range res.Errors {
			codes = append(codes, k)
		}
		slices.Sort(codes)
		for _, k := range codes {
			fmt.Fprintf(w, "error            %s × %d\n", k, res.Errors[k])
			if d, ok := res.FirstErrors[k]; ok {
				fmt.Fprintf(w, "                 first: %s\n", d)
			}
			if k == "TRANSPORT" || k == "CANCELLED" {
				// Sent and never answered: the API may have committed it.
				fmt.Fprintf(w, "                 (no answer: such a request may still have created its task; a retry with its key would say)\n")
			}
		}
	}
	if res.WaitSeconds > 0 || res.Completed > 0 {
		e := res.EndToEnd
		fmt.Fprintf(w, "tasks            %d completed, %d failed, %d pending (waited %.1fs)\n", res.Completed, res.Failed, res.Pending, res.WaitSeconds)
		if res.WaitError != "" {
			fmt.Fprintf(w, "                 reading tasks failed: %s (pending tasks may have completed)\n", res.WaitError)
		}
		switch {
		case e.Count > 0:
			fmt.Fprintf(w, "end to end       p50 %.2f ms  p90 %.2f ms  p99 %.2f ms  max %.2f ms\n", e.P50, e.P90, e.P99, e.Max)
		case res.WaitError != "":
			fmt.Fprintf(w, "end to end       not known: the tasks could not be read\n")
		default:
			fmt.Fprintf(w, "end to end       no completed task\n")
		}
		if res.WaitError != "" {
			// Counted from the reads that succeeded: a lower bound.
			fmt.Fprintf(w, "completed        at least %.1f tasks/s (the tasks read)\n", res.CompletedPerSec)
		} else {
			fmt.Fprintf(w, "completed        %.1f tasks/s\n", res.CompletedPerSec)
		}
	}
}
