package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/tenant"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/corpus"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

func TestCreateReplayAndKeyReuse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const key = "key-create-0001"
	doc := `{"b":[1,2.50,"x"],"a":{"z":null,"y":true}}`

	first := b.post(t, key, wrap(doc))
	if first.status != http.StatusAccepted {
		t.Fatalf("status %d: %s", first.status, first.body)
	}
	body := first.json(t)
	id, _ := body["task_id"].(string)
	canonical, err := canon.Transform([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	wantBody := map[string]any{"task_id": id, "status": "queued", "version": float64(0),
		"input_sha256": canon.SHA256Hex(canonical), "output_format": "jcs",
		"links": map[string]any{"self": "/v1/tasks/" + id, "artifact": "/v1/tasks/" + id + "/artifact"}}
	if fmt.Sprint(body) != fmt.Sprint(wantBody) {
		t.Fatalf("body %v\nwant %v", body, wantBody)
	}
	if loc := first.header.Get("Location"); loc != "/v1/tasks/"+id {
		t.Fatalf("Location %q", loc)
	}
	if first.header.Get("Idempotent-Replayed") != "" {
		t.Fatal("first response marked as replayed")
	}

	// The rows of seed 3.1/4: one task (queued v0), its input, a succeeded
	// idempotency record and one TaskCreated outbox row.
	var status string
	var version, inputSize int64
	var fp, inputSHA string
	if err := b.db.Pool.QueryRow(ctx, `SELECT status, version, input_size, request_fingerprint, input_sha256 FROM task WHERE task_id=$1`, id).
		Scan(&status, &version, &inputSize, &fp, &inputSHA); err != nil {
		t.Fatal(err)
	}
	if status != "queued" || version != 0 || inputSize != int64(len(canonical)) || fp != Fingerprint(inputSHA, "jcs") {
		t.Fatalf("task row: %s v%d size %d fp %s", status, version, inputSize, fp)
	}
	var stored []byte
	if err := b.db.Pool.QueryRow(ctx, `SELECT document FROM task_input WHERE task_id=$1`, id).Scan(&stored); err != nil ||
		string(stored) != string(canonical) || canon.SHA256Hex(stored) != inputSHA {
		t.Fatalf("task_input %q, %v; want the document's canonical form %s, whose SHA-256 is the task's input_sha256", stored, err, canonical)
	}
	var state string
	var recTask string
	var respStatus int
	if err := b.db.Pool.QueryRow(ctx, `SELECT state, task_id, response_status FROM idempotency_record WHERE scope=$1 AND idempotency_key=$2`, tenant.CreateScope(b.tenant.ID), key).
		Scan(&state, &recTask, &respStatus); err != nil || state != "succeeded" || recTask != id || respStatus != 202 {
		t.Fatalf("idempotency record: %s %s %d %v", state, recTask, respStatus, err)
	}
	var eventType, payloadSHA string
	var payload []byte
	var aggVersion int64
	if err := b.db.Pool.QueryRow(ctx, `SELECT event_type, aggregate_version, payload::text, payload_sha256 FROM outbox_event WHERE aggregate_id=$1`, id).
		Scan(&eventType, &aggVersion, &payload, &payloadSHA); err != nil {
		t.Fatal(err)
	}
	_, sum, err := taskevent.Canonical(payload)
	if err != nil || eventType != taskevent.TypeTaskCreated || aggVersion != 0 || sum != payloadSHA {
		t.Fatalf("outbox row: %s v%d sha %s (canonical %s) %v", eventType, aggVersion, payloadSHA, sum, err)
	}
	ev, err := taskevent.Decode(payload)
	if err != nil || ev.Task.TaskID != id || ev.Task.Status != "queued" || ev.Task.InputSHA256 != canon.SHA256Hex(canonical) {
		t.Fatalf("outbox payload %s: %v", payload, err)
	}
	// The snapshot is the row: same timestamps (the transaction's clock).
	var createdAt time.Time
	if err := b.db.Pool.QueryRow(ctx, `SELECT created_at FROM task WHERE task_id=$1`, id).Scan(&createdAt); err != nil ||
		!createdAt.Equal(ev.Task.CreatedAt) || !ev.OccurredAt.Equal(createdAt) {
		t.Fatalf("task created_at %s, event task.created_at %s occurred_at %s (%v)", createdAt, ev.Task.CreatedAt, ev.OccurredAt, err)
	}

	counts := func() [4]int {
		return [4]int{b.count(t, "task"), b.count(t, "task_input"), b.count(t, "idempotency_record"), b.count(t, "outbox_event")}
	}
	if c := counts(); c != [4]int{1, 1, 1, 1} {
		t.Fatalf("row counts %v", c)
	}

	// Replays: same bytes, a byte-different encoding of the same value, and
	// the key in its sf-string form.
	for _, replay := range []struct {
		key  string
		body []byte
	}{
		{key, wrap(doc)},
		{key, []byte("{ \"output_format\" : \"jcs\",\n\t\"document\" : {\"a\":{\"y\":true,\"z\":null},\"b\":[1,2.5,\"\\u0078\"]} }")},
		{`"` + key + `"`, wrap(doc)},
	} {
		r := b.post(t, replay.key, replay.body)
		if r.status != http.StatusAccepted || !bytes.Equal(r.body, first.body) {
			t.Fatalf("replay: status %d body %s, want 202 %s", r.status, r.body, first.body)
		}
		if r.header.Get("Idempotent-Replayed") != "true" || r.header.Get("Location") != "/v1/tasks/"+id {
			t.Fatalf("replay headers %v", r.header)
		}
	}
	if c := counts(); c != [4]int{1, 1, 1, 1} {
		t.Fatalf("row counts after replays %v", c)
	}

	// Same key, different document: stable error, nothing written.
	r := b.post(t, key, wrap(`{"a":2}`))
	wantProblem(t, r, http.StatusUnprocessableEntity, CodeIdempotencyKeyReused)
	if c := counts(); c != [4]int{1, 1, 1, 1} {
		t.Fatalf("row counts after key reuse %v", c)
	}
	// A new key is a new intent: a second task.
	if r := b.post(t, "key-create-0002", wrap(doc)); r.status != http.StatusAccepted || bytes.Equal(r.body, first.body) {
		t.Fatalf("new key: %d %s", r.status, r.body)
	}
	for outcome, want := range map[string]float64{"created": 2, "replayed": 3, "key_reused": 1} {
		if n := counterValue(t, b.reg, "converge_api_idempotency_total", map[string]string{"outcome": outcome}); n != want {
			t.Errorf("idempotency{outcome=%s} = %v, want %v", outcome, n, want)
		}
	}
}

func TestCreateConcurrentFirstUse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 50
	var wg sync.WaitGroup
	results := make([]*response, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {"concurrent-key-1"}}
			results[i], errs[i] = b.try(http.MethodPost, "/v1/tasks", h, wrap(`{"n":1}`))
		}()
	}
	wg.Wait()
	var created []byte
	accepted, inProgress := 0, 0
	for i, r := range results {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		switch r.status {
		case http.StatusAccepted:
			accepted++
			if created == nil {
				created = r.body
			} else if !bytes.Equal(created, r.body) {
				t.Fatalf("two different 202 bodies:\n%s\n%s", created, r.body)
			}
		case http.StatusConflict:
			wantProblem(t, r, http.StatusConflict, CodeIdempotencyInProgress)
			inProgress++
		default:
			t.Fatalf("request %d: status %d %s", i, r.status, r.body)
		}
	}
	if accepted == 0 {
		t.Fatal("no 202")
	}
	if b.count(t, "task") != 1 || b.count(t, "outbox_event") != 1 || b.count(t, "idempotency_record") != 1 {
		t.Fatalf("rows: task %d outbox %d records %d", b.count(t, "task"), b.count(t, "outbox_event"), b.count(t, "idempotency_record"))
	}
	if c := counterValue(t, b.reg, "converge_api_idempotency_total", map[string]string{"outcome": "created"}); c != 1 {
		t.Fatalf("created %v, want 1", c)
	}
	t.Logf("%d accepted (1 created, others replayed), %d in progress", accepted, inProgress)
}

func TestCreateRejectsBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxBodyBytes = 64 << 10 })
	const key = "key-bad-input"
	deep := strings.Repeat("[", canon.MaxDepth+1) + strings.Repeat("]", canon.MaxDepth+1)
	deeper := strings.Repeat("[", 20000) + strings.Repeat("]", 20000)
	big := wrap(`"` + strings.Repeat("x", 64<<10) + `"`)
	for _, tc := range []struct {
		name    string
		ct      string // "" means no Content-Type
		key     []string
		body    []byte
		chunked bool
		status  int
		code    string
	}{
		{"missing key", "application/json", nil, wrap(`1`), false, 400, CodeIdempotencyKeyMissing},
		{"empty key", "application/json", []string{""}, wrap(`1`), false, 400, CodeIdempotencyKeyMissing},
		{"key too short", "application/json", []string{"abc"}, wrap(`1`), false, 400, CodeIdempotencyKeyInvalid},
		{"key bad chars", "application/json", []string{"abc def/ghi"}, wrap(`1`), false, 400, CodeIdempotencyKeyInvalid},
		{"key too long", "application/json", []string{strings.Repeat("k", 256)}, wrap(`1`), false, 400, CodeIdempotencyKeyInvalid},
		{"key unbalanced quote", "application/json", []string{`"abcdefgh`}, wrap(`1`), false, 400, CodeIdempotencyKeyInvalid},
		{"key twice", "application/json", []string{"abcdefgh", "abcdefgh"}, wrap(`1`), false, 400, CodeIdempotencyKeyInvalid},
		{"text/plain", "text/plain", []string{key}, wrap(`1`), false, 415, CodeUnsupportedMediaType},
		{"missing content type", "", []string{key}, wrap(`1`), false, 415, CodeUnsupportedMediaType},
		{"latin1 charset", "application/json; charset=latin1", []string{key}, wrap(`1`), false, 415, CodeUnsupportedMediaType},
		{"body over limit", "application/json", []string{key}, big, false, 413, CodeBodyTooLarge},
		{"body over limit, chunked", "application/json", []string{key}, big, true, 413, CodeBodyTooLarge},
		{"empty body", "application/json", []string{key}, []byte{}, false, 400, canon.CodeMalformedJSON},
		{"malformed json", "application/json", []string{key}, []byte(`{"document": [1,}`), false, 400, canon.CodeMalformedJSON},
		// The library's message names the member: only its cause decides.
		{"malformed, a member named as an error", "application/json", []string{key}, []byte(`{"document": {"exceeded max depth": tru}}`), false, 400, canon.CodeMalformedJSON},
		{"envelope not an object", "application/json", []string{key}, []byte(`[{"document": 1}]`), false, 400, canon.CodeMalformedJSON},
		{"envelope a string", "application/json", []string{key}, []byte(`"document"`), false, 400, canon.CodeMalformedJSON},
		{"trailing garbage", "application/json", []string{key}, []byte(`{"document": 1} x`), false, 400, canon.CodeMalformedJSON},
		{"trailing value", "application/json", []string{key}, []byte(`{"document": 1} {}`), false, 400, canon.CodeMalformedJSON},
		{"invalid utf8", "application/json", []string{key}, []byte("{\"document\": \"\xff\xfe\"}"), false, 400, canon.CodeInvalidUTF8},
		{"duplicate keys in document", "application/json", []string{key}, wrap(`{"a":1,"a":2}`), false, 422, canon.CodeDuplicateMemberName},
		{"duplicate document member", "application/json", []string{key}, []byte(`{"document":1,"document":2}`), false, 400, canon.CodeDuplicateMemberName},
		{"lone surrogate", "application/json", []string{key}, wrap(`["\ud800"]`), false, 422, canon.CodeLoneSurrogate},
		{"number out of range", "application/json", []string{key}, wrap(`[1e400]`), false, 422, canon.CodeNumberOutOfRange},
		{"precision loss", "application/json", []string{key}, wrap(`12345678901234567890`), false, 422, canon.CodeNumberPrecisionLoss},
		{"nesting too deep", "application/json", []string{key}, wrap(deep), false, 422, canon.CodeNestingTooDeep},
		{"nesting beyond parser limit", "application/json", []string{key}, wrap(deeper), false, 422, canon.CodeNestingTooDeep},
		{"unclosed nesting, 5000 deep", "application/json", []string{key}, []byte(`{"document":` + strings.Repeat("[", 5000)), false, 400, canon.CodeMalformedJSON},
		{"unclosed nesting beyond parser limit", "application/json", []string{key}, []byte(`{"document":` + strings.Repeat("[", 20000)), false, 400, canon.CodeMalformedJSON},
		{"unknown member", "application/json", []string{key}, []byte(`{"document":1,"priority":"high"}`), false, 422, CodeUnknownMember},
		{"unsupported output format", "application/json", []string{key}, []byte(`{"document":1,"output_format":"yaml"}`), false, 422, CodeUnsupportedOutputFormat},
		{"output format not a string", "application/json", []string{key}, []byte(`{"document":1,"output_format":null}`), false, 422, CodeUnsupportedOutputFormat},
		{"missing document", "application/json", []string{key}, []byte(`{"output_format":"jcs"}`), false, 422, CodeDocumentMissing},
		{"empty object", "application/json", []string{key}, []byte(`{}`), false, 422, CodeDocumentMissing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			if tc.ct != "" {
				h.Set("Content-Type", tc.ct)
			}
			if tc.key != nil {
				h["Idempotency-Key"] = tc.key
			}
			var r *response
			if tc.chunked {
				req, err := http.NewRequest(http.MethodPost, b.ts.URL+"/v1/tasks", struct{ *bytes.Reader }{bytes.NewReader(tc.body)})
				if err != nil {
					t.Fatal(err)
				}
				req.Header = h
				req.Header.Set("Authorization", "Bearer "+b.token)
				resp, err := b.ts.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				var buf bytes.Buffer
				buf.ReadFrom(resp.Body)
				r = &response{status: resp.StatusCode, header: resp.Header, body: buf.Bytes()}
			} else {
				r = b.do(t, http.MethodPost, "/v1/tasks", h, tc.body)
			}
			wantProblem(t, r, tc.status, tc.code)
		})
	}
	if n := b.count(t, "task"); n != 0 {
		t.Fatalf("%d tasks created by bad input", n)
	}
	if n := b.count(t, "idempotency_record"); n != 0 {
		t.Fatalf("%d idempotency records created by bad input", n)
	}
}

// TestCreateJSONTestSuite submits every JSONTestSuite case as the document:
// n_ cases are 4xx problems, y_ cases are accepted unless they are not
// I-JSON, i_ cases never cause a 5xx.
func TestCreateJSONTestSuite(t *testing.T) {
	t.Parallel()
	b := setup(t)
	files := corpus.Files(t, "jsontestsuite/*.json", 1)
	accepted := 0
	for i, f := range files {
		name := filepath.Base(f)
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		body := append(append([]byte(`{"document": `), data...), '}')
		r := b.post(t, fmt.Sprintf("suite-%04d", i), body)
		switch {
		case strings.HasPrefix(name, "n_"):
			if r.status < 400 || r.status >= 500 || r.header.Get("Content-Type") != "application/problem+json" {
				t.Errorf("%s: status %d %s, want a 4xx problem", name, r.status, clip(string(r.body), 200))
			}
		case strings.HasPrefix(name, "y_"):
			if code, notIJSON := corpus.NotIJSON[name]; notIJSON {
				if r.status/100 != 4 || r.json(t)["code"] != code {
					t.Errorf("%s: status %d %s, want 4xx %s", name, r.status, r.body, code)
				}
			} else if r.status != http.StatusAccepted {
				t.Errorf("%s: status %d %s, want 202", name, r.status, clip(string(r.body), 200))
			} else {
				accepted++
			}
		case strings.HasPrefix(name, "i_"):
			if r.status >= 500 {
				t.Errorf("%s: status %d %s", name, r.status, r.body)
			}
			if r.status == http.StatusAccepted {
				accepted++
			}
		}
	}
	if n := b.count(t, "task"); n != accepted {
		t.Fatalf("%d tasks, want %d (one per accepted case)", n, accepted)
	}
}

func TestCreateLargeRealWorldDocument(t *testing.T) {
	t.Parallel()
	b := setup(t)
	files := corpus.Files(t, "realworld/canada.json", 1)
	doc, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	r := b.post(t, "canada-0001", wrap(string(doc)))
	if r.status != http.StatusAccepted {
		t.Fatalf("status %d %s", r.status, clip(string(r.body), 300))
	}
	canonical, err := canon.Transform(doc)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.json(t)["input_sha256"]; got != canon.SHA256Hex(canonical) {
		t.Fatalf("input_sha256 %v", got)
	}
}

func TestCreateResponseLostAfterCommit(t *testing.T) {
	t.Parallel()
	faults := &fault.Set{}
	if err := faults.Arm(fault.APIAfterCommitResponseLost, fault.ActionError, 1); err != nil {
		t.Fatal(err)
	}
	b := setup(t, func(c *Config) { c.Faults = faults })
	// net/http's transport retries requests that carry an Idempotency-Key
	// on a reused connection; a fresh connection shows the drop as it is.
	req, err := http.NewRequest(http.MethodPost, b.ts.URL+"/v1/tasks", bytes.NewReader(wrap(`{"a":1}`)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {"lost-response-1"}, "Authorization": {"Bearer " + b.token}}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := client.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("first POST answered %d; want a dropped connection", resp.StatusCode)
	}
	if faults.Fired(fault.APIAfterCommitResponseLost) != 1 {
		t.Fatal("fault point did not fire")
	}
	// Seed 13.1: the transaction committed; the retry with the same key
	// returns the first task.
	if n := b.count(t, "task"); n != 1 {
		t.Fatalf("%d tasks after the lost response", n)
	}
	r := b.post(t, "lost-response-1", wrap(`{"a":1}`))
	if r.status != http.StatusAccepted || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %v %s", r.status, r.header, r.body)
	}
	var id string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT task_id FROM task`).Scan(&id); err != nil || r.json(t)["task_id"] != id {
		t.Fatalf("retry returned %v, task is %s (%v)", r.json(t)["task_id"], id, err)
	}
	if n := b.count(t, "task"); n != 1 {
		t.Fatalf("%d tasks after the retry", n)
	}
	if c := counterValue(t, b.reg, "converge_api_requests_total", map[string]string{"code": "aborted"}); c != 1 {
		t.Fatalf("aborted requests %v", c)
	}
}

func TestFingerprintIgnoresEncoding(t *testing.T) {
	t.Parallel()
	a := Fingerprint(canon.SHA256Hex([]byte(`{"a":1}`)), "jcs")
	if len(a) != 64 || a == Fingerprint(canon.SHA256Hex([]byte(`{"a":2}`)), "jcs") {
		t.Fatalf("fingerprint %q", a)
	}
	raw, _ := json.Marshal(map[string]any{"policy_version": 1, "output_format": "jcs", "operation": "create-document-task", "input_sha256": canon.SHA256Hex([]byte(`{"a":1}`))})
	c, _ := canon.Transform(raw)
	if canon.SHA256Hex(c) != a {
		t.Fatal("fingerprint is not the sha256 of the canonical fingerprint object")
	}
}

func TestCreateInProgressRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	fp := Fingerprint(canon.SHA256Hex([]byte(`{"a":1}`)), "jcs")
	if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, expires_at)
VALUES ($1, 'in-progress-1', $2, 'in_progress', now() + interval '30 seconds', now() + interval '1 day')`, tenant.CreateScope(b.tenant.ID), fp); err != nil {
		t.Fatal(err)
	}
	r := b.post(t, "in-progress-1", wrap(`{"a":1}`))
	wantProblem(t, r, http.StatusConflict, CodeIdempotencyInProgress)
	if r.header.Get("Retry-After") != "1" {
		t.Fatalf("Retry-After %q", r.header.Get("Retry-After"))
	}
	// A different request under that key is still a key reuse.
	wantProblem(t, b.post(t, "in-progress-1", wrap(`{"a":2}`)), http.StatusUnprocessableEntity, CodeIdempotencyKeyReused)
	if n := b.count(t, "task"); n != 0 {
		t.Fatalf("%d tasks", n)
	}
}

// TestCreateWaitsOnPrimaryKey shows that the primary key, not a prior read,
// decides: a request whose key is being inserted by another, uncommitted
// transaction waits for it, and wins when that transaction rolls back.
func TestCreateWaitsOnPrimaryKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, expires_at)
VALUES ($1, 'pk-decides-1', $2, 'in_progress', now(), now() + interval '1 day')`, tenant.CreateScope(b.tenant.ID), strings.Repeat("0", 64)); err != nil {
		t.Fatal(err)
	}
	done := make(chan *response, 1)
	go func() {
		h := http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {"pk-decides-1"}}
		r, err := b.try(http.MethodPost, "/v1/tasks", h, wrap(`[1]`))
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	testenv.Eventually(t, 5*time.Second, "the POST waits on the record's primary key", func() bool {
		var n int
		_ = b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
		return n == 1
	})
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r == nil || r.status != http.StatusAccepted || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("after the competitor rolled back: %+v", r)
	}
	if n := b.count(t, "task"); n != 1 {
		t.Fatalf("%d tasks", n)
	}
}

// TestCreateRejectsContentCodingAndRepeatedContentType: a gzip body or two
// Content-Type headers get 415, never a misleading syntax error.
func TestCreateRejectsContentCodingAndRepeatedContentType(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, h := range map[string]http.Header{
		"gzip":              {"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}, "Idempotency-Key": {"key-coding-1"}},
		"two content types": {"Content-Type": {"application/json", "text/plain"}, "Idempotency-Key": {"key-coding-2"}},
	} {
		r := b.do(t, http.MethodPost, "/v1/tasks", h, wrap(`{"a":1}`))
		if r.status != http.StatusUnsupportedMediaType {
			t.Errorf("%s: status %d, want 415", name, r.status)
		}
		wantProblem(t, r, http.StatusUnsupportedMediaType, CodeUnsupportedMediaType)
	}
	if n := b.count(t, "task"); n != 0 {
		t.Errorf("%d tasks created", n)
	}
}

// TestMalformedDetailNamesThePathInLargeBodies: the JSON pointer in a
// MALFORMED_JSON detail names every member on the way, also when the body is
// larger than a reader's buffer (the envelope is parsed in place: with a
// copying reader, names read before a refill came out empty, "/document///").
func TestMalformedDetailNamesThePathInLargeBodies(t *testing.T) {
	t.Parallel()
	body := []byte(`{"document":{"outer":{"inner":{"s":"` + strings.Repeat("x", 6000) + "\x01" + `"}}}}`)
	_, err := parseCreateRequest(body)
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != canon.CodeMalformedJSON {
		t.Fatalf("err = %v, want %s", err, canon.CodeMalformedJSON)
	}
	if !strings.Contains(ae.Detail, "/document/outer/inner/s") {
		t.Errorf("detail %q does not name /document/outer/inner/s", ae.Detail)
	}
}
