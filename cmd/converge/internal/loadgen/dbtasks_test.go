package loadgen

import (
	"context"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

// DBTasks reads the states of the tasks asked for, in one statement, and
// leaves unknown ids out.
func TestDBTasks(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	a := testenv.MustCreateTask(t, db.Pool, []byte(`{"a":1}`))
	b := testenv.MustCreateTask(t, db.Pool, []byte(`{"b":2}`))
	testenv.MustStartTask(t, db.Pool, b.Task.TaskID)
	got, err := (&DBTasks{Pool: db.Pool}).Tasks(context.Background(), []string{a.Task.TaskID, b.Task.TaskID, "no-such-task"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[a.Task.TaskID].Status != "queued" || got[b.Task.TaskID].Status != "running" || got[a.Task.TaskID].CreatedAt.IsZero() {
		t.Fatalf("Tasks = %+v", got)
	}
	if got[a.Task.TaskID].Terminal() || got[b.Task.TaskID].CompletedAt != nil {
		t.Fatalf("states %+v", got)
	}
}
