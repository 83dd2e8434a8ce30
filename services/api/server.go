package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/services/api/idempotency"
)

// Config configures a Server.
type Config struct {
	// Pool is the PostgreSQL pool (the source of truth). Required.
	Pool *pgxpool.Pool
	// Redis is the task view's Redis. Optional: when nil, GET /v1/tasks/{id}
	// reads PostgreSQL only and sends no Cache-Status header.
	Redis *redis.Client
	// Cache configures the task view (TTL, jitter) used for back-fills. Its
	// Registerer defaults to Config.Registerer.
	Cache taskview.CacheOptions
	// ArtifactStore serves GET /v1/tasks/{id}/artifact. Optional: when nil
	// that endpoint answers 503 ARTIFACT_UNAVAILABLE.
	ArtifactStore *artifact.Store
	// MaxBodyBytes is the largest POST /v1/tasks body accepted; larger
	// bodies get 413 BODY_TOO_LARGE. Defaults to 8 MiB (8<<20), enough for
	// realistic 2 MB documents such as canada.json.
	MaxBodyBytes int64
	// IdempotencyTTL is how long an idempotency record is kept
	// (idempotency_record.expires_at = creation + IdempotencyTTL); it must
	// cover the clients' retry window (seed 3.3). Defaults to
	// idempotency.DefaultTTL (24h); the reconciler's TaskRetention must be
	// at least as long.
	IdempotencyTTL time.Duration
	// IdempotencyLease is the locked_until of an in_progress record
	// (creation + IdempotencyLease). Defaults to 30s.
	IdempotencyLease time.Duration
	// ReadyTimeout bounds the dependency pings of GET /readyz. Defaults to 1s.
	ReadyTimeout time.Duration
	// CacheTimeout bounds each Redis call of a request (the task view's
	// read and back-fill): past it the request reads PostgreSQL, so a Redis
	// that hangs costs a read at most this much (issue 13). Defaults to
	// 250ms. The Redis client must honour context deadlines
	// (taskview.ClientOptions sets ContextTimeoutEnabled).
	CacheTimeout time.Duration
	// RequestTimeout bounds the work of one /v1/ request (authentication
	// and database statements included; reading the body too): a
	// PostgreSQL that stops answering without refusing connections (hung,
	// SIGSTOPped, a network partition that drops packets) then answers
	// 503 DATABASE_UNAVAILABLE after this long instead of holding the
	// request for the whole outage (issue 13). Defaults to 10s.
	RequestTimeout time.Duration
	// MaxInFlightPerTenant bounds the /v1/ requests one tenant has in
	// process at once, so that one tenant cannot take every handler (and
	// database connection) from the others; one more is 429 RATE_LIMITED
	// with Retry-After. Defaults to 64.
	MaxInFlightPerTenant int
	// CreateBatchMax is the most create requests one create transaction
	// takes (group commit, issue 11): requests that arrive while
	// CreateTransactions transactions are running wait and are created
	// together in the next one, each with its own outcome (coalesce.go).
	// Defaults to 32; 1 creates every task in its own transaction.
	CreateBatchMax int
	// CreateTransactions is the most create transactions running at once
	// when CreateBatchMax > 1. Defaults to 2.
	CreateTransactions int
	// MaxBodyBytesInFlight bounds the create-request bodies being read or
	// held at once, in bytes (each counted at its Content-Length, or at
	// MaxBodyBytes when it has none), so that many large bodies cannot take
	// the process's memory; a body that does not fit is 503 OVERLOADED with
	// Retry-After, before it is read. Defaults to 8 × MaxBodyBytes.
	MaxBodyBytesInFlight int64
	// WriteTimeout bounds writing a response (http.Server.WriteTimeout,
	// from the end of reading the request headers), so that a client that
	// never reads cannot hold a handler. Defaults to 2m.
	WriteTimeout time.Duration
	// ReadTimeout bounds reading a whole request, body included, so a client
	// that stops sending cannot hold a connection (or a shutdown). Defaults
	// to 60s.
	ReadTimeout time.Duration
	// ShutdownTimeout bounds the graceful shutdown of Run/Serve. Defaults
	// to 10s.
	ShutdownTimeout time.Duration
	// Logger receives structured logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the API's metrics (see the package doc).
	// Defaults to a fresh prometheus.NewRegistry().
	Registerer prometheus.Registerer
	// Gatherer is served on GET /metrics. Defaults to Registerer when it is
	// a prometheus.Gatherer (as *prometheus.Registry is); required
	// otherwise.
	Gatherer prometheus.Gatherer
	// DeadLetters serves the admin endpoints GET /v1/admin/dead-letters,
	// GET /v1/admin/dead-letters/{id}, POST
	// /v1/admin/dead-letters/{id}/replay and POST
	// /v1/admin/dead-letters/{id}/resolve. Optional: without it they answer
	// 503 DEAD_LETTERS_UNAVAILABLE. The endpoints have no authentication of
	// their own: expose them only to operators.
	DeadLetters *deadletter.Service
	// OutboxProducer produces a parked outbox row again for POST
	// /v1/admin/outbox/{id}/republish (cdc.Republish: the row's original
	// record; the row stays locked until the broker answers, so use
	// acks=all and a record delivery timeout). Optional: without it that
	// endpoint answers 503 OUTBOX_REPUBLISH_UNAVAILABLE; GET
	// /v1/admin/outbox/parked, GET /v1/admin/outbox/{id} and POST
	// /v1/admin/outbox/{id}/discard need only Pool. The caller closes it.
	OutboxProducer *kgo.Client
	// Topic is the task-events topic a republished outbox row is produced
	// to. Defaults to taskevent.DefaultTopic.
	Topic string
	// Auth authenticates the bearer tokens of every /v1/ request
	// (internal/tenant). Required.
	Auth *tenant.Authenticator
	// Faults arms fault points (fault.APIAfterCommitResponseLost, and
	// fault.CacheWriteError for back-fills unless Cache.Faults is set).
	// Nil: off.
	Faults *fault.Set
}

func (c *Config) setDefaults() {
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 8 << 20
	}
	if c.IdempotencyTTL == 0 {
		c.IdempotencyTTL = idempotency.DefaultTTL
	}
	if c.IdempotencyLease == 0 {
		c.IdempotencyLease = 30 * time.Second
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 10 * time.Second
	}
	if c.CreateBatchMax == 0 {
		c.CreateBatchMax = 32
	}
	if c.CreateTransactions == 0 {
		c.CreateTransactions = 2
	}
	if c.CacheTimeout == 0 {
		c.CacheTimeout = 250 * time.Millisecond
	}
	if c.ReadyTimeout == 0 {
		c.ReadyTimeout = time.Second
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = time.Minute
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = 2 * time.Minute
	}
	if c.MaxInFlightPerTenant == 0 {
		c.MaxInFlightPerTenant = 64
	}
	if c.MaxBodyBytesInFlight == 0 {
		c.MaxBodyBytesInFlight = 8 * c.MaxBodyBytes
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Gatherer == nil {
		if g, ok := c.Registerer.(prometheus.Gatherer); ok {
			c.Gatherer = g
		}
	}
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.Cache.Registerer == nil {
		c.Cache.Registerer = c.Registerer
	}
	if c.Cache.Faults == nil {
		c.Cache.Faults = c.Faults
	}
}

// Validate reports a missing or unusable setting after defaults are applied.
func (c *Config) Validate() error {
	switch {
	case c.Pool == nil:
		return errors.New("api: Pool required")
	case c.Auth == nil:
		return errors.New("api: Auth required")
	case c.MaxBodyBytes < 1:
		return fmt.Errorf("api: MaxBodyBytes %d must be positive", c.MaxBodyBytes)
	case c.CreateBatchMax < 1 || c.CreateTransactions < 1:
		return fmt.Errorf("api: CreateBatchMax %d and CreateTransactions %d must be positive", c.CreateBatchMax, c.CreateTransactions)
	case c.MaxInFlightPerTenant < 1:
		return fmt.Errorf("api: MaxInFlightPerTenant %d must be positive", c.MaxInFlightPerTenant)
	case c.MaxBodyBytesInFlight < c.MaxBodyBytes:
		return fmt.Errorf("api: MaxBodyBytesInFlight %d must be at least MaxBodyBytes %d", c.MaxBodyBytesInFlight, c.MaxBodyBytes)
	case c.IdempotencyTTL < time.Minute:
		return fmt.Errorf("api: IdempotencyTTL %s must be at least 1m", c.IdempotencyTTL)
	case c.IdempotencyLease <= 0 || c.ReadyTimeout <= 0 || c.ShutdownTimeout <= 0 || c.CacheTimeout <= 0 || c.RequestTimeout <= 0:
		return errors.New("api: IdempotencyLease, ReadyTimeout, ShutdownTimeout, CacheTimeout and RequestTimeout must be positive")
	case c.Gatherer == nil:
		return errors.New("api: Gatherer required when Registerer is not a prometheus.Gatherer")
	}
	return nil
}

// Server is converge's HTTP API. Create it with New; serve Handler() or
// call Run.
type Server struct {
	cfg     Config
	log     *slog.Logger
	store   *store
	cache   *taskview.Cache // nil without Redis
	mux     *http.ServeMux
	metrics *metrics
	limits  *limits
	flights keyFlights // creates waiting on the database, one per key
}

// New validates cfg and builds a Server. It registers the metrics on
// cfg.Registerer and opens no connection.
func New(cfg Config) (*Server, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, store: &store{pool: cfg.Pool}, mux: http.NewServeMux(),
		limits: newLimits(cfg.MaxInFlightPerTenant, cfg.MaxBodyBytesInFlight)}
	if cfg.Redis != nil {
		c, err := taskview.NewCache(cfg.Redis, cfg.Cache)
		if err != nil {
			return nil, fmt.Errorf("api: %w", err)
		}
		s.cache = c
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("api metrics: %w", err)
	}
	s.metrics = m
	if cfg.CreateBatchMax > 1 {
		s.store.coalesce = newCoalescer(s.store, cfg.CreateBatchMax, cfg.CreateTransactions, cfg.RequestTimeout, cfg.Faults, cfg.Logger, m)
	}
	s.mux.HandleFunc("POST /v1/tasks", s.handleCreate)
	s.mux.HandleFunc("GET /v1/tasks/{id}", s.handleGetTask)
	s.mux.HandleFunc("GET /v1/tasks/{id}/artifact", s.handleGetArtifact)
	s.mux.HandleFunc("POST /v1/tasks/{id}/cancel", s.handleCancel)
	s.mux.HandleFunc("GET /healthz", s.handleHealthz)
	s.mux.HandleFunc("GET /readyz", s.handleReadyz)
	s.registerAdmin()
	s.registerAdminTenants()
	s.registerAdminOutbox()
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Gatherer, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn)}))
	return s, nil
}

// Handler returns the public API's http.Handler: routing, problem+json for
// unknown routes (404) and methods (405), panic recovery and metrics. It
// does not serve the admin endpoints (/v1/admin/: 404 here); AdminHandler
// does, on a listener of their own (issue 12: an admin plane apart).
func (s *Server) Handler() http.Handler { return s }

// AdminHandler returns the admin plane's http.Handler: the /v1/admin/
// endpoints (admin credentials only), /metrics and /healthz; every other
// route is 404.
func (s *Server) AdminHandler() http.Handler { return adminPlane{s} }

type adminPlane struct{ s *Server }

func (a adminPlane) ServeHTTP(w http.ResponseWriter, r *http.Request) { a.s.serveHTTP(w, r, true) }

// onPlane reports whether route (a mux pattern's path) is served on the
// admin plane (admin) or the public one.
func onPlane(route string, admin bool) bool {
	switch {
	case route == "/metrics" || route == "/healthz":
		return true
	case strings.HasPrefix(route, "/v1/admin/"):
		return admin
	default:
		return !admin
	}
}

// Run listens on addr (host:port) and serves the public API until ctx is
// cancelled, then shuts down gracefully and returns nil. See Serve.
func (s *Server) Run(ctx context.Context, addr string) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("api listen %s: %w", addr, err)
	}
	return s.Serve(ctx, ln)
}

// Serve serves on ln until ctx is cancelled, then stops accepting, waits
// up to ShutdownTimeout for in-flight requests (http.Server.Shutdown),
// closes the connections still open after that (logged as a warning) and
// returns nil; it returns an error when serving fails. Serve closes ln.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	return s.serve(ctx, ln, s, "api")
}

// ServeAdmin serves the admin plane (AdminHandler) on ln as Serve serves
// the public API.
func (s *Server) ServeAdmin(ctx context.Context, ln net.Listener) error {
	return s.serve(ctx, ln, s.AdminHandler(), "admin api")
}

func (s *Server) serve(ctx context.Context, ln net.Listener, h http.Handler, name string) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       s.cfg.ReadTimeout,
		WriteTimeout:      s.cfg.WriteTimeout,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.InfoContext(ctx, name+" listening", slog.String("addr", ln.Addr().String()))
	select {
	case err := <-errc:
		return fmt.Errorf("%s serve: %w", name, err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		s.log.Warn(name+" shutdown: closing connections still open", slog.Duration("after", s.cfg.ShutdownTimeout), slog.Any("err", err))
		srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("%s serve: %w", name, err)
	}
	s.log.Info(name + " stopped")
	return nil
}

// ServeHTTP routes r, turning the mux's own 404 and 405 answers into
// problem documents, recovers panics into 500 INTERNAL (re-panicking
// http.ErrAbortHandler so the connection is dropped), and records metrics.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.serveHTTP(w, r, false) }

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request, admin bool) {
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	route := "unmatched"
	method := methodLabel(r.Method)
	defer func() {
		v := recover()
		if v == http.ErrAbortHandler { //nolint:errorlint // sentinel compared as net/http does
			s.metrics.observe(route, method, "aborted", time.Since(start))
			panic(v)
		}
		if v != nil {
			s.log.ErrorContext(r.Context(), "api handler panic", slog.String("route", route), slog.Any("panic", v))
			if sw.status != 0 {
				s.metrics.observe(route, method, "aborted", time.Since(start))
				panic(http.ErrAbortHandler) // the response is half written: drop it
			}
			s.writeError(sw, r, &Error{Code: CodeInternal, Detail: "internal error", Err: fmt.Errorf("panic: %v", v)})
		}
		status := sw.status
		if status == 0 {
			status = http.StatusOK
		}
		s.metrics.observe(route, method, strconv.Itoa(status), time.Since(start))
	}()

	h, pattern := s.mux.Handler(r)
	if pattern != "" {
		route = pattern
		if _, path, ok := strings.Cut(pattern, " "); ok {
			route = path
		}
		if !onPlane(route, admin) {
			route = "unmatched"
			s.writeError(sw, r, newError(CodeNotFound, "no resource at %s on this listener", clip(r.URL.Path, 200)))
			return
		}
		if strings.HasPrefix(route, "/v1/") {
			ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
			defer cancel()
			r = r.WithContext(ctx)
			p, err := s.authenticate(r, strings.HasPrefix(route, "/v1/admin/"))
			if err != nil {
				s.rejectUnread(sw, r, err)
				return
			}
			release, ok := s.limits.enter(p.TenantID)
			if !ok {
				s.rejectUnread(sw, r, newError(CodeRateLimited, "tenant %s has %d requests in process, the most allowed; retry after the ones in process end", p.Name, s.cfg.MaxInFlightPerTenant))
				return
			}
			defer release()
			r = r.WithContext(withPrincipal(r.Context(), p))
		}
		s.mux.ServeHTTP(sw, r) // sets r.Pattern and the path values
		return
	}
	// No route: let the mux decide between 404, 405 and a path-cleaning
	// redirect, then answer 404/405 with a problem document.
	rec := &headerRecorder{header: http.Header{}}
	h.ServeHTTP(rec, r)
	switch rec.status {
	case http.StatusMethodNotAllowed:
		sw.Header().Set("Allow", rec.header.Get("Allow"))
		s.writeError(sw, r, newError(CodeMethodNotAllowed, "method %s is not allowed on %s; allowed: %s", clip(r.Method, 20), clip(r.URL.Path, 200), rec.header.Get("Allow")))
	case http.StatusMovedPermanently, http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		if loc := rec.header.Get("Location"); loc != "" {
			sw.Header().Set("Location", loc)
		}
		sw.WriteHeader(rec.status)
	default:
		s.writeError(sw, r, newError(CodeNotFound, "no resource at %s", clip(r.URL.Path, 200)))
	}
}

// StatusClientClosedRequest (499, nginx's convention) is the status recorded
// in metrics and logs for a request whose client went away first.
const StatusClientClosedRequest = 499

// writeError answers err as a problem document (problemFor) and logs it:
// 5xx at error level with the cause, 4xx at debug level. An error caused by
// the client going away (its request context cancelled) is 499
// CLIENT_CLOSED_REQUEST, not a database outage: it must not page anyone.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		err = &Error{Code: CodeClientClosedRequest, Detail: "the client closed the request before the answer", Err: err}
	}
	p := problemFor(err)
	attrs := []any{slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.Int("status", p.Status), slog.String("code", p.Code), slog.Any("error", err)}
	if p.Status >= 500 {
		s.log.ErrorContext(r.Context(), "api request failed", attrs...)
	} else {
		s.log.DebugContext(r.Context(), "api request rejected", attrs...)
	}
	writeProblem(w, p)
}

func (s *Server) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, []byte(`{"status":"ok"}`))
}

// handleReadyz answers 200 when PostgreSQL answers a ping within
// ReadyTimeout, else 503 DATABASE_UNAVAILABLE (the API cannot serve without
// it). A Redis that does not answer within the same bound leaves it ready:
// 200 {"status":"ready","degraded":["redis"]} (issue 13: every endpoint
// works from PostgreSQL; a load balancer must not drop a healthy API).
func (s *Server) handleReadyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.ReadyTimeout)
	defer cancel()
	if err := s.store.ping(ctx); err != nil {
		s.writeError(w, r, &Error{Code: CodeDatabaseUnavailable, Detail: "PostgreSQL did not answer a ping", Err: err})
		return
	}
	if s.cfg.Redis != nil {
		// Redis is a derived view: every endpoint works from PostgreSQL
		// without it, so it degrades readiness, it does not remove it.
		// Bounded like a request's cache call, well inside ReadyTimeout: a
		// hung Redis must not make /readyz take its whole bound.
		rctx, rcancel := context.WithTimeout(ctx, s.cfg.CacheTimeout)
		err := s.cfg.Redis.Ping(rctx).Err()
		rcancel()
		if err != nil {
			s.log.WarnContext(ctx, "readyz: Redis did not answer; serving from PostgreSQL", slog.Any("error", err))
			writeJSON(w, http.StatusOK, []byte(`{"status":"ready","degraded":["redis"]}`))
			return
		}
	}
	writeJSON(w, http.StatusOK, []byte(`{"status":"ready"}`))
}

// rejectUnread answers err to a request whose body was not read, closing
// the connection after the answer ("Connection: close"): otherwise net/http
// reads the rest of the body before it sends the answer (to keep the
// connection), so a client that stalls mid-body would wait for the read
// timeout instead of getting the rejection at once.
func (s *Server) rejectUnread(w http.ResponseWriter, r *http.Request, err error) {
	if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 {
		w.Header().Set("Connection", "close")
	}
	s.writeError(w, r, err)
}

// writeJSON writes a JSON body with its Content-Length.
func writeJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// statusWriter records the status code written through it.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// headerRecorder captures what the mux's fallback handlers write.
type headerRecorder struct {
	header http.Header
	status int
}

func (r *headerRecorder) Header() http.Header { return r.header }
func (r *headerRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}
func (r *headerRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return len(b), nil
}

// methodLabel bounds the method label's cardinality.
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions:
		return m
	}
	return "OTHER"
}

// metrics are the API's Prometheus collectors.
type metrics struct {
	requests    *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	createBatch prometheus.Histogram
	// createGroupAborts counts group transactions that failed (their
	// requests then ran alone).
	createGroupAborts prometheus.Counter
	idempotency       *prometheus.CounterVec
	cache             *prometheus.CounterVec
}

// Idempotency outcomes (converge_api_idempotency_total{outcome}).
const (
	idemCreated   = "created"
	idemReplayed  = "replayed"
	idemKeyReused = "key_reused"
	idemInProg    = "in_progress"
	idemQuota     = "quota_exhausted"
)

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_api_requests_total",
			Help: "HTTP requests answered, by route pattern, method and status code (\"aborted\" when the connection was dropped).",
		}, []string{"route", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "converge_api_request_duration_seconds",
			Help:    "HTTP request latency in seconds, by route pattern and method.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"route", "method"}),
		idempotency: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_api_idempotency_total",
			Help: "POST /v1/tasks idempotency outcomes: created (new task), replayed (first response returned again), key_reused (same key, different request), in_progress, quota_exhausted (429, nothing written).",
		}, []string{"outcome"}),
		createBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_api_create_batch_size",
			Help:    "Create requests per create transaction (group commit; 1 = alone).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64},
		}),
		createGroupAborts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_api_create_group_aborts_total",
			Help: "Group create transactions rolled back (a lock wait over 500 ms, an exhausted quota, an error); each of their requests then ran alone.",
		}),
		cache: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_cache_requests_total",
			Help: "Task view lookups of the API's cache-aside read: hit, miss, or error (Redis failed; PostgreSQL answered).",
		}, []string{"result"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.duration, m.createBatch, m.createGroupAborts, m.idempotency, m.cache} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, o := range []string{idemCreated, idemReplayed, idemKeyReused, idemInProg, idemQuota} {
		m.idempotency.WithLabelValues(o)
	}
	for _, r := range []string{"hit", "miss", "error"} {
		m.cache.WithLabelValues(r)
	}
	return m, nil
}

func (m *metrics) observe(route, method, code string, d time.Duration) {
	m.requests.WithLabelValues(route, method, code).Inc()
	m.duration.WithLabelValues(route, method).Observe(d.Seconds())
}
