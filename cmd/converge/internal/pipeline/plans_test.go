package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/testenv"
)

// TestNoSequentialScansAfterAnalyzingEmptyTables: a new deployment analyzed
// before traffic (VACUUM ANALYZE of the empty, freshly migrated tables)
// must not run its statements as sequential scans as the tables grow.
// pgx prepares statements and PostgreSQL caches a generic plan after five
// executions; chosen on empty statistics it is a sequential scan, kept until
// the next ANALYZE (issue 11). dbpool.New prices sequential scans out, so
// the cached plans use the indexes (internal/dbpool).
func TestNoSequentialScansAfterAnalyzingEmptyTables(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		t.Fatal(err)
	}
	b := setupOn(t, db, nil)
	const n = 150
	ids := make([]string, 0, n)
	for i := range n {
		resp, body := b.post(t, fmt.Sprintf("plans-%03d", i), []byte(fmt.Sprintf(`{"document":{"n":%d}}`, i)))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("create %d: %d %s", i, resp.StatusCode, body)
		}
		ids = append(ids, taskID(t, body))
	}
	testenv.Eventually(t, 60*time.Second, "every task completed", func() bool {
		var done int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM task WHERE status = 'completed' AND task_id = ANY($1)`, ids).Scan(&done)
		return err == nil && done == n
	})
	// Statistics reach pg_stat_user_tables when the sessions go idle.
	var scans map[string]int64
	testenv.Eventually(t, 20*time.Second, "statistics flushed", func() bool {
		scans = map[string]int64{}
		rows, err := db.Pool.Query(ctx, `SELECT relname, seq_scan, idx_scan FROM pg_stat_user_tables
WHERE relname IN ('task', 'idempotency_record', 'outbox_event', 'inbox_message', 'effect_ledger', 'task_input')`)
		if err != nil {
			return false
		}
		defer rows.Close()
		var idx int64
		for rows.Next() {
			var name string
			var seq, ix *int64
			if rows.Scan(&name, &seq, &ix) != nil {
				return false
			}
			if seq != nil {
				scans[name] = *seq
			}
			if ix != nil {
				idx += *ix
			}
		}
		return idx >= 3*n // the statements of the n tasks are counted
	})
	for table, seq := range scans {
		// The reconciler's scans are bounded and periodic; the hot path's
		// statements are one or more per task per table.
		if seq > n/5 {
			t.Errorf("%s: %d sequential scans for %d tasks (cached generic plans chosen on empty statistics?)", table, seq, n)
		}
	}
	t.Logf("sequential scans: %v", scans)
}

func taskID(t *testing.T, body []byte) string {
	t.Helper()
	var out struct {
		TaskID string `json:"task_id"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.TaskID == "" {
		t.Fatalf("no task_id in %s (%v)", body, err)
	}
	return out.TaskID
}
