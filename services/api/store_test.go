package api

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/taskevent"
)

// TestCreateTaskGuardsTheRecord: the second batch of the create
// transaction (record completion + task insert, task_input, outbox, COMMIT)
// commits nothing when the idempotency record it completes is not ours and
// in progress: the task is inserted only from the completed row, the
// task_input foreign key then fails, and PostgreSQL skips the pipelined
// COMMIT. The connection goes back to the pool usable.
func TestCreateTaskGuardsTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	s := &store{pool: b.db.Pool}
	k := createKey{Key: "guard-key-1", Fingerprint: strings.Repeat("a", 64), TTL: time.Hour, Lease: time.Minute}
	_, err := s.createTask(ctx, k, func(now time.Time) (*newTask, error) {
		n, err := buildTask(now, &createRequest{Document: []byte(`{"a":1}`), OutputFormat: OutputFormatJCS}, strings.Repeat("b", 64), 7)
		if err != nil {
			return nil, err
		}
		n.Task.TaskID = "guard-task"
		return n, nil
	})
	if err != nil {
		t.Fatalf("createTask: %v", err)
	}
	var state string
	if err := b.db.Pool.QueryRow(ctx, `SELECT state FROM idempotency_record WHERE idempotency_key = $1`, k.Key).Scan(&state); err != nil || state != stateSucceeded {
		t.Fatalf("record state %q, err %v; want succeeded", state, err)
	}

	// Now the guard: the record exists and is succeeded, so a second
	// completion with the same key must insert nothing and commit nothing.
	k2 := k
	k2.Fingerprint = strings.Repeat("c", 64) // not the record's fingerprint
	conn, err := b.db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	_, err = conn.Exec(ctx, sqlCompleteRecordInsertTask, createScope, k2.Key, "guard-task-2", `{}`, k2.Fingerprint,
		taskevent.StatusQueued, int64(0), 0, OutputFormatJCS, strings.Repeat("b", 64), int64(7), now, now)
	if err != nil {
		t.Fatalf("completion: %v", err)
	}
	if _, err := conn.Exec(ctx, sqlInsertTaskInput, "guard-task-2", []byte(`{}`)); err == nil {
		t.Fatal("task_input insert without a task: want a foreign key error")
	}
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	var tasks int
	if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM task WHERE task_id = 'guard-task-2'`).Scan(&tasks); err != nil || tasks != 0 {
		t.Fatalf("tasks = %d, err %v; want 0", tasks, err)
	}
}

// TestClientClosedIsNotAnOutage: a request ended by its own client's
// cancellation is 499 CLIENT_CLOSED_REQUEST (no 503, no error log that
// feeds the API error alert); the same error while the client still waits
// stays 503 DATABASE_UNAVAILABLE.
func TestClientClosedIsNotAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cause := fmt.Errorf("acquire connection: %w", context.Canceled)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := httptest.NewRecorder()
	b.srv.writeError(w, httptest.NewRequest(http.MethodPost, "/v1/tasks", nil).WithContext(ctx), cause)
	if w.Code != StatusClientClosedRequest || !strings.Contains(w.Body.String(), CodeClientClosedRequest) {
		t.Fatalf("client gone: status %d body %s, want 499 %s", w.Code, w.Body, CodeClientClosedRequest)
	}

	w = httptest.NewRecorder()
	b.srv.writeError(w, httptest.NewRequest(http.MethodPost, "/v1/tasks", nil), cause)
	if w.Code != http.StatusServiceUnavailable {
		t.Fatalf("client waiting: status %d, want 503", w.Code)
	}
}
