package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/internal/testenv"
)

// Issue 9, reproduced as reported: with a synchronous standby that does not
// confirm, a create's COMMIT waits after its commit record is flushed; the
// relay streams the TaskCreated event, Kafka acknowledges it and the worker
// receives it while no other session sees the task. The worker must wait for
// the task instead of dead-lettering it as TASK_NOT_FOUND (which failed the
// task once the dead-letter transaction could see it), and the relay must
// not lose the rows' publication (its per-row UPDATE, before migration
// 00015, could not see them and left published_at NULL for good). Once the
// commit is visible, the task completes and every outbox row reads as
// published.
func TestEventBeforeItsCommitIsVisible(t *testing.T) {
	t.Parallel()
	h := testenv.NewCommitHold(t)
	reg := prometheus.NewRegistry()
	b := setupOn(t, h.DB, func(cfg *pipeline.Config) {
		cfg.Registry = reg
		cfg.Worker.VisibilityTimeout = time.Minute
		// Held commits hold every writing transaction: no heartbeat
		// transactions meanwhile.
		cfg.HeartbeatInterval = -1
	})
	// The pipeline works before the hold; nothing is left to write when
	// the hold starts, so only the create's commit is held.
	warm := postTask(t, b, "visibility-warm-up", `{"document":{"warm":true}}`)
	testenv.Eventually(t, 30*time.Second, "warm-up task completed and its events marked", func() bool {
		return taskStatus(t, b, warm) == "completed" && unpublished(t, b) == 0
	})

	h.Hold(t)
	created := make(chan string, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, b.baseURL+"/v1/tasks", strings.NewReader(`{"document":{"held":true}}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "visibility-held")
		req.Header.Set("Authorization", "Bearer "+b.token)
		var out struct {
			TaskID string `json:"task_id"`
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusAccepted || json.NewDecoder(resp.Body).Decode(&out) != nil {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		if err != nil {
			t.Errorf("held create: %v", err)
		}
		created <- out.TaskID
	}()
	testenv.Eventually(t, 30*time.Second, "worker retrying the task it cannot see yet", func() bool {
		return testenv.MetricSum(t, reg, "converge_worker_messages_total", map[string]string{"outcome": "retried"}) >= 3
	})
	if n := testenv.MetricSum(t, reg, "converge_worker_messages_total", map[string]string{"outcome": "dead_lettered"}); n != 0 {
		t.Fatalf("dead_lettered = %v while the commit is held", n)
	}

	h.Release(t)
	var id string
	select {
	case id = <-created:
	case <-time.After(30 * time.Second):
		t.Fatal("held create did not answer after Release")
	}
	testenv.Eventually(t, 30*time.Second, "held task completed", func() bool { return taskStatus(t, b, id) == "completed" })
	testenv.Eventually(t, 30*time.Second, "every outbox row marked published", func() bool { return unpublished(t, b) == 0 })
	if n := testenv.MetricSum(t, reg, "converge_worker_messages_total", map[string]string{"outcome": "dead_lettered"}); n != 0 {
		t.Fatalf("dead_lettered = %v, want 0", n)
	}
}

func unpublished(t *testing.T, b *bundle) int {
	t.Helper()
	var n int
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func postTask(t *testing.T, b *bundle, key, body string) string {
	t.Helper()
	resp, rb := b.post(t, key, []byte(body))
	var out struct {
		TaskID string `json:"task_id"`
	}
	if resp.StatusCode != http.StatusAccepted || json.Unmarshal(rb, &out) != nil {
		t.Fatalf("create %s: %d %s", key, resp.StatusCode, rb)
	}
	return out.TaskID
}

func taskStatus(t *testing.T, b *bundle, id string) string {
	t.Helper()
	var status string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT status FROM task WHERE task_id = $1`, id).Scan(&status); err != nil {
		return ""
	}
	return status
}
