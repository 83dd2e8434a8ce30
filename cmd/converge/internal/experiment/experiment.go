// Package experiment runs the seed's fault-injection experiments (section
// 15) and the failure matrix of section 14 against the real pipeline —
// internal/pipeline on a fresh PostgreSQL database, a fresh embedded broker
// (NewBroker) and Redis — and checks the invariants from the database: one task per intent,
// one verified artifact per completed task (a failed task keeps none: it was
// compensated), no task left non-terminal, no inbox row left processing, no
// message requeued forever (bounded deliveries and replays), every outbox
// row published; duplicates are counted.
//
// `converge experiment run NAME|all --out DIR` and the package's test call
// the same Run. Each experiment writes DIR/<name>.json (a snapshot of the
// task, idempotency, outbox, inbox, effect ledger and dead-letter rows
// involved, plus the checks) and DIR/<name>.md (a short report).
//
// Crashes are simulated in process: an error-action fault point stops the
// attempt (or the relay, which stops the pipeline), then the pipeline is
// started again on the same database, slot, broker and artifact directory.
// The real-process crash (SIGKILL of `converge dev`) is the end-to-end
// test of cmd/converge.
//
// Outages last Env.Outage (OutageFor, 30 s): database-outage cuts
// PostgreSQL behind a TCP proxy; kafka-outage stops the broker itself
// (Env.Broker: a proxy cannot do it, clients follow the addresses the
// broker advertises in its metadata) and restarts it with its state.
package experiment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/converge-run/converge/internal/tenant"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/devbroker"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/freeport"
	"github.com/converge-run/converge/internal/taskevent"
)

// Env is where one experiment runs: a fresh database (empty or migrated),
// a Kafka cluster of its own, a Redis and an empty artifact directory.
type Env struct {
	DatabaseURL string
	Brokers     []string
	RedisURL    string
	ArtifactDir string
	// SlotName and PublicationName must be unique on the PostgreSQL
	// cluster. Default "converge_outbox".
	SlotName, PublicationName string
	// Broker is the Kafka cluster at Brokers when it can be taken away and
	// brought back with its state (NewBroker's); kafka-outage needs it and
	// fails without. Defaults to none.
	Broker Broker
	// Outage is how long database-outage keeps PostgreSQL and kafka-outage
	// keeps Kafka unreachable. Defaults to OutageFor (30 s, issue 13);
	// tests shorten it.
	Outage time.Duration
}

// OutageFor is how long the outage experiments keep their service
// unreachable unless Env.Outage says otherwise (issue 13: "stops
// PostgreSQL and Kafka in turn for 30 s under load").
const OutageFor = 30 * time.Second

// Broker is a Kafka cluster that can be stopped and restarted on the same
// addresses with the state it persisted (*devbroker.Broker with a
// DataDir). Stop makes every client's connection fail until Restart.
type Broker interface {
	Stop() error
	Restart() error
}

var _ Broker = (*devbroker.Broker)(nil)

// NewBroker starts the embedded broker of one experiment as `converge
// experiment run` does: internal/devbroker, one broker, the task-event
// topic and its dead-letter topic with 4 partitions, its state kept in
// dataDir (so kafka-outage can stop and restart it). Close it after Run.
// Its port is below the kernel's ephemeral range (internal/freeport): the
// restart binds it again, and while the broker is down an outgoing
// connection could otherwise be given it.
func NewBroker(dataDir string, log *slog.Logger) (*devbroker.Broker, error) {
	port, err := freeport.Pick()
	if err != nil {
		return nil, err
	}
	return devbroker.Start(devbroker.Config{Logger: log, DataDir: dataDir,
		Opts: []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(4, taskevent.DefaultTopic, taskevent.DeadLetterTopic(taskevent.DefaultTopic))}})
}

// Experiment is one runnable experiment.
type Experiment struct {
	Name  string
	Title string
	// Seed is the seed section it demonstrates.
	Seed string
	run  func(ctx context.Context, x *X) error
}

// List returns the experiments in their documented order.
func List() []Experiment { return experiments }

// Lookup returns the experiment called name.
func Lookup(name string) (Experiment, bool) {
	for _, e := range experiments {
		if e.Name == name {
			return e, true
		}
	}
	return Experiment{}, false
}

// Check is one invariant or expectation and whether it held.
type Check struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail,omitempty"`
}

// Report is the result of one experiment.
type Report struct {
	Name     string         `json:"name"`
	Title    string         `json:"title"`
	Seed     string         `json:"seed"`
	Passed   bool           `json:"passed"`
	Error    string         `json:"error,omitempty"`
	Duration string         `json:"duration"`
	Steps    []string       `json:"steps"`
	Checks   []Check        `json:"checks"`
	Counts   map[string]any `json:"counts"`
	Snapshot map[string]any `json:"snapshot"`
}

// ErrInvariant is returned (wrapped) by Run when a check failed.
var ErrInvariant = errors.New("experiment invariant failed")

// Run runs experiment e in env, writes <out>/<name>.json and .md when out
// is not empty, and returns the report; the error wraps ErrInvariant when a
// check failed, or tells why the experiment could not run.
func Run(ctx context.Context, e Experiment, env Env, out string, log *slog.Logger) (*Report, error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if env.SlotName == "" {
		env.SlotName = "converge_outbox"
	}
	if env.PublicationName == "" {
		env.PublicationName = env.SlotName
	}
	if env.Outage == 0 {
		env.Outage = OutageFor
	}
	start := time.Now()
	x := &X{env: env, log: log, rep: &Report{Name: e.Name, Title: e.Title, Seed: e.Seed, Counts: map[string]any{}}}
	pool, err := dbpool.New(ctx, env.DatabaseURL, "converge-experiment")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	x.pool = pool
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute+env.Outage)
	runErr := e.run(rctx, x)
	if runErr == nil {
		// While the pipeline still runs: the last outbox rows get published.
		x.invariants(rctx)
	}
	if err := x.stop(); err != nil && runErr == nil && !errors.Is(err, context.Canceled) {
		runErr = fmt.Errorf("pipeline stop: %w", err)
	}
	for _, f := range x.cleanup {
		f()
	}
	cancel()
	x.rep.Snapshot = x.snapshot(ctx)
	x.rep.Duration = time.Since(start).Round(time.Millisecond).String()
	x.rep.Passed = runErr == nil
	for _, c := range x.rep.Checks {
		x.rep.Passed = x.rep.Passed && c.OK
	}
	if runErr != nil {
		x.rep.Error = runErr.Error()
	}
	if out != "" {
		if err := write(out, x.rep); err != nil {
			return x.rep, err
		}
	}
	switch {
	case runErr != nil:
		return x.rep, fmt.Errorf("experiment %s: %w", e.Name, runErr)
	case !x.rep.Passed:
		return x.rep, fmt.Errorf("experiment %s: %w", e.Name, ErrInvariant)
	}
	return x.rep, nil
}

// X is the state of one running experiment.
type X struct {
	env     Env
	log     *slog.Logger
	pool    *pgxpool.Pool
	rep     *Report
	reg     *prometheus.Registry
	api     string
	token   string // API token of the experiment's tenant (added at the first start)
	cancel  context.CancelFunc
	done    chan error
	tasks   []string // task ids involved
	keys    []string // idempotency keys used (one intent each)
	replays int      // MaxReplays configured
	// cleanup runs after the pipeline stopped (things it still needs
	// while the invariants are checked, e.g. a proxy to PostgreSQL).
	cleanup []func()
}

func (x *X) step(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	x.rep.Steps = append(x.rep.Steps, s)
	x.log.Info("experiment step", slog.String("step", s))
}

func (x *X) check(name string, ok bool, format string, args ...any) bool {
	x.rep.Checks = append(x.rep.Checks, Check{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
	return ok
}

// start runs the pipeline with faults until stop (or until a component
// fails: wait returns its error) and waits until the API serves.
func (x *X) start(ctx context.Context, faults *fault.Set, tune func(*pipeline.Config)) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	x.reg = prometheus.NewRegistry()
	cfg := pipeline.Config{
		DatabaseURL: x.env.DatabaseURL, Brokers: x.env.Brokers, RedisURL: x.env.RedisURL, ArtifactDir: x.env.ArtifactDir,
		SlotName: x.env.SlotName, PublicationName: x.env.PublicationName, Listener: ln, Faults: faults,
		Finalize: true, // the experiments' own database
		Logger:   x.log, Registry: x.reg,
		Worker:            worker.Config{RetryBackoffMin: 20 * time.Millisecond, RetryBackoffMax: 200 * time.Millisecond},
		Reconciler:        reconciler.Config{Interval: 100 * time.Millisecond, EffectDeadline: time.Second, TaskDeadline: 30 * time.Second},
		HeartbeatInterval: time.Second,
	}
	if tune != nil {
		tune(&cfg)
	}
	x.replays = cfg.MaxReplays
	if x.replays == 0 {
		x.replays = deadletter.DefaultMaxReplays
	}
	ready := make(chan struct{})
	cfg.Ready = func(string) { close(ready) }
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	x.cancel, x.done, x.api = cancel, make(chan error, 1), "http://"+ln.Addr().String()
	go func() { x.done <- pipeline.Run(pctx, cfg) }()
	select {
	case <-ready:
		if x.token == "" {
			_, tok, err := tenant.Add(ctx, x.pool, "experiment", false, nil)
			if err != nil {
				x.stop()
				return fmt.Errorf("experiment tenant: %w", err)
			}
			x.token = tok
		}
		return nil
	case err := <-x.done:
		x.cancel = nil
		return fmt.Errorf("pipeline stopped before serving: %v", err)
	case <-ctx.Done():
		x.stop()
		return ctx.Err()
	}
}

// stop stops the running pipeline (if any) and returns its error.
func (x *X) stop() error {
	if x.cancel == nil {
		return nil
	}
	x.cancel()
	x.cancel = nil
	select {
	case err := <-x.done:
		return err
	case <-time.After(30 * time.Second):
		return errors.New("pipeline did not stop within 30s")
	}
}

// wait returns the pipeline's error once it stopped by itself.
func (x *X) wait(ctx context.Context) error {
	select {
	case err := <-x.done:
		x.cancel = nil
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (x *X) client() *submit.Client {
	return &submit.Client{BaseURL: x.api, Token: x.token, PollInterval: 20 * time.Millisecond}
}

// post sends POST /v1/tasks and returns the status, the body and the
// Idempotent-Replayed header; err is a transport error (a lost response).
func (x *X) post(ctx context.Context, key string, doc []byte) (int, map[string]any, bool, error) {
	body := append(append([]byte(`{"output_format":"jcs","document":`), doc...), '}')
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, x.api+"/v1/tasks", strings.NewReader(string(body)))
	if err != nil {
		return 0, nil, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer "+x.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, false, err
	}
	defer resp.Body.Close()
	var m map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&m)
	return resp.StatusCode, m, resp.Header.Get("Idempotent-Replayed") == "true", nil
}

// create submits doc under key and records the task and the intent.
func (x *X) create(ctx context.Context, key string, doc []byte) (string, error) {
	status, m, _, err := x.post(ctx, key, doc)
	if err != nil {
		return "", err
	}
	id, _ := m["task_id"].(string)
	if status != http.StatusAccepted || id == "" {
		return "", fmt.Errorf("POST /v1/tasks: %d %v", status, m)
	}
	x.keys = append(x.keys, key)
	x.tasks = append(x.tasks, id)
	return id, nil
}

// until polls cond every 20ms until it is true, ctx ends or timeout.
func until(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s", timeout, what)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

func (x *X) status(ctx context.Context, taskID string) (status string, version int64, code string) {
	var c *string
	_ = x.pool.QueryRow(ctx, `SELECT status, version, terminal_error_code FROM task WHERE task_id = $1`, taskID).Scan(&status, &version, &c)
	if c != nil {
		code = *c
	}
	return status, version, code
}

func (x *X) waitStatus(ctx context.Context, taskID, want string) error {
	return until(ctx, time.Minute, "task "+taskID+" "+want, func() bool {
		s, _, _ := x.status(ctx, taskID)
		return s == want
	})
}

func (x *X) scalar(ctx context.Context, sql string, args ...any) int64 {
	var n int64
	if err := x.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// metric sums the samples of a metric whose labels include want.
func (x *X) metric(name string, want map[string]string) float64 {
	if x.reg == nil {
		return 0
	}
	mfs, err := x.reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue next
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// maxDeliveries bounds the deliveries of one message: more means a message
// is being requeued without end.
const maxDeliveries = 10

// invariants checks the cross-cutting invariants on the tasks involved.
func (x *X) invariants(ctx context.Context) {
	tasks, keys := x.tasks, x.keys
	n := x.scalar(ctx, `SELECT count(DISTINCT task_id) FROM idempotency_record WHERE idempotency_key = ANY($1)`, keys)
	all := x.scalar(ctx, `SELECT count(*) FROM task`)
	x.check("one task per intent", n == int64(len(keys)) && all == int64(len(keys)),
		"%d idempotency keys, %d distinct tasks behind them, %d tasks in the database", len(keys), n, all)
	nonTerminal := x.scalar(ctx, `SELECT count(*) FROM task WHERE task_id = ANY($1) AND status NOT IN ('completed', 'failed', 'compensated', 'cancelled')`, tasks)
	x.check("no task left non-terminal", nonTerminal == 0, "%d non-terminal", nonTerminal)
	badCompleted := x.scalar(ctx, `SELECT count(*) FROM task t WHERE t.task_id = ANY($1) AND t.status = 'completed' AND
  (SELECT count(*) FROM effect_ledger e WHERE e.task_id = t.task_id AND e.effect_kind = 'artifact.put' AND e.state = 'verified'
     AND e.observed_result_sha256 = t.artifact_sha256) <> 1`, tasks)
	x.check("one verified artifact per completed task", badCompleted == 0, "%d completed tasks without exactly one verified artifact", badCompleted)
	badFailed := x.scalar(ctx, `SELECT count(*) FROM task t WHERE t.task_id = ANY($1) AND t.status <> 'completed' AND
  EXISTS (SELECT 1 FROM effect_ledger e WHERE e.task_id = t.task_id AND e.effect_kind = 'artifact.put' AND e.state NOT IN ('compensated', 'planned', 'failed'))`, tasks)
	x.check("a failed task keeps no artifact (compensated)", badFailed == 0, "%d failed tasks with an uncompensated artifact effect", badFailed)
	processing := x.scalar(ctx, `SELECT count(*) FROM inbox_message i JOIN outbox_event o ON o.outbox_id = i.message_id
  WHERE o.aggregate_id = ANY($1) AND i.state = 'processing'`, tasks)
	x.check("no inbox row left processing", processing == 0, "%d processing", processing)
	maxDel := x.scalar(ctx, `SELECT COALESCE(max(deliveries), 0) FROM inbox_message`)
	// The replay limit holds per task, summed over all its dead letters
	// (per message when the record named no task).
	maxRep := x.scalar(ctx, `SELECT COALESCE(max(n), 0) FROM (SELECT sum(replay_count) AS n FROM dead_letter
  GROUP BY COALESCE(task_id, message_id, dead_letter_id::text)) r`)
	x.check("no message requeued forever", maxDel <= maxDeliveries && maxRep <= int64(x.replays),
		"max deliveries of one message %d (bound %d), max replays of one task %d (bound %d)", maxDel, maxDeliveries, maxRep, x.replays)
	err := until(ctx, 20*time.Second, "outbox published", func() bool {
		return x.scalar(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`) == 0
	})
	detail := "every row reads as published (outbox_published_at)"
	if err != nil {
		detail = err.Error()
	}
	x.check("every outbox row published", err == nil, "%s", detail)
	x.rep.Counts["duplicate_deliveries"] = x.scalar(ctx, `SELECT COALESCE(sum(deliveries - 1), 0) FROM inbox_message`)
	x.rep.Counts["inbox_conflicts"] = x.scalar(ctx, `SELECT count(*) FROM inbox_conflict`)
	x.rep.Counts["dead_letters"] = x.scalar(ctx, `SELECT count(*) FROM dead_letter`)
	x.rep.Counts["tasks"] = all
}

// snapshot returns the rows involved, as JSON objects per table.
func (x *X) snapshot(ctx context.Context) map[string]any {
	tasks := x.tasks
	// outbox_event.payload is text holding JSON (migration 00004): shown as
	// the object it is, not as a string.
	queries := map[string]string{
		"task":               `SELECT row_to_json(t) FROM task t WHERE task_id = ANY($1) ORDER BY created_at`,
		"idempotency_record": `SELECT row_to_json(i) FROM idempotency_record i WHERE task_id = ANY($1) OR idempotency_key = ANY($2) ORDER BY created_at`,
		"outbox_event":       `SELECT jsonb_set(to_jsonb(o), '{payload}', o.payload::jsonb) FROM outbox_event o WHERE aggregate_id = ANY($1) ORDER BY created_at, outbox_id`,
		"inbox_message":      `SELECT row_to_json(i) FROM inbox_message i WHERE message_id IN (SELECT outbox_id FROM outbox_event WHERE aggregate_id = ANY($1)) ORDER BY first_seen_at`,
		"effect_ledger":      `SELECT row_to_json(e) FROM effect_ledger e WHERE task_id = ANY($1) ORDER BY created_at`,
		"dead_letter":        `SELECT row_to_json(d) FROM dead_letter d WHERE task_id = ANY($1) ORDER BY dead_letter_id`,
		"inbox_conflict":     `SELECT row_to_json(c) FROM inbox_conflict c WHERE message_id IN (SELECT outbox_id FROM outbox_event WHERE aggregate_id = ANY($1))`,
	}
	out := map[string]any{}
	for table, q := range queries {
		args := []any{tasks}
		if strings.Contains(q, "$2") {
			args = append(args, x.keys)
		}
		rows, err := x.pool.Query(ctx, q, args...)
		if err != nil {
			out[table] = map[string]string{"error": err.Error()}
			continue
		}
		list := []json.RawMessage{}
		for rows.Next() {
			var raw []byte
			if rows.Scan(&raw) == nil {
				list = append(list, raw)
			}
		}
		rows.Close()
		out[table] = list
	}
	return out
}

func write(dir string, r *Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, r.Name+".json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	var b strings.Builder
	verdict := "PASSED"
	if !r.Passed {
		verdict = "FAILED"
	}
	fmt.Fprintf(&b, "# %s — %s\n\n%s (%s, seed %s)\n\n## Steps\n\n", r.Name, r.Title, verdict, r.Duration, r.Seed)
	for i, s := range r.Steps {
		fmt.Fprintf(&b, "%d. %s\n", i+1, s)
	}
	if r.Error != "" {
		fmt.Fprintf(&b, "\nError: %s\n", r.Error)
	}
	b.WriteString("\n## Checks\n\n")
	for _, c := range r.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(&b, "- %s %s — %s\n", mark, c.Name, c.Detail)
	}
	b.WriteString("\n## Counts\n\n")
	keys := make([]string, 0, len(r.Counts))
	for k := range r.Counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "- %s: %v\n", k, r.Counts[k])
	}
	fmt.Fprintf(&b, "\nRows involved: %s.json (snapshot).\n", r.Name)
	return os.WriteFile(filepath.Join(dir, r.Name+".md"), []byte(b.String()), 0o644)
}
