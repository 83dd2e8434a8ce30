package pipeline_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gowebpki/jcs"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/corpus"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/schemas"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type bundle struct {
	db      *testenv.DB
	kafka   *testenv.Kafka
	baseURL string
	client  *submit.Client
	token   string // API token of the tenant the tests send as
	cancel  context.CancelFunc
	done    chan error
}

// setup runs the whole pipeline against a fresh database, a kfake cluster and
// the shared redis-server, and stops it when t ends.
func setup(t *testing.T) *bundle {
	t.Helper()
	return setupWith(t, nil)
}

// setupWith is setup with cfg changed by mod (when not nil) before the
// pipeline starts.
func setupWith(t *testing.T, mod func(cfg *pipeline.Config)) *bundle {
	t.Helper()
	return setupOn(t, testenv.NewDB(t), mod)
}

// setupOn is setupWith on the database db.
func setupOn(t *testing.T, db *testenv.DB, mod func(cfg *pipeline.Config)) *bundle {
	t.Helper()
	k := testenv.NewKafka(t)
	redisURL, _ := testenv.Redis(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b := &bundle{db: db, kafka: k, baseURL: "http://" + ln.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	_, tok, err := tenant.Add(context.Background(), db.Pool, "pipeline-test", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	b.token = tok
	b.client = &submit.Client{BaseURL: b.baseURL, Token: tok, PollInterval: 20 * time.Millisecond}
	cfg := pipeline.Config{
		DatabaseURL: db.URL, Brokers: k.Brokers, RedisURL: redisURL, ArtifactDir: t.TempDir(),
		SlotName: "s_" + db.Name, PublicationName: "p_" + db.Name, Listener: ln,
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
		Finalize: true, // as converge dev on its embedded database
	}
	if mod != nil {
		mod(&cfg)
	}
	go func() { b.done <- pipeline.Run(ctx, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-b.done:
			if err != nil {
				t.Errorf("pipeline.Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("pipeline did not stop within 30s")
		}
	})
	return b
}

func (b *bundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	if err := b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (b *bundle) post(t *testing.T, key string, body []byte) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.baseURL+"/v1/tasks", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer "+b.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	rb, _ := io.ReadAll(resp.Body)
	return resp, rb
}

func (b *bundle) artifact(t *testing.T, taskID string) []byte {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, b.baseURL+"/v1/tasks/"+taskID+"/artifact", nil)
	req.Header.Set("Authorization", "Bearer "+b.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("artifact %s: %d %s", taskID, resp.StatusCode, body)
	}
	if got := resp.Header.Get("X-Artifact-Sha256"); got != canon.SHA256Hex(body) {
		t.Errorf("artifact %s: X-Artifact-Sha256 %s does not match the body", taskID, got)
	}
	return body
}

// ownDocuments are the project's own end-to-end cases (they run without the
// shared corpus): shapes and values RFC 8785 treats specially — member
// order by UTF-16 code units, number formatting at the edges of the double
// range and of exact integers, escapes, nesting, empty containers.
var ownDocuments = map[string]string{
	"own-invoice.json":      `{"id":"INV-7","lines":[{"sku":"a","qty":2,"price":9.99},{"sku":"b","qty":1,"price":1e2}],"paid":false,"note":null}`,
	"own-member-order.json": `{"b":1,"a":2,"\u20ac":3,"\ud83d\ude00":4,"\u00e9":5,"A":6,"aa":7,"":8}`,
	"own-numbers.json":      `[0,-0,1.0,0.1,1e21,1e-7,9007199254740991,-9007199254740991,5e-324,1.7976931348623157e308,0.000001,1E+2]`,
	"own-strings.json":      `["\u0000\u001f","\"\\\/","\b\f\n\r\t","\u2028\u2029","caf\u00e9","\ud83d\ude00",""]`,
	"own-nested.json":       `{"a":{"b":{"c":{"d":[[[[{"e":[]}]]]]}}},"z":{},"y":[]}`,
	"own-scalar.json":       `"just a string"`,
}

// ownRejections are the project's own inputs the API must refuse with a
// 4xx problem (code, when not empty) and no task.
var ownRejections = map[string]struct{ doc, code string }{
	"own-duplicate-member": {`{"a":1,"a":2}`, "DUPLICATE_MEMBER_NAME"},
	"own-trailing-comma":   {`[1,]`, ""},
	"own-unclosed":         {`{"a":`, ""},
	"own-bare-word":        {`nul`, ""},
	"own-lone-surrogate":   {`"\ud800"`, ""},
	"own-huge-number":      {`1e400`, ""},
}

// TestEndToEndCorpus is the main job's acceptance test: every realworld file,
// every JCS vector and every I-JSON y_ case of JSONTestSuite goes through the
// API, the relay, Kafka and the worker and completes with the RFC 8785 form
// as its artifact (compared with an independent implementation, and
// byte-for-byte with the JCS vectors' expected output); the non-I-JSON y_
// cases and every n_ case are rejected with a 4xx problem and create no task;
// no i_ case gives a 5xx or hangs. Submitting everything again creates no
// new task. Without the shared corpus it runs on the project's own cases
// (ownDocuments, ownRejections) only.
func TestEndToEndCorpus(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	type doc struct {
		path string
		want []byte // expected artifact
	}
	var docs []doc
	independent := func(path string, in []byte) []byte {
		out, err := jcs.Transform(in)
		if err != nil {
			t.Fatalf("%s: independent RFC 8785 implementation: %v", path, err)
		}
		return out
	}
	// The project's own cases run everywhere; the corpus's are added when
	// it is there (internal/corpus).
	own := t.TempDir()
	for name, in := range ownDocuments {
		path := filepath.Join(own, name)
		if err := os.WriteFile(path, []byte(in), 0o644); err != nil {
			t.Fatal(err)
		}
		docs = append(docs, doc{path, independent(path, []byte(in))})
	}
	add := func(pattern string, expected func(path string, in []byte) []byte) {
		for _, f := range corpus.Optional(t, pattern, 1) {
			in, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			docs = append(docs, doc{f, expected(f, in)})
		}
	}
	add("realworld/*.json", independent)
	add("jcs/input/*.json", func(path string, _ []byte) []byte {
		out, err := os.ReadFile(filepath.Join(filepath.Dir(path), "..", "output", filepath.Base(path)))
		if err != nil {
			t.Fatal(err)
		}
		return out
	})
	ys := corpus.Optional(t, "jsontestsuite/y_*.json", 1)
	for _, f := range ys {
		if _, bad := corpus.NotIJSON[filepath.Base(f)]; bad {
			continue
		}
		in, _ := os.ReadFile(f)
		docs = append(docs, doc{f, independent(f, in)})
	}

	results := make([]submit.Result, len(docs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, d := range docs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			results[i] = b.client.Document(ctx, d.path, 90*time.Second)
		}()
	}
	wg.Wait()
	taskIDs := map[string]bool{}
	for i, r := range results {
		name := filepath.Base(docs[i].path)
		if r.Status != taskevent.StatusCompleted {
			t.Errorf("%s: status %s (%s %v)", name, r.Status, r.ErrorCode, r.Err)
			continue
		}
		taskIDs[r.TaskID] = true
		got := b.artifact(t, r.TaskID)
		if !bytes.Equal(got, docs[i].want) {
			t.Errorf("%s: artifact differs from the RFC 8785 form (%d vs %d bytes)", name, len(got), len(docs[i].want))
		}
		if r.ArtifactSHA256 != canon.SHA256Hex(docs[i].want) {
			t.Errorf("%s: task artifact_sha256 %s, want %s", name, r.ArtifactSHA256, canon.SHA256Hex(docs[i].want))
		}
	}
	tasks := b.count(t, "task")
	if tasks != len(taskIDs) {
		t.Errorf("%d tasks for %d distinct documents", tasks, len(taskIDs))
	}

	// Rejections: nothing may create a task.
	for name, rej := range ownRejections {
		resp, body := b.post(t, submit.KeyFor([]byte(rej.doc)), envelope([]byte(rej.doc)))
		assertProblem(t, name, resp, body, rej.code)
	}
	if len(ys) > 0 {
		for name, code := range corpus.NotIJSON {
			in, _ := os.ReadFile(filepath.Join(filepath.Dir(ys[0]), name))
			resp, body := b.post(t, submit.KeyFor(in), envelope(in))
			assertProblem(t, name, resp, body, code)
		}
	}
	for _, f := range corpus.Optional(t, "jsontestsuite/n_*.json", 100) {
		in, _ := os.ReadFile(f)
		resp, body := b.post(t, submit.KeyFor(in), envelope(in))
		assertProblem(t, filepath.Base(f), resp, body, "")
	}
	if got := b.count(t, "task"); got != tasks {
		t.Errorf("rejected inputs created %d tasks", got-tasks)
	}
	for _, f := range corpus.Optional(t, "jsontestsuite/i_*.json", 1) {
		r := b.client.Document(ctx, f, 60*time.Second)
		switch {
		case r.Status == "rejected" && r.HTTPStatus >= 400 && r.HTTPStatus < 500:
		case r.Status == taskevent.StatusCompleted:
		default:
			t.Errorf("%s: %s HTTP %d %s %v", filepath.Base(f), r.Status, r.HTTPStatus, r.ErrorCode, r.Err)
		}
	}

	// Everything again: replayed, no new tasks.
	before := b.count(t, "task")
	var out bytes.Buffer
	s, err := submit.Run(ctx, &out, b.client, []string{docs[0].path, docs[1].path, docs[len(docs)-1].path}, 4, time.Minute)
	if err != nil || !s.OK() || s.Replayed != 3 {
		t.Errorf("second submit: %+v %v\n%s", s, err, out.String())
	}
	if after := b.count(t, "task"); after != before {
		t.Errorf("second submit created %d tasks", after-before)
	}

	// Invariants from the database: one verified artifact effect per
	// completed task, every outbox row published, no task left non-terminal.
	testenv.Eventually(t, 30*time.Second, "every outbox row published", func() bool {
		var n int
		b.db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL").Scan(&n)
		return n == 0
	})
	var bad int
	err = b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM task t WHERE t.status <> 'completed'
		OR (SELECT count(*) FROM effect_ledger e WHERE e.task_id = t.task_id AND e.effect_kind = 'artifact.put' AND e.state = 'verified') <> 1`).Scan(&bad)
	if err != nil || bad != 0 {
		t.Errorf("%d tasks without exactly one verified artifact (%v)", bad, err)
	}
}

func envelope(doc []byte) []byte {
	return append(append([]byte(`{"output_format":"jcs","document":`), doc...), '}')
}

func assertProblem(t *testing.T, name string, resp *http.Response, body []byte, code string) {
	t.Helper()
	if resp.StatusCode < 400 || resp.StatusCode >= 500 {
		t.Errorf("%s: status %d, want 4xx", name, resp.StatusCode)
		return
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/problem+json") {
		t.Errorf("%s: content type %q", name, ct)
	}
	var p struct {
		Code string `json:"code"`
	}
	if err := json.Unmarshal(body, &p); err != nil || p.Code == "" {
		t.Errorf("%s: problem without code: %s", name, body)
	}
	if code != "" && p.Code != code {
		t.Errorf("%s: code %s, want %s", name, p.Code, code)
	}
}

// TestTaskEventsReadableByAnyKafkaClient checks the contract on the wire: a
// plain consumer (no converge code) sees TaskCreated then TaskCompleted for a
// task, keyed by task id, with the documented headers.
func TestTaskEventsReadableByAnyKafkaClient(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	in := []byte(`{"b":[3,2,1],"a":"x"}`)
	r, err := b.client.Create(ctx, "contract-key-1", in)
	if err != nil || r.TaskID == "" {
		t.Fatalf("create: %+v %v", r, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if _, err := b.client.Wait(wctx, r.TaskID); err != nil {
		t.Fatal(err)
	}
	cl := b.kafka.Client(t, kgo.ConsumeTopics(b.kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	var types []string
	deadline := time.Now().Add(20 * time.Second)
	for len(types) < 2 && time.Now().Before(deadline) {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		fs := cl.PollFetches(pctx)
		cancel()
		fs.EachRecord(func(rec *kgo.Record) {
			if string(rec.Key) != r.TaskID {
				return
			}
			h := map[string]string{}
			for _, x := range rec.Headers {
				h[x.Key] = string(x.Value)
			}
			if h[taskevent.HeaderPayloadSHA256] != canon.SHA256Hex(rec.Value) {
				t.Errorf("payload-sha256 header does not match the value")
			}
			for _, k := range []string{taskevent.HeaderEventID, taskevent.HeaderEventType, taskevent.HeaderAggregateVersion} {
				if h[k] == "" {
					t.Errorf("header %s missing", k)
				}
			}
			e, err := taskevent.Decode(rec.Value)
			if err != nil {
				t.Errorf("decode: %v", err)
				return
			}
			// The task's tenant travels in the value and in a header.
			if e.Task.TenantID == "" || h[taskevent.HeaderTenantID] != e.Task.TenantID {
				t.Errorf("%s: tenant %q in the value, header tenant-id %q", e.EventType, e.Task.TenantID, h[taskevent.HeaderTenantID])
			}
			types = append(types, fmt.Sprintf("%s@%d", e.EventType, e.TaskVersion))
		})
	}
	want := []string{"TaskCreated@0", "TaskCompleted@2"}
	if fmt.Sprint(types) != fmt.Sprint(want) {
		t.Errorf("events %v, want %v", types, want)
	}
}

// TestSessionsNameTheirComponent: every PostgreSQL session of the pipeline
// says whose it is (application_name), so that pg_stat_activity and
// pg_stat_statements split the database's work by component: the API, the
// worker and the reconciler have pools of their own, the relay its pool and
// its replication connection.
func TestSessionsNameTheirComponent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, body := b.post(t, "application-name", []byte(`{"document":{"a":1}}`))
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	want := []string{"converge-api", "converge-worker", "converge-reconciler", "converge-relay"}
	var got []string
	testenv.Eventually(t, 30*time.Second, "a session of every component", func() bool {
		rows, err := b.db.Pool.Query(context.Background(), `SELECT DISTINCT application_name FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'converge-%' ORDER BY 1`)
		if err != nil {
			return false
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return false
		}
		for _, w := range want {
			if !slices.Contains(got, w) {
				return false
			}
		}
		return true
	})
	t.Logf("application names: %v", got)
}

// TestArtifactFormatFollowsFinalize: the pipeline without Finalize leaves a
// migrated database's floor where it is (it still serves the previous
// release) and writes one file per artifact; with Finalize (converge dev
// on its embedded database) it raises the floor to this binary and writes
// pack files. Both serve the artifact.
func TestArtifactFormatFollowsFinalize(t *testing.T) {
	t.Parallel()
	for _, finalize := range []bool{false, true} {
		t.Run(fmt.Sprint("finalize=", finalize), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dir := t.TempDir()
			b := setupWith(t, func(cfg *pipeline.Config) { cfg.Finalize, cfg.ArtifactDir = finalize, dir })
			resp, body := b.post(t, "format-1", []byte(`{"document":{"a":1}}`))
			if resp.StatusCode != http.StatusAccepted {
				t.Fatalf("create: %d %s", resp.StatusCode, body)
			}
			var created struct {
				TaskID string `json:"task_id"`
			}
			if err := json.Unmarshal(body, &created); err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			if task, err := b.client.Wait(wctx, created.TaskID); err != nil || task.Status != taskevent.StatusCompleted {
				t.Fatalf("task: %+v, %v", task, err)
			}
			if got := b.artifact(t, created.TaskID); string(got) != `{"a":1}` {
				t.Errorf("artifact %q", got)
			}
			names, _ := filepath.Glob(filepath.Join(dir, "objects", created.TaskID+".*.obj"))
			if len(names) != 1 {
				t.Fatalf("objects %v, want one", names)
			}
			raw, err := os.ReadFile(names[0])
			if err != nil {
				t.Fatal(err)
			}
			if pack := bytes.HasPrefix(raw, []byte("CVPACK1\n")); pack != finalize {
				t.Errorf("artifact file starts %.12q: pack %v, want %v", raw, pack, finalize)
			}
			v, err := schemas.Check(ctx, b.db.Pool)
			if err != nil || v.ArtifactPacks() != finalize || finalize && v.OldestBinary != v.Binary {
				t.Errorf("schema after the pipeline: %+v, %v", v, err)
			}
		})
	}
}
