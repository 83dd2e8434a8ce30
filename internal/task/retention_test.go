package task_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/testenv"
)

// Expired walks the terminal tasks past the window, oldest update first,
// BatchSize at a time from a cursor, and never returns a task that is not
// terminal or inside the window; the walk is served by the partial index of
// migration 00012 (terminal tasks only: the create path writes no entry).
func TestExpiredWalksTerminalTasksPastTheWindow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var old []string
	for i, status := range []string{"failed", "cancelled", "failed"} {
		id := testenv.MustCreateTask(t, db.Pool, []byte(`{"i":`+testenv.Itoa(i)+`}`)).Task.TaskID
		exec(`UPDATE task SET status = $2, terminal_error_code = 'X', updated_at = now() - make_interval(days => 40 - $3) WHERE task_id = $1`, id, status, i)
		old = append(old, id)
	}
	queued := testenv.MustCreateTask(t, db.Pool, []byte(`{"queued":1}`)).Task.TaskID
	exec(`UPDATE task SET updated_at = now() - interval '90 days' WHERE task_id = $1`, queued)
	young := testenv.MustCreateTask(t, db.Pool, []byte(`{"young":1}`)).Task.TaskID
	exec(`UPDATE task SET status = 'cancelled', updated_at = now() - interval '29 days' WHERE task_id = $1`, young)

	window := 30 * 24 * time.Hour
	var walked []string
	cur := task.Cursor{}
	for range 3 {
		ids, next, err := task.Expired(ctx, db.Pool, window, cur, 2)
		if err != nil {
			t.Fatal(err)
		}
		walked = append(walked, ids...)
		if len(ids) < 2 {
			break
		}
		cur = next
	}
	if !slices.Equal(walked, old) {
		t.Fatalf("walked %v, want the old terminal tasks oldest first %v", walked, old)
	}

	var plan []string
	rows, err := db.Pool.Query(ctx, `EXPLAIN SELECT task_id, updated_at FROM task
WHERE status IN ('completed', 'failed', 'compensated', 'cancelled') AND updated_at < now() - interval '30 days'
  AND (updated_at, task_id) > ('-infinity'::timestamptz, '') ORDER BY updated_at, task_id LIMIT 100`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, line)
	}
	if p := strings.Join(plan, "\n"); !strings.Contains(p, "task_terminal_updated_idx") || strings.Contains(p, "Sort") {
		t.Fatalf("the walk does not read task_terminal_updated_idx in order:\n%s", p)
	}
}
