package api

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// cancel sends POST /v1/tasks/{id}/cancel with If-Match (none when
// ifMatch is "") and the key (none when "").
func (b *testBundle) cancel(t *testing.T, id, ifMatch, key string) *response {
	t.Helper()
	h := http.Header{}
	if ifMatch != "" {
		h.Set("If-Match", ifMatch)
	}
	if key != "" {
		h.Set("Idempotency-Key", key)
	}
	return b.do(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", h, nil)
}

func (b *testBundle) createQueued(t *testing.T, key, doc string) string {
	t.Helper()
	r := b.post(t, key, wrap(doc))
	if r.status != http.StatusAccepted {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	return r.json(t)["task_id"].(string)
}

// The cancel contract: queued at the If-Match version -> cancelled (v+1),
// a TaskCancelled outbox row, 200 with the task and its new ETag; the same
// key replays the answer; the same key for another version is 422; a stale
// version is 412 with the current one; a cancelled or running task is 409
// with its status; If-Match and the key are required; another tenant's task
// is 404; a refused cancel writes nothing.
func TestCancel(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	id := b.createQueued(t, "cancel-create-1", `{"cancel":1}`)

	wantProblem(t, b.cancel(t, id, "", "cancel-key-1"), http.StatusPreconditionRequired, CodePreconditionRequired)
	wantProblem(t, b.cancel(t, id, "0", "cancel-key-1"), http.StatusBadRequest, CodeIfMatchInvalid)
	for _, bad := range []string{`W/"0"`, `"00"`, `"+0"`, `"-1"`, `*`, `"0", "1"`, `"99999999999999999999"`} {
		wantProblem(t, b.cancel(t, id, bad, "cancel-key-1"), http.StatusBadRequest, CodeIfMatchInvalid)
	}
	// An admin reads every task but cancels only its own tenant's.
	ah := bearer(b.adminToken)
	ah.Set("If-Match", `"0"`)
	ah.Set("Idempotency-Key", "cancel-admin-1")
	wantProblem(t, b.do(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", ah, nil), http.StatusNotFound, CodeTaskNotFound)
	wantProblem(t, b.cancel(t, id, `"0"`, ""), http.StatusBadRequest, CodeIdempotencyKeyMissing)
	_, other := b.addTenant(t, "team-b", false, nil)
	h := bearer(other)
	h.Set("If-Match", `"0"`)
	h.Set("Idempotency-Key", "cancel-key-1")
	wantProblem(t, b.do(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", h, nil), http.StatusNotFound, CodeTaskNotFound)
	if n := b.count(t, "outbox_event WHERE event_type = 'TaskCancelled'"); n != 0 {
		t.Fatalf("%d TaskCancelled rows from refused cancels", n)
	}

	r := b.cancel(t, id, `"0"`, "cancel-key-1")
	if r.status != http.StatusOK || r.header.Get("ETag") != `"1"` {
		t.Fatalf("cancel: %d %s (ETag %q)", r.status, r.body, r.header.Get("ETag"))
	}
	if m := r.json(t); m["status"] != taskevent.StatusCancelled || m["version"] != float64(1) {
		t.Fatalf("cancel body %s", r.body)
	}
	testenv.RequireTaskStatus(t, b.db.Pool, id, taskevent.StatusCancelled)
	if n := b.count(t, "outbox_event WHERE event_type = 'TaskCancelled'"); n != 1 {
		t.Fatalf("%d TaskCancelled rows, want 1", n)
	}
	again := b.cancel(t, id, `"0"`, "cancel-key-1")
	if again.status != http.StatusOK || again.header.Get("Idempotent-Replayed") != "true" || string(again.body) != string(r.body) {
		t.Errorf("repeat with the same key: %d %q %s, want the first answer replayed", again.status, again.header.Get("Idempotent-Replayed"), again.body)
	}
	wantProblem(t, b.cancel(t, id, `"1"`, "cancel-key-1"), http.StatusUnprocessableEntity, CodeIdempotencyKeyReused)
	p := b.cancel(t, id, `"0"`, "cancel-key-2")
	wantProblem(t, p, http.StatusPreconditionFailed, CodeVersionMismatch)
	if p.json(t)["current_version"] != float64(1) {
		t.Errorf("412 without the current version: %s", p.body)
	}
	c := b.cancel(t, id, `"1"`, "cancel-key-3")
	wantProblem(t, c, http.StatusConflict, CodeTaskNotCancellable)
	if c.json(t)["task_status"] != taskevent.StatusCancelled {
		t.Errorf("409 without the status: %s", c.body)
	}
	if g := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil); g.json(t)["status"] != taskevent.StatusCancelled {
		t.Errorf("GET after cancel: %s", g.body)
	}
	// A cancelled task never has an artifact: not "not ready".
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusConflict, CodeTaskCancelled)

	// Running: 409 with its status, nothing changed.
	id2 := b.createQueued(t, "cancel-create-2", `{"cancel":2}`)
	if ch, err := task.StartIfQueued(ctx, b.db.Pool, id2, 0); err != nil || !ch.Applied {
		t.Fatal(ch, err)
	}
	r2 := b.cancel(t, id2, `"1"`, "cancel-key-4")
	wantProblem(t, r2, http.StatusConflict, CodeTaskNotCancellable)
	if r2.json(t)["task_status"] != taskevent.StatusRunning {
		t.Errorf("409 body %s", r2.body)
	}
	if n := b.count(t, "outbox_event WHERE event_type = 'TaskCancelled'"); n != 1 {
		t.Errorf("%d TaskCancelled rows, want still 1", n)
	}
}

// The seed's opening: a client reads queued v0 from a stale cache while the
// worker has started the task; its cancel with If-Match "0" is refused by
// PostgreSQL (412), never decided by the cached status.
func TestCancelFromAStaleCachedView(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.createQueued(t, "stale-create-1", `{"stale":true}`)
	g := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil) // back-fills the view: queued v0
	if g.header.Get("ETag") != `"0"` {
		t.Fatalf("first read %s", g.body)
	}
	if ch, err := task.StartIfQueued(context.Background(), b.db.Pool, id, 0); err != nil || !ch.Applied {
		t.Fatal(ch, err)
	}
	if cached := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil); cached.json(t)["status"] != taskevent.StatusQueued {
		t.Fatalf("the view should still be the stale queued v0: %s", cached.body)
	}
	wantProblem(t, b.cancel(t, id, `"0"`, "stale-cancel-1"), http.StatusPreconditionFailed, CodeVersionMismatch)
	testenv.RequireTaskStatus(t, b.db.Pool, id, taskevent.StatusRunning)
}

// A cancel and the worker's start racing on the same queued task: exactly
// one of them applies, every time.
func TestCancelRacesTheWorkersStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for i := range 20 {
		id := b.createQueued(t, "race-create-"+testenv.Itoa(i), `{"race":`+testenv.Itoa(i)+`}`)
		var wg sync.WaitGroup
		var started bool
		var cancelled int
		wg.Go(func() {
			ch, err := task.StartIfQueued(ctx, b.db.Pool, id, 0)
			if err != nil {
				t.Error(err)
			}
			started = ch.Applied
		})
		wg.Go(func() {
			r, err := b.try(http.MethodPost, "/v1/tasks/"+id+"/cancel", http.Header{"If-Match": {`"0"`}, "Idempotency-Key": {"race-cancel-" + testenv.Itoa(i)}}, nil)
			if err != nil {
				t.Error(err)
				return
			}
			cancelled = r.status
		})
		wg.Wait()
		switch {
		case started && (cancelled == http.StatusConflict || cancelled == http.StatusPreconditionFailed):
			testenv.RequireTaskStatus(t, b.db.Pool, id, taskevent.StatusRunning)
		case !started && cancelled == http.StatusOK:
			testenv.RequireTaskStatus(t, b.db.Pool, id, taskevent.StatusCancelled)
		default:
			t.Errorf("task %s: start applied %v, cancel %d: want exactly one to win", id, started, cancelled)
		}
	}
}
