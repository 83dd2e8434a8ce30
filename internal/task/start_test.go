package task_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/testenv"
)

// startReadingDocument runs task.QueueStartIfQueuedReadingDocument alone.
func startReadingDocument(t *testing.T, q dbpool.Querier, id string, minVersion int64) (task.Changed, []byte, bool) {
	t.Helper()
	var (
		c     task.Changed
		doc   = []byte("stale")
		found = true
	)
	b := &pgx.Batch{}
	task.QueueStartIfQueuedReadingDocument(b, id, minVersion, &c, &doc, &found)
	if err := q.SendBatch(context.Background(), b).Close(); err != nil {
		t.Fatalf("start task %s: %v", id, err)
	}
	return c, doc, found
}

// The worker's start reads the document in its own statement: the start
// applies once, as StartIfQueued's, and returns the task_input bytes
// exactly; a start that does not apply returns no document; a task without
// an input row starts with docFound false (the worker's
// TASK_INPUT_NOT_FOUND).
func TestStartIfQueuedReadingDocument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	doc := []byte(`{"b": 1, "a": [true, null]}`)
	created := testenv.MustCreateTask(t, db.Pool, doc).Task

	c, got, found := startReadingDocument(t, db.Pool, created.TaskID, created.Version)
	if !c.Applied || c.Task.Status != "running" || c.Task.Version != created.Version+1 || c.Task.Attempt != created.Attempt+1 {
		t.Fatalf("start: %+v, want running at version %d, attempt %d", c, created.Version+1, created.Attempt+1)
	}
	if !found || !bytes.Equal(got, doc) {
		t.Fatalf("document %q (found %v), want %q", got, found, doc)
	}
	if c.Task.CreatedAt.Location().String() != "UTC" {
		t.Fatalf("created_at in %s, want UTC", c.Task.CreatedAt.Location())
	}

	c, got, found = startReadingDocument(t, db.Pool, created.TaskID, created.Version)
	if c.Applied || got != nil || found {
		t.Fatalf("second start: %+v, document %q found %v; want not applied, no document", c, got, found)
	}

	bare := testenv.MustCreateTask(t, db.Pool, []byte(`{"bare":1}`)).Task
	if _, err := db.Pool.Exec(ctx, `DELETE FROM task_input WHERE task_id = $1`, bare.TaskID); err != nil {
		t.Fatal(err)
	}
	c, got, found = startReadingDocument(t, db.Pool, bare.TaskID, bare.Version)
	if !c.Applied || got != nil || found {
		t.Fatalf("start without input: %+v, document %q found %v; want applied, no document", c, got, found)
	}
}
