package api

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// outboxSetup starts a Server whose outbox republications go to producer
// (none when nil).
func outboxSetup(t *testing.T, producer *kgo.Client) *testBundle {
	t.Helper()
	return setup(t, func(c *Config) { c.OutboxProducer = producer })
}

// parkOutboxRow writes a TaskCreated outbox row of a new task (of tenant
// "tenant-x") and parks it with code, as the relay does for a record the
// broker refuses; it returns the outbox id and the task id.
func (b *testBundle) parkOutboxRow(t *testing.T, code string) (string, string) {
	t.Helper()
	ctx := context.Background()
	id, taskID := b.outboxRow(t)
	if ok, err := outbox.Park(ctx, b.db.Pool, id, code, "refused by the broker"); err != nil || !ok {
		t.Fatalf("Park = %v, %v", ok, err)
	}
	return id, taskID
}

// outboxRow writes a TaskCreated outbox row of a new task, unpublished and
// not parked.
func (b *testBundle) outboxRow(t *testing.T) (string, string) {
	t.Helper()
	now := time.Now().UTC()
	taskID := "task-" + uuid.NewString()
	ev, err := outbox.NewEvent(taskevent.TypeTaskCreated, taskevent.Task{TaskID: taskID, TenantID: "tenant-x", Status: taskevent.StatusQueued,
		Version: 1, OutputFormat: "jcs", InputSHA256: strings.Repeat("0", 64), InputSize: 2, CreatedAt: now, UpdatedAt: now}, now)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := outbox.InsertOnce(context.Background(), b.db.Pool, &ev); err != nil || !ok {
		t.Fatalf("InsertOnce = %v, %v", ok, err)
	}
	return ev.EventID, taskID
}

func (b *testBundle) outboxState(t *testing.T, id string) outbox.Stored {
	t.Helper()
	s, err := outbox.Get(context.Background(), b.db.Pool, id)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// readOne returns the first record of the task-events topic of kafka.
func readOne(t *testing.T, kafka *testenv.Kafka) *kgo.Record {
	t.Helper()
	cl := kafka.Client(t, kgo.ConsumeTopics(kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		var got *kgo.Record
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			if got == nil {
				got = r
			}
		})
		if got != nil {
			return got
		}
	}
	t.Fatal("no record in the topic")
	return nil
}

func listed(t *testing.T, r *response) []string {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("list: %d %s", r.status, r.body)
	}
	var ids []string
	for _, v := range r.json(t)["outbox_rows"].([]any) {
		ids = append(ids, v.(map[string]any)["outbox_id"].(string))
	}
	return ids
}

// The parked-row endpoints (issue 13): list and show; republish produces
// the row's original record (key, value, headers, event id) and records
// who (the admin credential's tenant), when and why; discard records the
// same and publishes nothing; a decision is taken once; a row that is not
// parked has nothing to decide; a non-admin tenant is refused and changes
// nothing.
func TestAdminOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	b := outboxSetup(t, kafka.Client(t, kgo.RequiredAcks(kgo.AllISRAcks())))
	rep, repTask := b.parkOutboxRow(t, "MESSAGE_TOO_LARGE")
	dis, _ := b.parkOutboxRow(t, "INVALID_RECORD")
	live, _ := b.outboxRow(t)

	// A non-admin tenant is refused everywhere, before anything is read.
	for _, req := range [][2]string{
		{http.MethodGet, "/v1/admin/outbox/parked"},
		{http.MethodGet, "/v1/admin/outbox/" + rep},
		{http.MethodPost, "/v1/admin/outbox/" + rep + "/republish"},
		{http.MethodPost, "/v1/admin/outbox/" + rep + "/discard"},
	} {
		h := bearer(b.token)
		h.Set("Content-Type", "application/json")
		wantProblem(t, b.do(t, req[0], req[1], h, []byte(`{"reason":"x"}`)), http.StatusForbidden, CodeForbidden)
	}

	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked", nil, nil)); len(got) != 2 || got[0] != rep || got[1] != dis {
		t.Fatalf("list = %v, want %s, %s (oldest park first)", got, rep, dis)
	}
	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked?code=INVALID_RECORD", nil, nil)); len(got) != 1 || got[0] != dis {
		t.Fatalf("list by code = %v, want %s", got, dis)
	}
	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked?limit=1", nil, nil)); len(got) != 1 || got[0] != rep {
		t.Fatalf("list limit 1 = %v, want %s", got, rep)
	}
	r := b.do(t, http.MethodGet, "/v1/admin/outbox/"+rep, nil, nil)
	if m := r.json(t); r.status != http.StatusOK || r.header.Get("Cache-Control") != "no-store" || m["outbox_id"] != rep || m["aggregate_id"] != repTask ||
		m["last_error_code"] != "MESSAGE_TOO_LARGE" || m["parked_at"] == nil || m["published_at"] != nil || m["decision"] != nil {
		t.Fatalf("show: %d %s", r.status, r.body)
	}
	if m := b.do(t, http.MethodGet, "/v1/admin/outbox/"+live, nil, nil).json(t); m["outbox_id"] != live || m["parked_at"] != nil {
		t.Fatalf("show of a row that is not parked: %v", m)
	}

	r = b.do(t, http.MethodPost, "/v1/admin/outbox/"+rep+"/republish", jsonHeader, []byte(`{"reason":"broker limit raised"}`))
	if m := r.json(t); r.status != http.StatusOK || m["decision"] != outbox.DecisionRepublished || m["decided_by"] != "tenant:ops" ||
		m["decision_reason"] != "broker limit raised" || m["decided_at"] == nil || m["published_at"] == nil || m["publish_attempts"] != float64(2) {
		t.Fatalf("republish: %d %s", r.status, r.body)
	}
	s := b.outboxState(t, rep)
	got := readOne(t, kafka)
	if string(got.Key) != repTask || string(got.Value) != string(s.Payload) {
		t.Fatalf("republished record key %q value %q; want the row's task id and payload", got.Key, got.Value)
	}
	headers := map[string]string{}
	for _, h := range got.Headers {
		headers[h.Key] = string(h.Value)
	}
	for _, h := range taskevent.Headers(rep, taskevent.TypeTaskCreated, 1, s.PayloadSHA256, "tenant-x") {
		if headers[h[0]] != h[1] {
			t.Errorf("republished record header %s = %q, want %q (the relay's)", h[0], headers[h[0]], h[1])
		}
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/outbox/"+rep+"/republish", jsonHeader, []byte(`{"reason":"again"}`)),
		http.StatusConflict, CodeOutboxRowAlreadyDecided)
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/outbox/"+rep+"/discard", jsonHeader, []byte(`{"reason":"again"}`)),
		http.StatusConflict, CodeOutboxRowAlreadyDecided)

	r = b.do(t, http.MethodPost, "/v1/admin/outbox/"+dis+"/discard", jsonHeader, []byte(`{"reason":"test event, never needed"}`))
	if m := r.json(t); r.status != http.StatusOK || m["decision"] != outbox.DecisionDiscarded || m["decided_by"] != "tenant:ops" ||
		m["decision_reason"] != "test event, never needed" || m["published_at"] != nil {
		t.Fatalf("discard: %d %s", r.status, r.body)
	}
	r = b.do(t, http.MethodPost, "/v1/admin/outbox/"+dis+"/discard", jsonHeader, []byte(`{"reason":"again"}`))
	wantProblem(t, r, http.StatusConflict, CodeOutboxRowAlreadyDecided)
	if d := r.json(t)["detail"].(string); !strings.Contains(d, "discarded by tenant:ops") {
		t.Errorf("detail %q does not say who decided", d)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/outbox/"+dis+"/republish", jsonHeader, []byte(`{"reason":"again"}`)),
		http.StatusConflict, CodeOutboxRowAlreadyDecided)

	for _, action := range []string{"republish", "discard"} {
		wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/outbox/"+live+"/"+action, jsonHeader, []byte(`{"reason":"x"}`)),
			http.StatusConflict, CodeOutboxRowNotParked)
	}
	if s := b.outboxState(t, live); s.ParkedAt != nil || s.Decision != "" || s.PublishedAt != nil {
		t.Fatalf("row that is not parked changed: %+v", s)
	}

	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked", nil, nil)); len(got) != 0 {
		t.Fatalf("undecided after both decisions = %v, want none", got)
	}
	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked?all=true", nil, nil)); len(got) != 2 {
		t.Fatalf("all = %v, want both rows", got)
	}
	var n int
	if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE decided_by LIKE 'tenant:team-a%'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows decided by the non-admin tenant (%v)", n, err)
	}
}

// Bad input gets a problem+json 4xx with a stable code and changes nothing.
func TestAdminOutboxBadInput(t *testing.T) {
	t.Parallel()
	kafka := testenv.NewKafka(t)
	b := outboxSetup(t, kafka.Client(t))
	id, _ := b.parkOutboxRow(t, "MESSAGE_TOO_LARGE")
	republish := "/v1/admin/outbox/" + id + "/republish"
	discard := "/v1/admin/outbox/" + id + "/discard"
	long := strings.Repeat("x", 256)
	type req struct {
		name, method, path string
		header             http.Header
		body               string
		status             int
		code               string
	}
	cases := []req{
		{"unknown id", http.MethodGet, "/v1/admin/outbox/no-such-row", nil, "", 404, CodeOutboxRowNotFound},
		{"id too long", http.MethodGet, "/v1/admin/outbox/" + long, nil, "", 404, CodeOutboxRowNotFound},
		{"id not UTF-8", http.MethodGet, "/v1/admin/outbox/%FF%FE", nil, "", 404, CodeOutboxRowNotFound},
		{"id with NUL", http.MethodGet, "/v1/admin/outbox/a%00b", nil, "", 404, CodeOutboxRowNotFound},
		{"limit zero", http.MethodGet, "/v1/admin/outbox/parked?limit=0", nil, "", 400, CodeInvalidAdminRequest},
		{"limit not a number", http.MethodGet, "/v1/admin/outbox/parked?limit=ten", nil, "", 400, CodeInvalidAdminRequest},
		{"limit too large", http.MethodGet, "/v1/admin/outbox/parked?limit=1001", nil, "", 400, CodeInvalidAdminRequest},
		{"all not a boolean", http.MethodGet, "/v1/admin/outbox/parked?all=yes", nil, "", 400, CodeInvalidAdminRequest},
		{"list with POST", http.MethodPost, "/v1/admin/outbox/parked", jsonHeader, `{}`, 405, CodeMethodNotAllowed},
		{"show with DELETE", http.MethodDelete, "/v1/admin/outbox/" + id, nil, "", 405, CodeMethodNotAllowed},
	}
	for _, action := range []string{"republish", "discard"} {
		path := republish
		if action == "discard" {
			path = discard
		}
		cases = append(cases,
			req{action + " unknown id", http.MethodPost, "/v1/admin/outbox/no-such-row/" + action, jsonHeader, `{"reason":"x"}`, 404, CodeOutboxRowNotFound},
			req{action + " id with NUL", http.MethodPost, "/v1/admin/outbox/%00/" + action, jsonHeader, `{"reason":"x"}`, 404, CodeOutboxRowNotFound},
			req{action + " id not UTF-8", http.MethodPost, "/v1/admin/outbox/" + url.PathEscape("\xff") + "/" + action, jsonHeader, `{"reason":"x"}`, 404, CodeOutboxRowNotFound},
			req{action + " missing reason", http.MethodPost, path, jsonHeader, `{}`, 422, CodeOutboxReasonRequired},
			req{action + " blank reason", http.MethodPost, path, jsonHeader, `{"reason":" \t"}`, 422, CodeOutboxReasonRequired},
			req{action + " null body", http.MethodPost, path, jsonHeader, `null`, 422, CodeOutboxReasonRequired},
			req{action + " malformed JSON", http.MethodPost, path, jsonHeader, `{"reason":`, 400, CodeInvalidAdminRequest},
			req{action + " empty body", http.MethodPost, path, jsonHeader, ``, 400, CodeInvalidAdminRequest},
			req{action + " reason not a string", http.MethodPost, path, jsonHeader, `{"reason":5}`, 400, CodeInvalidAdminRequest},
			req{action + " with a by member (who acts is the credential's tenant)", http.MethodPost, path, jsonHeader, `{"reason":"x","by":"alice"}`, 400, CodeInvalidAdminRequest},
			req{action + " trailing data", http.MethodPost, path, jsonHeader, `{"reason":"x"} {}`, 400, CodeInvalidAdminRequest},
			req{action + " wrong content type", http.MethodPost, path, http.Header{"Content-Type": {"text/plain"}}, `{"reason":"x"}`, 415, CodeUnsupportedMediaType},
			req{action + " body too large", http.MethodPost, path, jsonHeader, `{"reason":"` + strings.Repeat("x", 70<<10) + `"}`, 413, CodeBodyTooLarge},
			req{action + " with GET", http.MethodGet, path, nil, "", 405, CodeMethodNotAllowed},
		)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var body []byte
			if tc.body != "" {
				body = []byte(tc.body)
			}
			wantProblem(t, b.do(t, tc.method, tc.path, tc.header, body), tc.status, tc.code)
		})
	}
	if s := b.outboxState(t, id); s.Decision != "" || s.PublishedAt != nil || s.Attempts != 1 {
		t.Errorf("parked row changed by bad requests: %+v", s)
	}
}

// Without a Kafka producer listing, showing and discarding work and a
// republish answers 503 saying what to configure, changing nothing (a
// blank reason is refused first, as for dead letters).
func TestAdminOutboxNoProducer(t *testing.T) {
	t.Parallel()
	b := outboxSetup(t, nil)
	id, _ := b.parkOutboxRow(t, "MESSAGE_TOO_LARGE")
	other, _ := b.parkOutboxRow(t, "MESSAGE_TOO_LARGE")
	if got := listed(t, b.do(t, http.MethodGet, "/v1/admin/outbox/parked", nil, nil)); len(got) != 2 {
		t.Fatalf("list without Kafka = %v", got)
	}
	if r := b.do(t, http.MethodGet, "/v1/admin/outbox/"+id, nil, nil); r.status != http.StatusOK {
		t.Fatalf("show without Kafka: %d %s", r.status, r.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/v1/admin/outbox/"+id+"/republish", jsonHeader, []byte(`{"reason":""}`)), 422, CodeOutboxReasonRequired)
	r := b.do(t, http.MethodPost, "/v1/admin/outbox/"+id+"/republish", jsonHeader, []byte(`{"reason":"x"}`))
	wantProblem(t, r, 503, CodeOutboxRepublishUnavailable)
	if r.header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if d := r.json(t)["detail"].(string); !strings.Contains(d, "CONVERGE_KAFKA_BROKERS") {
		t.Errorf("detail %q does not say what to configure", d)
	}
	if s := b.outboxState(t, id); s.Decision != "" || s.PublishedAt != nil || s.Attempts != 1 || s.ParkedAt == nil {
		t.Fatalf("row changed by a republish without a producer: %+v", s)
	}
	if r := b.do(t, http.MethodPost, "/v1/admin/outbox/"+other+"/discard", jsonHeader, []byte(`{"reason":"obsolete"}`)); r.status != http.StatusOK {
		t.Fatalf("discard without Kafka: %d %s", r.status, r.body)
	}
}

// A record the producer refuses is not republished: over the 1 MiB limit
// it is 422 OUTBOX_RECORD_TOO_LARGE (only a discard helps), a broker that
// does not answer is 503 OUTBOX_REPUBLISH_FAILED (ask again); either way
// the attempt is recorded on the row, which stays parked and undecided.
func TestAdminOutboxRepublishRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	b := outboxSetup(t, kafka.Client(t))
	big := "big-" + uuid.NewString()
	payload := `{"x":"` + strings.Repeat("a", 1<<20+100) + `"}`
	sum := sha256.Sum256([]byte(payload))
	if _, err := b.db.Pool.Exec(ctx, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $1, 1, 'TaskCreated', $2, $3)`, big, payload, hex.EncodeToString(sum[:])); err != nil {
		t.Fatal(err)
	}
	if ok, err := outbox.Park(ctx, b.db.Pool, big, "INVALID_ROW", "parked for another reason"); err != nil || !ok {
		t.Fatalf("Park = %v, %v", ok, err)
	}
	r := b.do(t, http.MethodPost, "/v1/admin/outbox/"+big+"/republish", jsonHeader, []byte(`{"reason":"try"}`))
	wantProblem(t, r, http.StatusUnprocessableEntity, CodeOutboxRecordTooLarge)
	if s := b.outboxState(t, big); s.Decision != "" || s.PublishedAt != nil || s.ParkedAt == nil || s.Attempts != 2 || s.LastErrorCode != "MESSAGE_TOO_LARGE" {
		t.Fatalf("too-large row after the refused republish: %+v", s)
	}
	if r := b.do(t, http.MethodPost, "/v1/admin/outbox/"+big+"/discard", jsonHeader, []byte(`{"reason":"over the limit"}`)); r.status != http.StatusOK {
		t.Fatalf("discard of the too-large row: %d %s", r.status, r.body)
	}

	// No broker answers: the delivery timeout ends the produce.
	down := setup(t, func(c *Config) {
		cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"), kgo.RecordDeliveryTimeout(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		c.OutboxProducer = cl
	})
	id, _ := down.parkOutboxRow(t, "INVALID_RECORD")
	r = down.do(t, http.MethodPost, "/v1/admin/outbox/"+id+"/republish", jsonHeader, []byte(`{"reason":"broker fixed"}`))
	wantProblem(t, r, http.StatusServiceUnavailable, CodeOutboxRepublishFailed)
	if s := down.outboxState(t, id); s.Decision != "" || s.PublishedAt != nil || s.ParkedAt == nil || s.Attempts != 2 || s.LastErrorCode != "DELIVERY_TIMEOUT" {
		t.Fatalf("row after the unacknowledged republish: %+v", s)
	}
}
