package reconciler

import (
	"context"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/projections/taskview"
)

// A view "from the future" (issue 13: a forged TaskFailed at version 999
// projected while PostgreSQL says version 1) is removed by one pass, so
// readers fall back to PostgreSQL; a second pass finds nothing to do.
func TestPassRemovesViewAheadOfDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	b := setup(t, Config{Redis: rdb})
	c := testenv.MustCreateTask(t, b.db.Pool, []byte(`{"a":1}`))
	cache, err := taskview.NewCache(rdb, taskview.CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	forged := c.Task
	code := "FORGED"
	forged.Version, forged.Status, forged.TerminalErrorCode = 999, "failed", &code
	if stored, err := cache.Put(ctx, forged); err != nil || !stored {
		t.Fatalf("Put forged view = %v, %v", stored, err)
	}
	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.CacheRepaired != 1 {
		t.Fatalf("pass = %+v; want the view ahead of the database repaired", res)
	}
	if _, found, err := cache.Get(ctx, c.Task.TaskID); err != nil || found {
		t.Fatalf("view after the pass: found %v, %v; want it removed", found, err)
	}
	if res, err := b.r.Pass(ctx); err != nil || res.CacheRepaired != 0 {
		t.Fatalf("second pass = %+v, %v", res, err)
	}
	// The compare-and-delete leaves a view that changed since it was read.
	if stored, err := cache.Put(ctx, forged); err != nil || !stored {
		t.Fatalf("Put = %v, %v", stored, err)
	}
	if gone, err := cache.InvalidateVersion(ctx, c.Task.TaskID, 998); err != nil || gone {
		t.Fatalf("InvalidateVersion of another version = %v, %v; want false", gone, err)
	}
	if gone, err := cache.InvalidateVersion(ctx, c.Task.TaskID, 999); err != nil || !gone {
		t.Fatalf("InvalidateVersion = %v, %v; want true", gone, err)
	}
}
