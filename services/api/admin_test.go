package api

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/testenv"
)

// adminSetup starts a Server whose dead-letter service replays into a
// kfake cluster (no producer when withKafka is false).
func adminSetup(t *testing.T, withKafka bool) *testBundle {
	t.Helper()
	return setup(t, func(c *Config) {
		dc := deadletter.Config{Pool: c.Pool, Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
		if withKafka {
			dc.Producer = testenv.NewKafka(t).Client(t)
		}
		svc, err := deadletter.New(dc)
		if err != nil {
			t.Fatal(err)
		}
		c.DeadLetters = svc
	})
}

// parkFailedTask inserts a task failed with code and its dead letter, and
// returns the dead letter's id and the task id.
func (b *testBundle) parkFailedTask(t *testing.T, code string, offset int64) (int64, string) {
	t.Helper()
	ctx := context.Background()
	taskID := "task-" + uuid.NewString()
	sha := strings.Repeat("a", 64)
	if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO task (task_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, terminal_error_code)
VALUES ($1, $2, 'failed', 1, 0, 'jcs', $2, 2, $3)`, taskID, sha, code); err != nil {
		t.Fatal(err)
	}
	msgID := uuid.NewString()
	now := time.Now().UTC()
	d := deadletter.DeadLetter{OriginTopic: "converge.task-events.v1", OriginOffset: offset, ConsumerGroup: "converge-worker",
		Key: []byte(taskID), Value: []byte(`{"x":1}`), Headers: []deadletter.Header{{Key: "event-id", Value: []byte(msgID)}},
		MessageID: &msgID, TaskID: &taskID, ErrorClass: "deterministic", ErrorCode: code, ErrorMessage: "boom", Attempts: 1,
		ProcessorVersion: "test", FirstFailureAt: now, LastFailureAt: now, DLQOffset: offset}
	if ok, err := b.srv.cfg.DeadLetters.Store().Insert(ctx, d); err != nil || !ok {
		t.Fatalf("insert dead letter: %v %v", ok, err)
	}
	var id int64
	if err := b.db.Pool.QueryRow(ctx, `SELECT dead_letter_id FROM dead_letter WHERE origin_offset = $1`, offset).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id, taskID
}

var jsonHeader = http.Header{"Content-Type": {"application/json"}}

func TestAdminDeadLetters(t *testing.T) {
	t.Parallel()
	b := adminSetup(t, true)
	id, taskID := b.parkFailedTask(t, "CODE_A", 1)
	otherID, _ := b.parkFailedTask(t, "CODE_B", 2)

	r := b.do(t, http.MethodGet, "/v1/admin/dead-letters", nil, nil)
	if r.status != http.StatusOK || r.header.Get("Content-Type") != "application/json" {
		t.Fatalf("list: %d %s %s", r.status, r.header.Get("Content-Type"), r.body)
	}
	if list := r.json(t)["dead_letters"].([]any); len(list) != 2 {
		t.Fatalf("list: %d dead letters, want 2", len(list))
	}
	r = b.do(t, http.MethodGet, "/v1/admin/dead-letters?code=CODE_B&state=parked&limit=10", nil, nil)
	list := r.json(t)["dead_letters"].([]any)
	if r.status != http.StatusOK || len(list) != 1 || list[0].(map[string]any)["id"] != float64(otherID) {
		t.Fatalf("list by code: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodGet, "/v1/admin/dead-letters?task_id="+taskID, nil, nil)
	if list := r.json(t)["dead_letters"].([]any); r.status != http.StatusOK || len(list) != 1 {
		t.Fatalf("list by task: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodGet, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10), nil, nil)
	if m := r.json(t); r.status != http.StatusOK || m["id"] != float64(id) || m["error_code"] != "CODE_A" || m["state"] != "parked" {
		t.Fatalf("get: %d %s", r.status, r.body)
	}

	path := "/v1/admin/dead-letters/" + strconv.FormatInt(id, 10) + "/replay"
	r = b.do(t, http.MethodPost, path, jsonHeader, []byte(`{"reason":"fixed A"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "replayed" || m["state"] != "replayed" || m["task_reopened"] != true || m["replay_count"] != float64(1) {
		t.Fatalf("replay: %d %s", r.status, r.body)
	}
	var status string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT status FROM task WHERE task_id = $1`, taskID).Scan(&status); err != nil || status != "queued" {
		t.Fatalf("task %s %v, want queued", status, err)
	}
	r = b.do(t, http.MethodPost, path, http.Header{"Content-Type": {"application/json; charset=utf-8"}}, []byte(`{"reason":"again"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "noop" {
		t.Fatalf("second replay: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodGet, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10), nil, nil)
	if m := r.json(t); m["last_replay_by"] != "tenant:ops" || m["last_replay_reason"] != "again" || m["replay_count"] != float64(1) {
		t.Fatalf("after replays: %s", r.body)
	}

	// Resolve: marked resolved without publishing, who/why recorded.
	resolve := "/v1/admin/dead-letters/" + strconv.FormatInt(otherID, 10) + "/resolve"
	r = b.do(t, http.MethodPost, resolve, jsonHeader, []byte(`{"reason":"input is broken, client told"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "resolved" || m["state"] != "resolved" || m["task_reopened"] != false {
		t.Fatalf("resolve: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodGet, "/v1/admin/dead-letters/"+strconv.FormatInt(otherID, 10), nil, nil)
	if m := r.json(t); m["state"] != "resolved" || m["last_replay_by"] != "tenant:ops" || m["last_replay_reason"] != "input is broken, client told" || m["last_replay_at"] == nil {
		t.Fatalf("after resolve: %s", r.body)
	}
	r = b.do(t, http.MethodPost, resolve, jsonHeader, []byte(`{"reason":"again"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "noop" || m["state"] != "resolved" {
		t.Fatalf("second resolve: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodPost, "/v1/admin/dead-letters/"+strconv.FormatInt(otherID, 10)+"/replay", jsonHeader, []byte(`{"reason":"replay"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "noop" {
		t.Fatalf("replay of a resolved dead letter: %d %s", r.status, r.body)
	}
}

// Bad input gets a problem+json 4xx with a stable code, never a 5xx.
func TestAdminDeadLettersBadInput(t *testing.T) {
	t.Parallel()
	b := adminSetup(t, true)
	id, _ := b.parkFailedTask(t, "CODE_A", 1)
	replay := "/v1/admin/dead-letters/" + strconv.FormatInt(id, 10) + "/replay"
	resolve := "/v1/admin/dead-letters/" + strconv.FormatInt(id, 10) + "/resolve"
	for _, tc := range []struct {
		name, method, path string
		header             http.Header
		body               string
		status             int
		code               string
	}{
		{"unknown id", http.MethodGet, "/v1/admin/dead-letters/999999", nil, "", 404, CodeDeadLetterNotFound},
		{"id not a number", http.MethodGet, "/v1/admin/dead-letters/abc", nil, "", 404, CodeDeadLetterNotFound},
		{"id zero", http.MethodGet, "/v1/admin/dead-letters/0", nil, "", 404, CodeDeadLetterNotFound},
		{"id negative", http.MethodGet, "/v1/admin/dead-letters/-3", nil, "", 404, CodeDeadLetterNotFound},
		{"id overflows", http.MethodGet, "/v1/admin/dead-letters/99999999999999999999", nil, "", 404, CodeDeadLetterNotFound},
		{"limit zero", http.MethodGet, "/v1/admin/dead-letters?limit=0", nil, "", 400, CodeInvalidAdminRequest},
		{"limit not a number", http.MethodGet, "/v1/admin/dead-letters?limit=ten", nil, "", 400, CodeInvalidAdminRequest},
		{"limit too large", http.MethodGet, "/v1/admin/dead-letters?limit=1001", nil, "", 400, CodeInvalidAdminRequest},
		{"unknown state", http.MethodGet, "/v1/admin/dead-letters?state=parked,lost", nil, "", 400, CodeInvalidAdminRequest},
		{"replay unknown id", http.MethodPost, "/v1/admin/dead-letters/999999/replay", jsonHeader, `{"reason":"x"}`, 404, CodeDeadLetterNotFound},
		{"replay bad id", http.MethodPost, "/v1/admin/dead-letters/x1/replay", jsonHeader, `{"reason":"x"}`, 404, CodeDeadLetterNotFound},
		{"malformed JSON", http.MethodPost, replay, jsonHeader, `{"reason":`, 400, CodeInvalidAdminRequest},
		{"not an object", http.MethodPost, replay, jsonHeader, `["x"]`, 400, CodeInvalidAdminRequest},
		{"reason not a string", http.MethodPost, replay, jsonHeader, `{"reason":5}`, 400, CodeInvalidAdminRequest},
		{"unknown member", http.MethodPost, replay, jsonHeader, `{"reason":"x","force":true}`, 400, CodeInvalidAdminRequest},
		{"trailing data", http.MethodPost, replay, jsonHeader, `{"reason":"x"} {}`, 400, CodeInvalidAdminRequest},
		{"empty body", http.MethodPost, replay, jsonHeader, ``, 400, CodeInvalidAdminRequest},
		{"missing reason", http.MethodPost, replay, jsonHeader, `{}`, 422, CodeReplayReasonRequired},
		{"blank reason", http.MethodPost, replay, jsonHeader, `{"reason":"   "}`, 422, CodeReplayReasonRequired},
		{"null body", http.MethodPost, replay, jsonHeader, `null`, 422, CodeReplayReasonRequired},
		{"wrong content type", http.MethodPost, replay, http.Header{"Content-Type": {"text/plain"}}, `{"reason":"x"}`, 415, CodeUnsupportedMediaType},
		{"no content type", http.MethodPost, replay, nil, `{"reason":"x"}`, 415, CodeUnsupportedMediaType},
		{"body too large", http.MethodPost, replay, jsonHeader, `{"reason":"` + strings.Repeat("x", 70<<10) + `"}`, 413, CodeBodyTooLarge},
		{"method not allowed", http.MethodDelete, "/v1/admin/dead-letters/1", nil, "", 405, CodeMethodNotAllowed},
		{"resolve unknown id", http.MethodPost, "/v1/admin/dead-letters/999999/resolve", jsonHeader, `{"reason":"x"}`, 404, CodeDeadLetterNotFound},
		{"resolve bad id", http.MethodPost, "/v1/admin/dead-letters/1x/resolve", jsonHeader, `{"reason":"x"}`, 404, CodeDeadLetterNotFound},
		{"resolve id overflows", http.MethodPost, "/v1/admin/dead-letters/99999999999999999999/resolve", jsonHeader, `{"reason":"x"}`, 404, CodeDeadLetterNotFound},
		{"resolve malformed JSON", http.MethodPost, resolve, jsonHeader, `{"reason"`, 400, CodeInvalidAdminRequest},
		{"resolve not an object", http.MethodPost, resolve, jsonHeader, `"x"`, 400, CodeInvalidAdminRequest},
		{"resolve with a by member (who acts is the credential's tenant)", http.MethodPost, resolve, jsonHeader, `{"reason":"x","by":"alice"}`, 400, CodeInvalidAdminRequest},
		{"resolve unknown member", http.MethodPost, resolve, jsonHeader, `{"reason":"x","state":"parked"}`, 400, CodeInvalidAdminRequest},
		{"resolve trailing data", http.MethodPost, resolve, jsonHeader, `{"reason":"x"}x`, 400, CodeInvalidAdminRequest},
		{"resolve empty body", http.MethodPost, resolve, jsonHeader, ``, 400, CodeInvalidAdminRequest},
		{"resolve missing reason", http.MethodPost, resolve, jsonHeader, `{}`, 422, CodeReplayReasonRequired},
		{"resolve blank reason", http.MethodPost, resolve, jsonHeader, `{"reason":"\t "}`, 422, CodeReplayReasonRequired},
		{"resolve null body", http.MethodPost, resolve, jsonHeader, `null`, 422, CodeReplayReasonRequired},
		{"resolve wrong content type", http.MethodPost, resolve, http.Header{"Content-Type": {"text/plain"}}, `{"reason":"x"}`, 415, CodeUnsupportedMediaType},
		{"resolve no content type", http.MethodPost, resolve, nil, `{"reason":"x"}`, 415, CodeUnsupportedMediaType},
		{"resolve body too large", http.MethodPost, resolve, jsonHeader, `{"reason":"` + strings.Repeat("x", 70<<10) + `"}`, 413, CodeBodyTooLarge},
		{"resolve with GET", http.MethodGet, resolve, nil, "", 405, CodeMethodNotAllowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body []byte
			if tc.body != "" {
				body = []byte(tc.body)
			}
			wantProblem(t, b.do(t, tc.method, tc.path, tc.header, body), tc.status, tc.code)
		})
	}
	// None of it touched the dead letter.
	r := b.do(t, http.MethodGet, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10), nil, nil)
	if m := r.json(t); m["state"] != "parked" || m["replay_count"] != float64(0) || m["last_replay_at"] != nil {
		t.Errorf("dead letter changed by bad requests: %s", r.body)
	}
}

// Without a dead-letter service the endpoints answer 503; with one but no
// Kafka producer, listing and showing work and a replay answers 503 saying
// why, without changing anything.
func TestAdminDeadLettersUnavailable(t *testing.T) {
	t.Parallel()
	none := setup(t)
	for _, req := range [][2]string{
		{http.MethodGet, "/v1/admin/dead-letters"},
		{http.MethodGet, "/v1/admin/dead-letters/1"},
		{http.MethodPost, "/v1/admin/dead-letters/1/replay"},
		{http.MethodPost, "/v1/admin/dead-letters/1/resolve"},
	} {
		wantProblem(t, none.do(t, req[0], req[1], jsonHeader, []byte(`{"reason":"x"}`)), 503, CodeDeadLettersUnavailable)
	}

	b := adminSetup(t, false)
	id, taskID := b.parkFailedTask(t, "CODE_A", 1)
	if r := b.do(t, http.MethodGet, "/v1/admin/dead-letters", nil, nil); r.status != http.StatusOK {
		t.Fatalf("list without Kafka: %d %s", r.status, r.body)
	}
	if r := b.do(t, http.MethodGet, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10), nil, nil); r.status != http.StatusOK {
		t.Fatalf("get without Kafka: %d %s", r.status, r.body)
	}
	r := b.do(t, http.MethodPost, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10)+"/replay", jsonHeader, []byte(`{"reason":"x"}`))
	wantProblem(t, r, 503, CodeDeadLettersUnavailable)
	if d := r.json(t)["detail"].(string); !strings.Contains(d, "CONVERGE_KAFKA_BROKERS") {
		t.Errorf("detail %q does not say what to configure", d)
	}
	var status string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT status FROM task WHERE task_id = $1`, taskID).Scan(&status); err != nil || status != "failed" {
		t.Errorf("task %s %v, want failed (untouched)", status, err)
	}
	// A resolve publishes nothing: it works without Kafka.
	r = b.do(t, http.MethodPost, "/v1/admin/dead-letters/"+strconv.FormatInt(id, 10)+"/resolve", jsonHeader, []byte(`{"reason":"obsolete"}`))
	if m := r.json(t); r.status != http.StatusOK || m["outcome"] != "resolved" {
		t.Fatalf("resolve without Kafka: %d %s", r.status, r.body)
	}
}
