package api

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/consumers/reconciler"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
)

// Retention as the API shows it (issue 13, seed 3.3): a task past the task
// window whose artifact retention deleted answers 410 ARTIFACT_EXPIRED on
// its artifact (the reconciler stopped between the deletion and the
// removal of the rows); once removed, GET /v1/tasks/{id} answers 404
// TASK_NOT_FOUND although its view was cached in Redis before, and so
// does its artifact.
func TestRetentionRemovedTaskIsNotFound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	doc := `{"z":1,"a":2}`
	id := b.post(t, "retention-0001", wrap(doc)).json(t)["task_id"].(string)
	canonical, err := canon.Transform([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	completeTask(t, b, id, canonical)
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil); r.status != http.StatusOK || r.header.Get("Cache-Status") != "converge; fwd=miss; stored" {
		t.Fatalf("first read: %d %q", r.status, r.header.Get("Cache-Status"))
	}
	if r := b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil); r.header.Get("Cache-Status") != "converge; hit" {
		t.Fatalf("second read not from the cache: %q", r.header.Get("Cache-Status"))
	}
	// Past both windows: the key expired, the events published, the task
	// last updated 31 days ago.
	for _, q := range []string{
		`UPDATE idempotency_record SET expires_at = now() - interval '1 minute' WHERE task_id = $1`,
		`UPDATE outbox_event SET published_at = now() WHERE aggregate_id = $1`,
		`UPDATE task SET updated_at = now() - interval '31 days' WHERE task_id = $1`,
	} {
		if _, err := b.db.Pool.Exec(ctx, q, id); err != nil {
			t.Fatal(err)
		}
	}

	faults := &fault.Set{}
	if err := faults.Arm(fault.RetentionAfterArtifactDelete, fault.ActionError, 1); err != nil {
		t.Fatal(err)
	}
	rec, err := reconciler.New(reconciler.Config{Pool: b.db.Pool, ArtifactStore: b.artifacts, Redis: b.rdb, Faults: faults,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := rec.Pass(ctx); err != nil || res.TasksPurged != 0 || faults.Fired(fault.RetentionAfterArtifactDelete) != 1 {
		t.Fatalf("first pass: %+v %v", res, err)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusGone, CodeArtifactExpired)

	if res, err := rec.Pass(ctx); err != nil || res.TasksPurged != 1 {
		t.Fatalf("second pass: %+v %v", res, err)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id, nil, nil), http.StatusNotFound, CodeTaskNotFound)
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusNotFound, CodeTaskNotFound)
	if n := b.count(t, "task"); n != 0 {
		t.Fatalf("%d tasks left", n)
	}
}
