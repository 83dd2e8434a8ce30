package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/tenant"

	"github.com/google/uuid"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/testenv"
)

// runAPI runs `converge api` in process on free ports until the test ends
// and returns the base URL of its admin plane (the public API is on
// c.HTTPAddr).
func runAPI(t *testing.T, c APICmd) string {
	t.Helper()
	c.HTTPAddr = "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	c.AdminAddr = "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	c.ArtifactDir = t.TempDir()
	c.MaxBodyBytes = 1 << 20
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(&runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("converge api did not stop")
		}
	})
	base := "http://" + c.AdminAddr
	testenv.Eventually(t, 20*time.Second, "converge api serves", func() bool {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return base
}

func parkDeadLetter(t *testing.T, db *testenv.DB) int64 {
	t.Helper()
	ctx := context.Background()
	msg, now := uuid.NewString(), time.Now().UTC()
	d := deadletter.DeadLetter{OriginTopic: "converge.task-events.v1", ConsumerGroup: "converge-worker", Key: []byte("k"), Value: []byte(`{}`),
		Headers: []deadletter.Header{}, MessageID: &msg, ErrorClass: "deterministic", ErrorCode: "X", Attempts: 1, ProcessorVersion: "t",
		FirstFailureAt: now, LastFailureAt: now}
	if _, err := deadletter.NewStore(db.Pool).Insert(ctx, d); err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := db.Pool.QueryRow(ctx, `SELECT dead_letter_id FROM dead_letter`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// adminToken adds an admin tenant to db and returns its token.
func adminToken(t *testing.T, db *testenv.DB) string {
	t.Helper()
	_, tok, err := tenant.Add(context.Background(), db.Pool, "ops", true, nil)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func replay(t *testing.T, base, token string, id int64) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/admin/dead-letters/"+strconv.FormatInt(id, 10)+"/replay", strings.NewReader(`{"reason":"fixed"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, m
}

// `converge api` run alone serves the dead-letter admin endpoints: with
// Kafka brokers a replay re-publishes; without them listing works and a
// replay answers 503 saying what is missing.
func TestAPICommandServesDeadLetters(t *testing.T) {
	t.Parallel()
	t.Run("with brokers", func(t *testing.T) {
		t.Parallel()
		db, kafka := testenv.NewDB(t), testenv.NewKafka(t)
		id, tok := parkDeadLetter(t, db), adminToken(t, db)
		base := runAPI(t, APICmd{Services: Services{DatabaseURL: db.URL, KafkaBrokers: kafka.Brokers}, MaxReplays: 3})
		if st, m := replay(t, base, tok, id); st != http.StatusOK || m["outcome"] != deadletter.OutcomeReplayed {
			t.Fatalf("replay: %d %v", st, m)
		}
	})
	t.Run("without brokers", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		id, tok := parkDeadLetter(t, db), adminToken(t, db)
		base := runAPI(t, APICmd{Services: Services{DatabaseURL: db.URL}, MaxReplays: 3})
		req, _ := http.NewRequest(http.MethodGet, base+"/v1/admin/dead-letters", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("list: %d", resp.StatusCode)
		}
		st, m := replay(t, base, tok, id)
		if st != http.StatusServiceUnavailable || m["code"] != "DEAD_LETTERS_UNAVAILABLE" || !strings.Contains(m["detail"].(string), "CONVERGE_KAFKA_BROKERS") {
			t.Fatalf("replay without brokers: %d %v", st, m)
		}
	})
}

// `converge relay` whose publication does not cover the outbox keeps
// running: GET /readyz answers 503 with the ALTER PUBLICATION to run, the
// mismatch gauge is 1, /healthz stays 200; once the publication is fixed
// /readyz answers 200 (issue 13).
func TestRelayCommandReportsPublicationMismatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, kafka := testenv.NewDB(t), testenv.NewKafka(t)
	pub := "p_" + db.Name
	if _, err := db.Pool.Exec(ctx, "CREATE PUBLICATION "+pub+" FOR TABLE task"); err != nil {
		t.Fatal(err)
	}
	c := RelayCmd{Services: Services{DatabaseURL: db.URL, KafkaBrokers: kafka.Brokers},
		Pipeline:    Pipeline{Topic: kafka.Topic, TopicPartitions: testenv.Partitions, SlotName: "s_" + db.Name, PublicationName: pub},
		MetricsAddr: MetricsAddr{MetricsAddr: "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))}, HeartbeatInterval: time.Second}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(&runEnv{ctx: rctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("converge relay: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("converge relay did not stop")
		}
	})
	base := "http://" + c.MetricsAddr.MetricsAddr
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	testenv.Eventually(t, 20*time.Second, "relay reports the mismatch", func() bool {
		st, _ := get("/readyz")
		return st == http.StatusServiceUnavailable
	})
	if _, body := get("/readyz"); !strings.Contains(body, "ALTER PUBLICATION "+pub+" ADD TABLE public.outbox_event") {
		t.Fatalf("/readyz body %q does not name the fix", body)
	}
	if st, _ := get("/healthz"); st != http.StatusOK {
		t.Fatalf("/healthz = %d while mismatched; the process is alive", st)
	}
	if _, body := get("/metrics"); !strings.Contains(body, `converge_relay_publication_mismatch{reason="not_covered"} 1`) {
		t.Fatal("/metrics lacks converge_relay_publication_mismatch{reason=\"not_covered\"} 1")
	}
	if _, err := db.Pool.Exec(ctx, "ALTER PUBLICATION "+pub+" ADD TABLE public.outbox_event"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "relay ready after the fix", func() bool {
		st, body := get("/readyz")
		return st == http.StatusOK && body == "ok\n"
	})
}
