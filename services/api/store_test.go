package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// TestCreateTaskGuardsTheRecord: the second batch of the create
// transaction (task and task_input inserts, outbox insert, record
// completion, COMMIT) commits nothing when the idempotency record it
// completes is not ours and in progress: the completion fails (division by
// zero) and PostgreSQL skips the pipelined COMMIT. The connection goes back
// to the pool usable.
func TestCreateTaskGuardsTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	s := &store{pool: b.db.Pool}
	k := idempotency.Key{Scope: tenant.CreateScope(b.tenant.ID), Key: "guard-key-1", Fingerprint: strings.Repeat("a", 64), TTL: time.Hour, Lease: time.Minute}
	build := func(id string) func(now time.Time) (*newTask, error) {
		return func(now time.Time) (*newTask, error) {
			n, err := buildTask(now, b.tenant.ID, &createRequest{Document: []byte(`{"a":1}`), OutputFormat: OutputFormatJCS}, strings.Repeat("b", 64), 7)
			if err != nil {
				return nil, err
			}
			n.Task.TaskID = id
			return n, nil
		}
	}
	if _, err := s.createTask(ctx, k, tenant.Principal{TenantID: b.tenant.ID}, build("guard-task")); err != nil {
		t.Fatalf("createTask: %v", err)
	}
	var state string
	if err := b.db.Pool.QueryRow(ctx, `SELECT state FROM idempotency_record WHERE idempotency_key = $1`, k.Key).Scan(&state); err != nil || state != string(idempotency.Succeeded) {
		t.Fatalf("record state %q, err %v; want succeeded", state, err)
	}

	// Now the guard: a create batch whose record is not in progress with
	// its fingerprint (here: the record of another key's first use, already
	// succeeded) must insert nothing and commit nothing.
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
	n, err := build("guard-task-2")(time.Now().UTC())
	if err != nil {
		t.Fatal(err)
	}
	var batch pgx.Batch
	task.QueueCreate(&batch, n.Task, k2.Fingerprint, n.Document)
	idempotency.QueueComplete(&batch, k2, n.Task.TaskID, n.Response)
	batch.Queue("COMMIT")
	err = conn.SendBatch(ctx, &batch).Close()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "22012" {
		t.Fatalf("completion of a record that is not ours: %v, want SQLSTATE 22012", err)
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
