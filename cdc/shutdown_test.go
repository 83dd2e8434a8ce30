package cdc

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/schemas"
)

// A fast shutdown of PostgreSQL (pg_ctl stop -m fast, systemd stop) with
// the relay connected, outbox rows and other tables being written,
// completes: the walsender waits for the relay to confirm everything it
// sent, and the relay confirms the keepalive's position once idle (issue
// 13 review: the shutdown hung past 60 s). A cluster of its own, since the
// test stops it.
func TestPostgresFastShutdownWithRelayConnected(t *testing.T) {
	if _, err := localpg.BinDir(); err != nil {
		if testenv.InCI() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	t.Parallel()
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "converge-cdc-shutdown-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := localpg.Start(ctx, localpg.Config{DataDir: filepath.Join(dir, "data"), Port: testenv.FreePort(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			c.Stop()
		}
	})
	url := c.URL("postgres")
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := schemas.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	kafka := testenv.NewKafka(t)
	b := &testBundle{kafka: kafka}
	cfg := Config{DatabaseURL: url, Brokers: kafka.Brokers, SlotName: "s_shutdown", PublicationName: "p_shutdown",
		StatusInterval: 100 * time.Millisecond, FlushInterval: 20 * time.Millisecond, ShutdownTimeout: 5 * time.Second,
		RestartBackoffMin: 50 * time.Millisecond, RestartBackoffMax: 200 * time.Millisecond, Logger: testLogger()}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		<-done
	}()
	testenv.Eventually(t, 10*time.Second, "relay streaming", func() bool { return r.ConfirmedLSN() != 0 })

	// Light load, as when the hang was seen: an outbox row and some other
	// WAL every 20 ms.
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; loadCtx.Err() == nil; i++ {
			ev := b.event(t, fmt.Sprintf("task-shutdown-%d", i), 1)
			_, _ = pool.Exec(loadCtx, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6)`, ev.id, ev.taskID, ev.version, ev.typ, string(ev.payload), ev.sha)
			_, _ = pool.Exec(loadCtx, `CREATE TABLE IF NOT EXISTS unrelated (v text); INSERT INTO unrelated SELECT repeat('x', 100) FROM generate_series(1, 50)`)
			time.Sleep(20 * time.Millisecond)
		}
	}()
	time.Sleep(time.Second)
	// The relay idle between two writes (the load pauses, every row is
	// marked), with other WAL written after its last outbox commit.
	stopLoad()
	wg.Wait()
	testenv.Eventually(t, 10*time.Second, "every row marked", func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`).Scan(&n) == nil && n == 0
	})
	if _, err := pool.Exec(ctx, `INSERT INTO unrelated SELECT repeat('y', 100) FROM generate_series(1, 50)`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	pool.Close()
	start := time.Now()
	stopped = true
	if err := c.Stop(); err != nil {
		t.Logf("stop: %v", err)
	}
	took := time.Since(start)
	// Stop kills the server after 30 s of fast shutdown.
	if took > 20*time.Second {
		t.Fatalf("fast shutdown took %s with the relay connected; want well under the 30 s kill", took)
	}
}
