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

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// TestCreateTaskGuardsTheRecord: the create transaction inserts its
// idempotency record complete (migration 00016) before the task it points
// at; the record's foreign key is checked at COMMIT, so a transaction that
// records a task it does not create commits nothing. The completion of a
// record begun in_progress (a cancel's) still fails, committing nothing,
// when the record is not ours and in progress. The connection goes back to
// the pool usable.
func TestCreateTaskGuardsTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	s := &store{pool: b.db.Pool}
	k := idempotency.Key{Scope: tenant.CreateScope(b.tenant.ID), Key: "guard-key-1", Fingerprint: strings.Repeat("a", 64), TTL: time.Hour, Lease: time.Minute}
	d, err := newTaskDraft(b.tenant.ID, &createRequest{Document: []byte(`{"a":1}`), OutputFormat: OutputFormatJCS}, []byte(`{"a":1}`), strings.Repeat("b", 64))
	if err != nil {
		t.Fatal(err)
	}
	n, err := s.createTask(ctx, k, tenant.Principal{TenantID: b.tenant.ID}, d)
	if err != nil {
		t.Fatalf("createTask: %v", err)
	}
	rec, err := idempotency.Get(ctx, b.db.Pool, k.Scope, k.Key)
	if err != nil || rec.State != idempotency.Succeeded || rec.TaskID == nil || *rec.TaskID != n.Task.TaskID || *rec.TaskID != d.TaskID ||
		rec.ResponseStatus == nil || *rec.ResponseStatus != http.StatusAccepted || string(rec.ResponseBody) == "" {
		t.Fatalf("record %+v, err %v; want succeeded with task %s and a 202 body", rec, err, d.TaskID)
	}

	run := func(queue func(b *pgx.Batch)) error {
		conn, err := b.db.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		var batch pgx.Batch
		batch.Queue("BEGIN")
		queue(&batch)
		dbpool.QueueCommit(&batch)
		err = conn.SendBatch(ctx, &batch).Close()
		if _, rerr := conn.Exec(ctx, "ROLLBACK"); rerr != nil {
			t.Fatal(rerr)
		}
		return err
	}
	// A record of a task that is never inserted: refused at COMMIT.
	k2 := k
	k2.Key = "guard-key-2"
	var created time.Time
	err = run(func(batch *pgx.Batch) {
		idempotency.QueueInsertSucceeded(batch, k2, "guard-no-such-task", d.Response, &created)
	})
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "23503" {
		t.Fatalf("record of a task never inserted: %v, want SQLSTATE 23503 at COMMIT", err)
	}
	if _, err := idempotency.Get(ctx, b.db.Pool, k2.Scope, k2.Key); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("record of the refused transaction: %v, want none", err)
	}

	// The completion guard: a record that is not in progress with this
	// fingerprint (here: the succeeded record of the first create).
	k3 := k
	k3.Fingerprint = strings.Repeat("c", 64) // not the record's fingerprint
	n3, err := d.build(time.Now().UTC())
	if err != nil {
		t.Fatal(err)
	}
	n3.Task.TaskID = "guard-task-2"
	err = run(func(batch *pgx.Batch) {
		task.QueueCreate(batch, n3.Task, k3.Fingerprint, n3.Document)
		idempotency.QueueCompleteWith(batch, k3, n3.Task.TaskID, http.StatusAccepted, n3.Response)
	})
	if !errors.As(err, &pe) || pe.Code != "22012" {
		t.Fatalf("completion of a record that is not ours: %v, want SQLSTATE 22012", err)
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
