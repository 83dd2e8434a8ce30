package taskview

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

func newTaskID(t *testing.T) string {
	t.Helper()
	id, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	return id.String()
}

func snapshot(id string, version int64, status string) taskevent.Task {
	now := time.Now().UTC().Truncate(time.Microsecond)
	return taskevent.Task{TaskID: id, Status: status, Version: version, OutputFormat: "jcs",
		InputSHA256: "0000000000000000000000000000000000000000000000000000000000000000", InputSize: 2,
		CreatedAt: now, UpdatedAt: now}
}

// counterValue returns the value of a counter (or counter vector child
// matching labels) gathered from reg, 0 when absent.
func counterValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

func TestCachePutGet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	reg := prometheus.NewRegistry()
	c, err := NewCache(rdb, CacheOptions{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	id := newTaskID(t)

	if _, ok, err := c.Get(ctx, id); err != nil || ok {
		t.Fatalf("Get before Put = ok %v, err %v; want miss", ok, err)
	}
	stored, err := c.Put(ctx, snapshot(id, 5, taskevent.StatusCompleted))
	if err != nil || !stored {
		t.Fatalf("Put v5 = %v, %v; want stored", stored, err)
	}
	// A stale projection (older version) and a duplicate are refused.
	for _, v := range []int64{3, 5} {
		stored, err = c.Put(ctx, snapshot(id, v, taskevent.StatusRunning))
		if err != nil || stored {
			t.Fatalf("Put v%d after v5 = %v, %v; want not stored", v, stored, err)
		}
	}
	got, ok, err := c.Get(ctx, id)
	if err != nil || !ok {
		t.Fatalf("Get = %v, %v", ok, err)
	}
	if got.Version != 5 || got.Status != taskevent.StatusCompleted || got.TaskID != id {
		t.Fatalf("view = v%d %s %s, want v5 completed", got.Version, got.Status, got.TaskID)
	}
	if n := counterValue(t, reg, "converge_cache_stale_writes_rejected_total", nil); n != 2 {
		t.Fatalf("stale writes rejected = %v, want 2", n)
	}
	// A newer version replaces the view.
	if stored, err = c.Put(ctx, snapshot(id, 6, taskevent.StatusCompensating)); err != nil || !stored {
		t.Fatalf("Put v6 = %v, %v", stored, err)
	}
	if got, _, _ = c.Get(ctx, id); got.Version != 6 {
		t.Fatalf("view version %d, want 6", got.Version)
	}
	// Stored layout: hash with v and json.
	if v, err := rdb.HGet(ctx, Key(id), "v").Result(); err != nil || v != "6" {
		t.Fatalf("hash field v = %q, %v", v, err)
	}

	if err := c.Invalidate(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.Get(ctx, id); err != nil || ok {
		t.Fatalf("Get after Invalidate = %v, %v; want miss", ok, err)
	}
}

func TestCacheTTLJitter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	c, err := NewCache(rdb, CacheOptions{TTL: time.Hour, TTLJitter: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		id := newTaskID(t)
		if _, err := c.Put(ctx, snapshot(id, 0, taskevent.StatusQueued)); err != nil {
			t.Fatal(err)
		}
		ttl, err := rdb.PTTL(ctx, Key(id)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl < time.Hour-time.Second || ttl > 90*time.Minute {
			t.Fatalf("ttl %s outside [1h, 1h30m]", ttl)
		}
	}
}

func TestCacheRejectsInvalidSnapshots(t *testing.T) {
	t.Parallel()
	_, rdb := testenv.Redis(t)
	c, err := NewCache(rdb, CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for name, task := range map[string]taskevent.Task{
		"empty id":         snapshot("", 1, taskevent.StatusQueued),
		"negative version": snapshot(newTaskID(t), -1, taskevent.StatusQueued),
		"version 2^53":     snapshot(newTaskID(t), 1<<53, taskevent.StatusQueued),
	} {
		if _, err := c.Put(context.Background(), task); !errors.Is(err, ErrInvalidTask) {
			t.Errorf("%s: err = %v, want ErrInvalidTask", name, err)
		}
	}
	if _, err := NewCache(rdb, CacheOptions{TTLJitter: 2}); err == nil {
		t.Error("TTLJitter 2 accepted")
	}
	if _, err := NewCache(nil, CacheOptions{}); err == nil {
		t.Error("nil client accepted")
	}
}

func TestCacheVersionsNearLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	c, err := NewCache(rdb, CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	id := newTaskID(t)
	const top = 1<<53 - 1
	if ok, err := c.Put(ctx, snapshot(id, top-1, taskevent.StatusRunning)); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if ok, err := c.Put(ctx, snapshot(id, top, taskevent.StatusCompleted)); err != nil || !ok {
		t.Fatalf("2^53-1 after 2^53-2: stored %v, %v", ok, err)
	}
	if ok, err := c.Put(ctx, snapshot(id, top-1, taskevent.StatusRunning)); err != nil || ok {
		t.Fatalf("2^53-2 after 2^53-1: stored %v, %v", ok, err)
	}
}

// PutMany answers each snapshot as Put would, in one pipeline: stored,
// stale (an equal or newer view), invalid; and it still works after Redis
// forgot the script (SCRIPT FLUSH, as after a restart).
func TestCachePutMany(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, rdb := testenv.Redis(t)
	c, err := NewCache(rdb, CacheOptions{Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newTaskID(t), newTaskID(t)
	if stored, err := c.Put(ctx, snapshot(b, 4, taskevent.StatusCompleted)); err != nil || !stored {
		t.Fatalf("Put b v4 = %v, %v", stored, err)
	}
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	rs, err := c.PutMany(ctx, []taskevent.Task{
		snapshot(a, 1, taskevent.StatusQueued),
		snapshot(b, 3, taskevent.StatusRunning), // older than the stored v4
		snapshot("", 1, taskevent.StatusQueued),
		snapshot(a, 2, taskevent.StatusRunning), // newer than the first, same pipeline
	})
	if err != nil {
		t.Fatal(err)
	}
	if !rs[0].Stored || rs[0].Err != nil || rs[1].Stored || rs[1].Err != nil || !errors.Is(rs[2].Err, ErrInvalidTask) || !rs[3].Stored || rs[3].Err != nil {
		t.Fatalf("results = %+v", rs)
	}
	for id, want := range map[string]int64{a: 2, b: 4} {
		if got, ok, err := c.Get(ctx, id); err != nil || !ok || got.Version != want {
			t.Errorf("view of %s = %+v, %v, %v; want v%d", id, got, ok, err, want)
		}
	}
}
