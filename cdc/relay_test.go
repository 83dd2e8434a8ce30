package cdc

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// testBundle is one test's database, Kafka cluster and slot/publication
// names (slots are cluster-wide, so names derive from the unique database).
type testBundle struct {
	db    *testenv.DB
	kafka *testenv.Kafka
	slot  string
	pub   string
	seq   atomic.Int64
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	db := testenv.NewDB(t)
	return &testBundle{db: db, kafka: testenv.NewKafka(t), slot: "s_" + db.Name, pub: "p_" + db.Name}
}

func testLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// config is a Config for the bundle with short intervals.
func (b *testBundle) config() Config {
	return Config{
		DatabaseURL:     b.db.URL,
		Brokers:         b.kafka.Brokers,
		SlotName:        b.slot,
		PublicationName: b.pub,
		StatusInterval:  100 * time.Millisecond,
		FlushInterval:   20 * time.Millisecond,
		ShutdownTimeout: 5 * time.Second,
		Logger:          testLogger(),
	}
}

// runningRelay is a Relay whose Run goes on in a goroutine.
type runningRelay struct {
	relay  *Relay
	cancel context.CancelFunc
	done   chan error
}

// start runs a relay built from cfg; the test's cleanup stops it.
func (b *testBundle) start(t *testing.T, cfg Config) *runningRelay {
	t.Helper()
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	rr := &runningRelay{relay: r, cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-rr.done:
		case <-time.After(15 * time.Second):
			t.Error("relay did not stop within 15s")
		}
	})
	return rr
}

// wait returns Run's result, failing the test after timeout.
func (rr *runningRelay) wait(t *testing.T, timeout time.Duration) error {
	t.Helper()
	select {
	case err := <-rr.done:
		rr.done <- err // keep it for the cleanup
		return err
	case <-time.After(timeout):
		t.Fatalf("Run did not return within %s", timeout)
		return nil
	}
}

// stop cancels Run and returns its result.
func (rr *runningRelay) stop(t *testing.T) error {
	t.Helper()
	rr.cancel()
	return rr.wait(t, 15*time.Second)
}

// slotState reads the bundle's slot from pg_replication_slots.
func (b *testBundle) slotState(t *testing.T) (confirmed pglogrepl.LSN, active, exists bool) {
	t.Helper()
	var lsn *string
	err := b.db.Pool.QueryRow(context.Background(),
		`SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots WHERE slot_name = $1`, b.slot).Scan(&lsn, &active)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, false
	}
	if err != nil {
		t.Fatal(err)
	}
	if lsn != nil {
		if confirmed, err = pglogrepl.ParseLSN(*lsn); err != nil {
			t.Fatal(err)
		}
	}
	return confirmed, active, true
}

// startStreaming starts a relay built from cfg (start) and waits until it
// streams (waitStreaming).
func (b *testBundle) startStreaming(t *testing.T, cfg Config) *runningRelay {
	t.Helper()
	rr := b.start(t, cfg)
	b.waitStreaming(t, rr)
	return rr
}

// waitStreaming waits until rr streams from the slot: rows committed from
// then on are relayed. (The slot shows active while it is being created,
// before its consistent point: earlier commits are not in it.)
func (b *testBundle) waitStreaming(t *testing.T, rr *runningRelay) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "relay streaming", func() bool {
		return rr.relay.ConfirmedLSN() != 0
	})
}

// waitReleased waits until no process streams from the slot.
func (b *testBundle) waitReleased(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "slot released", func() bool {
		_, active, _ := b.slotState(t)
		return !active
	})
}

// outboxEvent is a row of outbox_event as the API writes it.
type outboxEvent struct {
	id      string
	taskID  string
	version int64
	typ     string
	payload []byte // canonical JSON (taskevent.Encode)
	sha     string
}

// event builds a valid event of taskID at version.
func (b *testBundle) event(t *testing.T, taskID string, version int64) outboxEvent {
	t.Helper()
	id := fmt.Sprintf("evt-%s-%d-%d", taskID, version, b.seq.Add(1))
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	e := &taskevent.Event{
		EventID: id, EventType: taskevent.TypeTaskCreated, SchemaVersion: taskevent.SchemaVersion,
		TaskID: taskID, TaskVersion: version, OccurredAt: now,
		Task: taskevent.Task{
			TaskID: taskID, Status: taskevent.StatusQueued, Version: version, OutputFormat: "jcs",
			InputSHA256: canonSHA([]byte(taskID)), InputSize: 42, CreatedAt: now, UpdatedAt: now,
		},
	}
	value, sum, err := taskevent.Encode(e)
	if err != nil {
		t.Fatal(err)
	}
	return outboxEvent{id: id, taskID: taskID, version: version, typ: e.EventType, payload: value, sha: sum}
}

func canonSHA(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// insertTx inserts evs in one transaction and returns the WAL insert
// position read inside it just before COMMIT: the commit record ends after
// it.
func (b *testBundle) insertTx(t *testing.T, evs ...outboxEvent) pglogrepl.LSN {
	t.Helper()
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rows := make([][]any, len(evs))
	for i, e := range evs {
		rows[i] = []any{e.id, e.taskID, e.version, e.typ, string(e.payload), e.sha}
	}
	_, err = tx.CopyFrom(ctx, pgx.Identifier{"outbox_event"},
		[]string{"outbox_id", "aggregate_id", "aggregate_version", "event_type", "payload", "payload_sha256"},
		pgx.CopyFromRows(rows))
	if err != nil {
		t.Fatal(err)
	}
	var lsn string
	if err := tx.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := pglogrepl.ParseLSN(lsn)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// unpublished counts outbox rows not published (outbox_published_at).
func (b *testBundle) unpublished(t *testing.T) int {
	t.Helper()
	var n int
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// readAll returns every record of the topic up to its current end offsets,
// in partition then offset order.
func (b *testBundle) readAll(t *testing.T) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	byPart := map[int32][]*kgo.Record{}
	if err := kafkatopic.ReadToEnd(ctx, b.kafka.Brokers, b.kafka.Topic, func(r *kgo.Record) {
		byPart[r.Partition] = append(byPart[r.Partition], r)
	}); err != nil {
		t.Fatal(err)
	}
	var out []*kgo.Record
	for p := int32(0); p < testenv.Partitions; p++ {
		out = append(out, byPart[p]...)
	}
	return out
}

// byEventID groups records by their event-id header.
func byEventID(recs []*kgo.Record) map[string][]*kgo.Record {
	m := map[string][]*kgo.Record{}
	for _, r := range recs {
		id := header(r, taskevent.HeaderEventID)
		m[id] = append(m[id], r)
	}
	return m
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// checkRecord verifies the record contract for outbox row e.
func checkRecord(t *testing.T, r *kgo.Record, e outboxEvent) {
	t.Helper()
	if string(r.Key) != e.taskID {
		t.Errorf("%s: key %q, want %q", e.id, r.Key, e.taskID)
	}
	if !bytes.Equal(r.Value, e.payload) {
		t.Errorf("%s: value %s, want the canonical payload %s", e.id, r.Value, e.payload)
	}
	if got := canonSHA(r.Value); got != header(r, taskevent.HeaderPayloadSHA256) || got != e.sha {
		t.Errorf("%s: sha256(value) %s, header %s, column %s", e.id, got, header(r, taskevent.HeaderPayloadSHA256), e.sha)
	}
	wantHeaders := taskevent.Headers(e.id, e.typ, e.version, e.sha, "")
	if len(r.Headers) != len(wantHeaders) {
		t.Fatalf("%s: %d headers, want %d", e.id, len(r.Headers), len(wantHeaders))
	}
	for i, h := range wantHeaders {
		if r.Headers[i].Key != h[0] || string(r.Headers[i].Value) != h[1] {
			t.Errorf("%s: header %d = %s=%s, want %s=%s", e.id, i, r.Headers[i].Key, r.Headers[i].Value, h[0], h[1])
		}
	}
}

func TestRelayPublishes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rr := b.startStreaming(t, b.config())

	var all []outboxEvent
	tx := func(evs ...outboxEvent) pglogrepl.LSN {
		all = append(all, evs...)
		return b.insertTx(t, evs...)
	}
	tx(b.event(t, "task-a", 1), b.event(t, "task-a", 2), b.event(t, "task-b", 1))
	tx(b.event(t, "task-a", 3), b.event(t, "task-c", 1))
	last := tx(b.event(t, "task-b", 2), b.event(t, "task-a", 4), b.event(t, "task-c", 2))

	testenv.Eventually(t, 10*time.Second, "all outbox rows published", func() bool { return b.unpublished(t) == 0 })
	testenv.Eventually(t, 10*time.Second, "slot confirmed past the last commit", func() bool {
		c, _, _ := b.slotState(t)
		return c > last
	})

	recs := b.readAll(t)
	if len(recs) != len(all) {
		t.Fatalf("%d records in Kafka, want %d", len(recs), len(all))
	}
	ids := byEventID(recs)
	for _, e := range all {
		rs := ids[e.id]
		if len(rs) != 1 {
			t.Fatalf("event %s: %d records, want 1", e.id, len(rs))
		}
		checkRecord(t, rs[0], e)
	}
	// Per key, the records are on one partition in commit order.
	lastVersion := map[string]int64{}
	partition := map[string]int32{}
	for _, r := range recs { // partition, offset order
		key := string(r.Key)
		if p, ok := partition[key]; ok && p != r.Partition {
			t.Fatalf("key %s on partitions %d and %d", key, p, r.Partition)
		}
		partition[key] = r.Partition
		var v int64
		fmt.Sscan(header(r, taskevent.HeaderAggregateVersion), &v)
		if v <= lastVersion[key] {
			t.Fatalf("key %s: version %d after %d", key, v, lastVersion[key])
		}
		lastVersion[key] = v
	}
	var attempts int
	if err := b.db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NOT NULL AND outbox_publish_attempts(outbox_event) = 1`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != len(all) {
		t.Fatalf("%d rows published with one attempt, want %d", attempts, len(all))
	}
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil after cancel", err)
	}

	// Setup is idempotent: a second relay reuses publication and slot.
	b.waitReleased(t)
	rr2 := b.startStreaming(t, b.config())
	e := b.event(t, "task-a", 5)
	last = b.insertTx(t, e)
	testenv.Eventually(t, 10*time.Second, "row published by the second relay", func() bool { return b.unpublished(t) == 0 })
	if err := rr2.stop(t); err != nil {
		t.Fatalf("second Run = %v, want nil", err)
	}
	ids = byEventID(b.readAll(t))
	if len(ids[e.id]) != 1 {
		t.Fatalf("event %s: %d records, want 1", e.id, len(ids[e.id]))
	}
	checkRecord(t, ids[e.id][0], e)
	for _, old := range all {
		if n := len(ids[old.id]); n != 1 {
			t.Fatalf("event %s relayed %d times after a clean restart, want 1", old.id, n)
		}
	}
	testenv.Eventually(t, 10*time.Second, "slot confirmed past the second relay's commit", func() bool {
		c, _, _ := b.slotState(t)
		return c > last
	})
}

// TestRelayCrashBetweenAckAndConfirm: the relay dies after Kafka acknowledged
// records but before the slot moved past them; a restart produces them again
// and nothing is lost.
func TestRelayCrashBetweenAckAndConfirm(t *testing.T) {
	t.Parallel()
	for _, point := range []string{fault.RelayAfterAckBeforeConfirm, fault.RelayBeforeMarkPublished} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			faults := &fault.Set{}
			if err := faults.Arm(point, fault.ActionError, 0); err != nil {
				t.Fatal(err)
			}
			cfg := b.config()
			cfg.Faults = faults
			rr := b.startStreaming(t, cfg)
			before, _, _ := b.slotState(t)

			var all []outboxEvent
			var first, last pglogrepl.LSN
			for i := range 4 {
				evs := []outboxEvent{b.event(t, "task-x", int64(2*i+1)), b.event(t, "task-y", int64(2*i+2)),
					b.event(t, fmt.Sprintf("task-%d", i), 1)}
				all = append(all, evs...)
				last = b.insertTx(t, evs...)
				if i == 0 {
					first = last
				}
			}

			err := rr.wait(t, 10*time.Second)
			if !errors.Is(err, fault.ErrInjected) {
				t.Fatalf("Run = %v, want the injected fault", err)
			}
			if rr.relay.ConfirmedLSN() > first {
				t.Fatalf("relay confirmed %s, past the first commit (> %s)", rr.relay.ConfirmedLSN(), first)
			}
			b.waitReleased(t)
			confirmed, _, _ := b.slotState(t)
			if confirmed > first || confirmed < before {
				t.Fatalf("slot confirmed_flush_lsn %s moved: was %s, first commit after %s", confirmed, before, first)
			}
			crashed := byEventID(b.readAll(t))
			if len(crashed) == 0 {
				t.Fatal("no record reached Kafka before the crash")
			}
			if point == fault.RelayBeforeMarkPublished {
				if n := b.unpublished(t); n != len(all) {
					t.Fatalf("%d unpublished rows after a crash before marking, want %d", n, len(all))
				}
			} else if n := b.unpublished(t); n == len(all) {
				t.Fatal("no row marked published before the crash after marking")
			}

			// Rows marked published before the crash may make the table look
			// done at once: wait for the restarted relay to confirm past the
			// last commit, which needs every row acknowledged and marked.
			rr2 := b.start(t, b.config())
			testenv.Eventually(t, 10*time.Second, "restarted relay confirmed past the last commit", func() bool {
				return rr2.relay.ConfirmedLSN() > last
			})
			if err := rr2.stop(t); err != nil {
				t.Fatalf("second Run = %v, want nil", err)
			}
			if n := b.unpublished(t); n != 0 {
				t.Fatalf("%d rows unpublished after the restart", n)
			}
			testenv.Eventually(t, 10*time.Second, "slot confirmed past the last commit", func() bool {
				c, _, _ := b.slotState(t)
				return c > last
			})

			ids := byEventID(b.readAll(t))
			for _, e := range all {
				rs := ids[e.id]
				if len(rs) == 0 {
					t.Fatalf("event %s lost", e.id)
				}
				for _, r := range rs {
					checkRecord(t, r, e) // same event id, identical value and headers
				}
				if n := len(crashed[e.id]); n > 0 && len(rs) <= n {
					t.Fatalf("event %s acknowledged before the crash was not produced again (%d records)", e.id, len(rs))
				}
			}
		})
	}
}

func TestRelayLargeTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.MaxBufferedRecords = 100 // far below the transaction: backpressure, no whole-transaction buffer
	cfg.FlushMaxRecords = 500
	b.relayOneTransaction(t, cfg, 5000, 50)
}

// relayOneTransaction runs a relay with cfg (status updates every 20 ms)
// over one transaction of n outbox rows on tasks tasks, waits until every
// row is marked published and the slot is past the commit, stops the relay
// and checks that Kafka holds every event exactly once.
func (b *testBundle) relayOneTransaction(t *testing.T, cfg Config, n, tasks int) {
	t.Helper()
	cfg.StatusInterval = 20 * time.Millisecond
	rr := b.startStreaming(t, cfg)
	evs := make([]outboxEvent, n)
	for i := range evs {
		evs[i] = b.event(t, fmt.Sprintf("task-%d", i%tasks), int64(i/tasks+1))
	}
	last := b.insertTx(t, evs...)
	testenv.Eventually(t, 30*time.Second, "all rows published", func() bool { return b.unpublished(t) == 0 })
	testenv.Eventually(t, 10*time.Second, "slot confirmed past the commit", func() bool {
		c, _, _ := b.slotState(t)
		return c > last
	})
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	ids := byEventID(b.readAll(t))
	for _, e := range evs {
		if len(ids[e.id]) != 1 {
			t.Fatalf("event %s: %d records, want 1", e.id, len(ids[e.id]))
		}
	}
}

func TestRelayCleanShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.StatusInterval = time.Hour // only the final status update can confirm
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	rr := b.startStreaming(t, cfg)
	start, _, _ := b.slotState(t)

	var all []outboxEvent
	var last pglogrepl.LSN
	for i := range 3 {
		evs := []outboxEvent{b.event(t, "task-s", int64(i+1))}
		all = append(all, evs...)
		last = b.insertTx(t, evs...)
	}
	testenv.Eventually(t, 10*time.Second, "all rows published", func() bool { return b.unpublished(t) == 0 })
	if c, _, _ := b.slotState(t); c != start {
		t.Fatalf("slot moved to %s before any status update (was %s)", c, start)
	}
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil after cancel", err)
	}
	confirmed := rr.relay.ConfirmedLSN()
	if confirmed <= last {
		t.Fatalf("relay confirmed %s, want past the last commit (> %s)", confirmed, last)
	}
	b.waitReleased(t)
	if c, _, _ := b.slotState(t); c != confirmed {
		t.Fatalf("slot confirmed_flush_lsn %s, want the final status update's %s", c, confirmed)
	}
	if got := gaugeValue(t, reg, "converge_relay_confirmed_lsn"); got != float64(confirmed) {
		t.Fatalf("converge_relay_confirmed_lsn = %v, want %v", got, float64(confirmed))
	}
	if got := counterSum(t, reg, "converge_relay_events_published_total"); got != float64(len(all)) {
		t.Fatalf("converge_relay_events_published_total = %v, want %d", got, len(all))
	}

	// The slot resumes exactly after the last acknowledged commit: a new
	// relay produces only the new row.
	rr2 := b.startStreaming(t, b.config())
	marker := b.event(t, "task-s", 4)
	b.insertTx(t, marker)
	testenv.Eventually(t, 10*time.Second, "marker published", func() bool { return b.unpublished(t) == 0 })
	if err := rr2.stop(t); err != nil {
		t.Fatalf("second Run = %v, want nil", err)
	}
	ids := byEventID(b.readAll(t))
	for _, e := range append(all, marker) {
		if len(ids[e.id]) != 1 {
			t.Fatalf("event %s: %d records after a clean restart, want 1", e.id, len(ids[e.id]))
		}
	}
}

func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("metric %s not found", name)
	return 0
}

func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	return testenv.MetricSum(t, reg, name, nil)
}

// TestRelaySlotActive: a second relay on a slot another process streams
// from waits (restarts with backoff, reason slot_active) instead of ending,
// and takes over once the first stops: a warm standby.
func TestRelaySlotActive(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rr1 := b.startStreaming(t, b.config())
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.RestartBackoffMin, cfg.RestartBackoffMax = 50*time.Millisecond, 200*time.Millisecond
	rr2 := b.start(t, cfg)
	testenv.Eventually(t, 10*time.Second, "second relay restarting on slot_active", func() bool {
		return testenv.MetricSum(t, reg, "converge_relay_restarts_total", map[string]string{"reason": "slot_active"}) >= 1
	})
	if err := rr1.stop(t); err != nil {
		t.Fatal(err)
	}
	ev := b.event(t, "task-standby", 1)
	b.insertTx(t, ev)
	testenv.Eventually(t, 20*time.Second, "standby relay publishes", func() bool { return b.unpublished(t) == 0 })
	select {
	case err := <-rr2.done:
		t.Fatalf("standby relay returned %v", err)
	default:
	}
}

// A publication that does not deliver outbox inserts at start (as after a
// migration that recreated outbox_event, or publish without insert) keeps
// the relay from streaming — no slot is created — without ending Run: it
// reports the mismatch (Health naming the fix, the mismatch gauge and
// counter) and checks again every SlotSampleInterval; once the publication
// is fixed it streams (issue 13).
func TestRelayPublicationMismatchAtStart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, create, fix, reason, wantFix string
	}{
		{"not covered", "FOR TABLE task", "ADD TABLE public.outbox_event", mismatchNotCovered, "ADD TABLE public.outbox_event"},
		{"no insert", "FOR TABLE outbox_event WITH (publish = 'update')", "SET (publish = 'insert')", mismatchNoInsert, "SET (publish = 'insert')"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			if _, err := b.db.Pool.Exec(ctx, "CREATE PUBLICATION "+b.pub+" "+tc.create); err != nil {
				t.Fatal(err)
			}
			reg := prometheus.NewRegistry()
			cfg := b.config()
			cfg.Registerer = reg
			cfg.SlotSampleInterval = 100 * time.Millisecond
			rr := b.start(t, cfg)
			testenv.Eventually(t, 10*time.Second, "mismatch reported", func() bool { return rr.relay.Health() != nil })
			err := rr.relay.Health()
			if !errors.Is(err, ErrPublicationMismatch) || !strings.Contains(err.Error(), "ALTER PUBLICATION "+b.pub+" "+tc.wantFix) {
				t.Fatalf("Health = %v, want ErrPublicationMismatch naming ALTER PUBLICATION %s %s", err, b.pub, tc.wantFix)
			}
			if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", map[string]string{"reason": tc.reason}); got != 1 {
				t.Fatalf("publication_mismatch{reason=%s} = %v, want 1", tc.reason, got)
			}
			time.Sleep(300 * time.Millisecond) // several checks: counted once
			if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatches_total", map[string]string{"reason": tc.reason}); got != 1 {
				t.Fatalf("publication_mismatches_total{reason=%s} = %v, want 1", tc.reason, got)
			}
			select {
			case err := <-rr.done:
				t.Fatalf("Run returned %v; it must wait for the publication", err)
			default:
			}
			if _, _, exists := b.slotState(t); exists {
				t.Fatal("slot created although the publication is wrong")
			}

			if _, err := b.db.Pool.Exec(ctx, "ALTER PUBLICATION "+b.pub+" "+tc.fix); err != nil {
				t.Fatal(err)
			}
			b.waitStreaming(t, rr)
			if err := rr.relay.Health(); err != nil {
				t.Fatalf("Health after the fix = %v", err)
			}
			if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", nil); got != 0 {
				t.Fatalf("publication_mismatch after the fix = %v, want 0", got)
			}
			b.insertTx(t, b.event(t, "task-fixed", 1))
			testenv.Eventually(t, 10*time.Second, "row published after the fix", func() bool { return b.unpublished(t) == 0 })
		})
	}
}

// A publication that stops covering the outbox while the relay streams
// (ALTER PUBLICATION ... DROP TABLE) is found by the periodic check: the
// relay stops streaming, reports the mismatch naming the fix, and the slot
// stays where it was while rows are written; Run goes on. pgoutput leaves
// those rows out of the slot's stream for good (they are decoded with the
// catalog of their commit), so after ALTER PUBLICATION ... ADD TABLE the
// relay streams the rows written from then on and the rows of the gap stay
// unpublished, for the reconciler to republish (consumers/reconciler
// TestPublicationRepairedRowsReachTheTopic) (issue 13).
func TestRelayPublicationDroppedWhileStreaming(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.Registerer = reg
	cfg.SlotSampleInterval = 100 * time.Millisecond
	cfg.HeartbeatInterval = 50 * time.Millisecond
	rr := b.startStreaming(t, cfg)
	before := b.event(t, "task-before", 1)
	b.insertTx(t, before)
	testenv.Eventually(t, 10*time.Second, "row before the drop published", func() bool { return b.unpublished(t) == 0 })
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", nil); got != 0 {
		t.Fatalf("publication_mismatch while fine = %v, want 0", got)
	}

	if _, err := b.db.Pool.Exec(ctx, "ALTER PUBLICATION "+b.pub+" DROP TABLE outbox_event"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "mismatch reported and streaming stopped", func() bool {
		return rr.relay.Health() != nil && testenv.MetricSum(t, reg, "converge_relay_streaming", nil) == 0
	})
	if err := rr.relay.Health(); !errors.Is(err, ErrPublicationMismatch) || !strings.Contains(err.Error(), "ALTER PUBLICATION "+b.pub+" ADD TABLE public.outbox_event") {
		t.Fatalf("Health = %v, want ErrPublicationMismatch naming the fix", err)
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", map[string]string{"reason": mismatchNotCovered}); got != 1 {
		t.Fatalf("publication_mismatch{reason=not_covered} = %v, want 1", got)
	}
	b.waitReleased(t)
	held, _, _ := b.slotState(t)
	lagBefore := testenv.MetricSum(t, reg, "converge_relay_slot_lag_bytes", nil)
	gap := []outboxEvent{b.event(t, "task-gap", 1), b.event(t, "task-gap", 2)}
	b.insertTx(t, gap[0])
	b.insertTx(t, gap[1])
	// The slot keeps WAL meanwhile, and its gauges say so.
	testenv.Eventually(t, 10*time.Second, "slot lag sampled while waiting", func() bool {
		return testenv.MetricSum(t, reg, "converge_relay_slot_lag_bytes", nil) > lagBefore
	})
	time.Sleep(500 * time.Millisecond) // several checks, heartbeat intervals and status intervals
	if now, active, _ := b.slotState(t); now != held || active {
		t.Fatalf("slot while mismatched: confirmed %s (was %s), active %v; want it held and not streamed", now, held, active)
	}
	select {
	case err := <-rr.done:
		t.Fatalf("Run returned %v; it must wait for the publication", err)
	default:
	}

	if _, err := b.db.Pool.Exec(ctx, "ALTER PUBLICATION "+b.pub+" ADD TABLE outbox_event"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "relay healthy and streaming again", func() bool {
		return rr.relay.Health() == nil && testenv.MetricSum(t, reg, "converge_relay_streaming", nil) == 1
	})
	after := b.event(t, "task-after", 1)
	b.insertTx(t, after)
	testenv.Eventually(t, 10*time.Second, "row after the fix published", func() bool { return b.unpublished(t) == len(gap) })
	for _, e := range gap {
		var published bool
		if err := b.db.Pool.QueryRow(ctx, `SELECT outbox_published_at(outbox_event) IS NOT NULL FROM outbox_event WHERE outbox_id = $1`, e.id).Scan(&published); err != nil || published {
			t.Fatalf("gap row %s published %v (%v); pgoutput left it out of the stream", e.id, published, err)
		}
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatches_total", nil); got != 1 {
		t.Fatalf("publication_mismatches_total = %v, want 1", got)
	}
	wantNoMismatchRestart(t, reg)
}

// A Relation message of the outbox makes the relay check its publication
// at once, not only every SlotSampleInterval (here an hour): a row whose
// transaction was open while outbox_event was dropped from the publication
// is still streamed, with its Relation message, and the check that follows
// finds the mismatch.
func TestRelayChecksPublicationOnRelationMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	cfg := b.config()
	cfg.SlotSampleInterval = time.Hour
	rr := b.startStreaming(t, cfg)
	tx, err := b.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	e := b.event(t, "task-held", 1)
	if _, err := tx.Exec(ctx, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256) VALUES ($1, $2, $3, $4, $5, $6)`,
		e.id, e.taskID, e.version, e.typ, string(e.payload), e.sha); err != nil {
		t.Fatal(err)
	}
	if _, err := b.db.Pool.Exec(ctx, "ALTER PUBLICATION "+b.pub+" DROP TABLE outbox_event"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "mismatch found after the Relation message", func() bool {
		return errors.Is(rr.relay.Health(), ErrPublicationMismatch)
	})
}

// A publication dropped while the relay streams is created again when the
// relay opens its next session, but PostgreSQL (before 18) fails on every
// change written while it did not exist ("publication ... does not
// exist"): the relay reports that as a mismatch naming the fix instead of
// restarting for ever, the slot stays put, Run goes on; once the slot was
// moved past that WAL the relay is healthy and streams again.
func TestRelayPublicationDroppedAndRecreated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.Registerer = reg
	cfg.SlotSampleInterval = 100 * time.Millisecond
	rr := b.startStreaming(t, cfg)
	if _, err := b.db.Pool.Exec(ctx, "DROP PUBLICATION "+b.pub); err != nil {
		t.Fatal(err)
	}
	gap := b.event(t, "task-gap", 1)
	b.insertTx(t, gap)
	testenv.Eventually(t, 10*time.Second, "mismatch reported", func() bool {
		err := rr.relay.Health()
		return errors.Is(err, ErrPublicationMismatch) && strings.Contains(err.Error(), "pg_replication_slot_advance")
	})
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", map[string]string{"reason": mismatchMissing}); got != 1 {
		t.Fatalf("publication_mismatch{reason=missing} = %v, want 1", got)
	}
	held, _, _ := b.slotState(t)
	time.Sleep(500 * time.Millisecond) // several sessions meet the WAL
	if now, _, _ := b.slotState(t); now != held {
		t.Fatalf("slot moved from %s to %s", held, now)
	}
	wantNoMismatchRestart(t, reg)
	if err := rr.relay.Health(); !errors.Is(err, ErrPublicationMismatch) {
		t.Fatalf("Health = %v after several sessions, want the mismatch still reported", err)
	}

	testenv.Eventually(t, 10*time.Second, "slot advanced past the WAL written without the publication", func() bool {
		_, err := b.db.Pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, b.slot)
		return err == nil // fails while a session holds the slot
	})
	testenv.Eventually(t, 10*time.Second, "relay healthy again", func() bool { return rr.relay.Health() == nil })
	after := b.event(t, "task-after", 1)
	b.insertTx(t, after)
	testenv.Eventually(t, 10*time.Second, "row after the fix published", func() bool { return b.unpublished(t) == 1 })
	var published bool
	if err := b.db.Pool.QueryRow(ctx, `SELECT outbox_published_at(outbox_event) IS NOT NULL FROM outbox_event WHERE outbox_id = $1`, gap.id).Scan(&published); err != nil || published {
		t.Fatalf("gap row published %v (%v): want it left to the reconciler", published, err)
	}
	select {
	case err := <-rr.done:
		t.Fatalf("Run returned %v; it must go on", err)
	default:
	}
}

// A Relation message of outbox_event without a column the relay reads (a
// migration renamed payload_sha256) stops the stream before the row: the
// relay reports the mismatch naming the column and the fix, the slot does
// not pass the row, and Run goes on trying. Once the column is back and the
// slot was moved past the rows written without it, the relay is healthy
// again and streams.
func TestRelayOutboxRelationWithoutColumn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.Registerer = reg
	cfg.SlotSampleInterval = 100 * time.Millisecond
	rr := b.startStreaming(t, cfg)
	b.insertTx(t, b.event(t, "task-ok", 1))
	testenv.Eventually(t, 10*time.Second, "first row published", func() bool { return b.unpublished(t) == 0 })

	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := b.db.Pool.Exec(ctx, q, args...); err != nil {
			t.Fatal(err)
		}
	}
	exec(`ALTER TABLE outbox_event RENAME COLUMN payload_sha256 TO payload_hash`)
	e := b.event(t, "task-renamed", 1)
	exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_hash) VALUES ($1, $2, $3, $4, $5, $6)`,
		e.id, e.taskID, e.version, e.typ, string(e.payload), e.sha)
	testenv.Eventually(t, 10*time.Second, "relation mismatch reported", func() bool { return rr.relay.Health() != nil })
	err := rr.relay.Health()
	if !errors.Is(err, ErrRelationMismatch) || !strings.Contains(err.Error(), "payload_sha256") || !strings.Contains(err.Error(), "pg_replication_slot_advance") {
		t.Fatalf("Health = %v, want ErrRelationMismatch naming payload_sha256 and the fix", err)
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", map[string]string{"reason": mismatchColumns}); got != 1 {
		t.Fatalf("publication_mismatch{reason=columns} = %v, want 1", got)
	}
	held, _, _ := b.slotState(t)
	time.Sleep(500 * time.Millisecond) // several sessions meet the Relation message
	if now, _, _ := b.slotState(t); now != held {
		t.Fatalf("slot moved from %s to %s past a row it cannot decode", held, now)
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatches_total", map[string]string{"reason": mismatchColumns}); got != 1 {
		t.Fatalf("publication_mismatches_total{reason=columns} = %v, want 1 (one finding, however many sessions)", got)
	}
	wantNoMismatchRestart(t, reg)
	select {
	case err := <-rr.done:
		t.Fatalf("Run returned %v; it must go on", err)
	default:
	}

	// The fix of the runbook: restore the column, move the slot past the
	// rows written without it (the reconciler republishes them).
	exec(`ALTER TABLE outbox_event RENAME COLUMN payload_hash TO payload_sha256`)
	testenv.Eventually(t, 10*time.Second, "slot advanced past the rows written without the column", func() bool {
		_, err := b.db.Pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, b.slot)
		return err == nil // fails while a session holds the slot
	})
	testenv.Eventually(t, 10*time.Second, "relay healthy again", func() bool { return rr.relay.Health() == nil })
	b.waitStreaming(t, rr)
	restored := b.event(t, "task-restored", 1)
	b.insertTx(t, restored)
	testenv.Eventually(t, 10*time.Second, "row after the fix published", func() bool {
		var published bool
		err := b.db.Pool.QueryRow(ctx, `SELECT outbox_published_at(outbox_event) IS NOT NULL FROM outbox_event WHERE outbox_id = $1`, restored.id).Scan(&published)
		return err == nil && published
	})
	if n := b.unpublished(t); n != 1 {
		t.Fatalf("%d rows unpublished, want 1: the row written without the column, left to the reconciler", n)
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_publication_mismatch", nil); got != 0 {
		t.Fatalf("publication_mismatch after the fix = %v, want 0", got)
	}
}

// With RepairPublication (converge dev) a publication that no longer
// covers the outbox at start is altered back and the relay streams; one
// that stops covering it while the relay streams is altered back when the
// relay opens its next session. Both mismatches are counted.
func TestRelayRepairsPublicationWhenAsked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	if _, err := b.db.Pool.Exec(ctx, "CREATE PUBLICATION "+b.pub+" FOR TABLE task WITH (publish = 'update')"); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.RepairPublication = true
	cfg.Registerer = reg
	cfg.SlotSampleInterval = 100 * time.Millisecond
	rr := b.startStreaming(t, cfg)
	ev := b.event(t, "task-repaired", 1)
	b.insertTx(t, ev)
	testenv.Eventually(t, 10*time.Second, "row published after the repair", func() bool { return b.unpublished(t) == 0 })

	if _, err := b.db.Pool.Exec(ctx, "ALTER PUBLICATION "+b.pub+" DROP TABLE outbox_event"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "mismatch while streaming found and repaired", func() bool {
		return testenv.MetricSum(t, reg, "converge_relay_publication_mismatches_total", map[string]string{"reason": mismatchNotCovered}) == 2 &&
			rr.relay.Health() == nil && testenv.MetricSum(t, reg, "converge_relay_streaming", nil) == 1
	})
	b.insertTx(t, b.event(t, "task-repaired-again", 1))
	testenv.Eventually(t, 10*time.Second, "row published after the second repair", func() bool { return b.unpublished(t) == 0 })
}

func TestCheckSlot(t *testing.T) {
	t.Parallel()
	ok := slotInfo{exists: true, plugin: "pgoutput", slotType: "logical", database: "db", current: "db", walStatus: "reserved"}
	tests := []struct {
		name string
		edit func(*slotInfo)
		want error
	}{
		{"usable", func(*slotInfo) {}, nil},
		{"extended is usable", func(s *slotInfo) { s.walStatus = "extended" }, nil},
		{"invalidated by max_slot_wal_keep_size", func(s *slotInfo) { s.walStatus = "lost" }, ErrSlotLost},
		{"other plugin", func(s *slotInfo) { s.plugin = "test_decoding" }, ErrSlotMismatch},
		{"physical slot", func(s *slotInfo) { s.slotType = "physical"; s.plugin = "" }, ErrSlotMismatch},
		{"other database", func(s *slotInfo) { s.database = "other" }, ErrSlotMismatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			si := ok
			tc.edit(&si)
			err := checkSlot(si, "s")
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Fatalf("checkSlot = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	valid := Config{DatabaseURL: "postgres://u@localhost/db", Brokers: []string{"localhost:9092"}}
	tests := []struct {
		name string
		edit func(*Config)
		ok   bool
	}{
		{"defaults", func(*Config) {}, true},
		{"no database url", func(c *Config) { c.DatabaseURL = "" }, false},
		{"no brokers", func(c *Config) { c.Brokers = nil }, false},
		{"slot name with a quote", func(c *Config) { c.SlotName = `bad"name` }, false},
		{"publication name upper case", func(c *Config) { c.PublicationName = "Outbox" }, false},
		{"negative flush interval", func(c *Config) { c.FlushInterval = -time.Second }, false},
		{"negative buffer", func(c *Config) { c.MaxBufferedRecords = -1 }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := valid
			tc.edit(&cfg)
			_, err := New(cfg)
			if (err == nil) != tc.ok {
				t.Fatalf("New = %v, want ok: %v", err, tc.ok)
			}
		})
	}
	r, err := New(valid)
	if err != nil {
		t.Fatal(err)
	}
	if r.cfg.Topic != taskevent.DefaultTopic || r.cfg.SlotName != DefaultSlotName || r.cfg.StatusInterval != DefaultStatusInterval {
		t.Fatalf("defaults not applied: %+v", r.cfg)
	}
}

// TestRelayKafkaUnreachableAtOpen: a broker that cannot be reached when a
// session opens (its topic check) does not end Run: the session restarts
// with backoff, counted as reason "kafka" (issue 13).
func TestRelayKafkaUnreachableAtOpen(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.Brokers = []string{"127.0.0.1:1"} // nothing listens there
	cfg.KafkaOpts = append(cfg.KafkaOpts, kgo.RetryTimeout(500*time.Millisecond), kgo.DialTimeout(200*time.Millisecond))
	cfg.RestartBackoffMin, cfg.RestartBackoffMax = 50*time.Millisecond, 200*time.Millisecond
	rr := b.start(t, cfg)
	testenv.Eventually(t, 30*time.Second, "two restarts for an unreachable broker", func() bool {
		return testenv.MetricSum(t, reg, "converge_relay_restarts_total", map[string]string{"reason": "kafka"}) >= 2
	})
	select {
	case err := <-rr.done:
		t.Fatalf("Run returned %v with the broker unreachable", err)
	default:
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_restarts_total", map[string]string{"reason": "other"}); got != 0 {
		t.Errorf("restarts{reason=other} = %v, want 0", got)
	}
}

// TestRelayProduceFailure: a record whose produce fails for a reason that
// retrying may fix (here the broker answers TOPIC_AUTHORIZATION_FAILED, as
// after a wrong ACL) does not end Run: the attempt is recorded on the row,
// the session restarts from the slot with backoff, the slot does not move
// past the row meanwhile, and once the broker accepts again the row is
// published and marked (issue 13).
func TestRelayProduceFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.DeliveryTimeout = 2 * time.Second
	cfg.RestartBackoffMin, cfg.RestartBackoffMax = 50*time.Millisecond, 200*time.Millisecond
	rr := b.startStreaming(t, cfg)
	before, _, _ := b.slotState(t)

	var refusing atomic.Bool
	refusing.Store(true)
	b.kafka.Cluster.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		b.kafka.Cluster.KeepControl()
		if !refusing.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	ev := b.event(t, "task-f", 1)
	ev2 := b.event(t, "task-g", 1)
	first := b.insertTx(t, ev, ev2)

	ctx := context.Background()
	testenv.Eventually(t, 20*time.Second, "two restarts after produce failures", func() bool {
		return testenv.MetricSum(t, reg, "converge_relay_restarts_total", map[string]string{"reason": "produce"}) >= 2
	})
	select {
	case err := <-rr.done:
		t.Fatalf("Run returned %v on a retryable produce failure", err)
	default:
	}
	var attempts int
	var code string
	if err := b.db.Pool.QueryRow(ctx, `SELECT publish_attempts, COALESCE(last_error_code, '') FROM outbox_event WHERE outbox_id = $1`, ev.id).Scan(&attempts, &code); err != nil {
		t.Fatal(err)
	}
	if attempts < 1 || code != kerr.TopicAuthorizationFailed.Message {
		t.Fatalf("row after failed attempts: publish_attempts %d, last_error_code %q; want >= 1, %s", attempts, code, kerr.TopicAuthorizationFailed.Message)
	}
	// Every row whose produce failed has its attempt recorded, not only
	// the one that ended the session (issue 13 review).
	if err := b.db.Pool.QueryRow(ctx, `SELECT publish_attempts, COALESCE(last_error_code, '') FROM outbox_event WHERE outbox_id = $1`, ev2.id).Scan(&attempts, &code); err != nil {
		t.Fatal(err)
	}
	if attempts < 1 || code != kerr.TopicAuthorizationFailed.Message {
		t.Fatalf("second row after failed attempts: publish_attempts %d, last_error_code %q; want >= 1, %s", attempts, code, kerr.TopicAuthorizationFailed.Message)
	}
	if c, _, _ := b.slotState(t); c > first || c < before {
		t.Fatalf("slot confirmed_flush_lsn %s moved past the failing row (was %s, commit after %s)", c, before, first)
	}

	refusing.Store(false)
	testenv.Eventually(t, 20*time.Second, "row published after the broker accepts again", func() bool { return b.unpublished(t) == 0 })
	if err := b.db.Pool.QueryRow(ctx, `SELECT outbox_publish_attempts(outbox_event) FROM outbox_event WHERE outbox_id = $1`, ev.id).Scan(&attempts); err != nil || attempts < 2 {
		t.Fatalf("publish_attempts %d, %v; want the failures and the success counted", attempts, err)
	}
	if len(byEventID(b.readAll(t))[ev.id]) == 0 {
		t.Fatal("the row's event is not in the topic")
	}
	if got := counterSum(t, reg, "converge_relay_produce_errors_total"); got < 1 {
		t.Fatalf("converge_relay_produce_errors_total = %v, want >= 1", got)
	}
}

// TestRelayParksRefusedRecord: a row whose record the producer refuses for
// good (larger than the broker accepts) is parked with its error — not
// retried, not fatal — and the events committed after it flow; the slot
// moves past it (issue 13, seed 4.1).
func TestRelayParksRefusedRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.KafkaOpts = []kgo.Opt{kgo.ProducerBatchMaxBytes(16 << 10)}
	b.startStreaming(t, cfg)

	big := b.event(t, "task-big", 1)
	big.payload = []byte(`{"pad":"` + strings.Repeat("x", 32<<10) + `"}`)
	big.sha = canonSHA(big.payload)
	small := b.event(t, "task-big", 2)
	b.insertTx(t, big, b.event(t, "task-same-txn", 1))
	after := b.insertTx(t, small)

	testenv.Eventually(t, 20*time.Second, "slot past the parked row", func() bool {
		c, _, _ := b.slotState(t)
		return c >= after
	})
	st, err := outbox.Get(context.Background(), b.db.Pool, big.id)
	if err != nil {
		t.Fatal(err)
	}
	if st.ParkedAt == nil || st.PublishedAt != nil || st.LastErrorCode != kerr.MessageTooLarge.Message || st.Attempts != 1 || st.LastError == "" {
		t.Fatalf("refused row = %+v; want parked, unpublished, MESSAGE_TOO_LARGE, 1 attempt", st)
	}
	if n := b.unpublished(t); n != 1 {
		t.Fatalf("%d unpublished rows, want only the parked one", n)
	}
	recs := byEventID(b.readAll(t))
	if len(recs[big.id]) != 0 || len(recs[small.id]) != 1 {
		t.Fatalf("records: parked row %d, next row %d; want 0 and 1", len(recs[big.id]), len(recs[small.id]))
	}
	if got := testenv.MetricSum(t, reg, "converge_relay_outbox_rows_parked_total", map[string]string{"code": "MESSAGE_TOO_LARGE"}); got != 1 {
		t.Fatalf("converge_relay_outbox_rows_parked_total = %v, want 1", got)
	}
	if got := counterSum(t, reg, "converge_relay_restarts_total"); got != 0 {
		t.Fatalf("converge_relay_restarts_total = %v, want 0 (parking is not a failure)", got)
	}
	if rows, err := outbox.ListParked(context.Background(), b.db.Pool, outbox.ParkedFilter{Limit: 10}); err != nil || len(rows) != 1 || rows[0].ID != big.id {
		t.Fatalf("ListParked = %+v, %v", rows, err)
	}
}

// TestRelayTransactionLargerThanItsBuffer: a transaction of twice
// MaxBufferedRecords rows streams through (rows free their tokens when Kafka
// acknowledges them, not when their transaction is recorded), is recorded
// once, and the slot passes its commit only after that.
func TestRelayTransactionLargerThanItsBuffer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.MaxBufferedRecords = 3000
	cfg.FlushMaxRecords = 400
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	const n = 6000
	b.relayOneTransaction(t, cfg, n, 60)
	if got := counterSum(t, reg, "converge_relay_outbox_transactions_recorded_total"); got != 1 {
		t.Errorf("transactions recorded = %v, want 1", got)
	}
	// The relay's progress writes no outbox row (migration 00015).
	ctx := context.Background()
	var ins, upd int64
	testenv.Eventually(t, 20*time.Second, "outbox statistics flushed", func() bool {
		err := b.db.Pool.QueryRow(ctx, `SELECT pg_stat_clear_snapshot() IS NULL, n_tup_ins, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox_event'`).Scan(new(bool), &ins, &upd)
		return err == nil && ins >= n
	})
	if upd != 0 {
		t.Errorf("%d outbox rows updated while relaying, want 0", upd)
	}
}

// wantNoMismatchRestart checks that no session restart was counted for a
// publication or relation mismatch (a mismatch is not a restart). A session
// that ended on the mismatch may still hold the slot for a moment (its
// walsender exiting) when the next one opens: that is a slot_active
// restart, counted as such, and allowed (CI, 2026-12-07: once under load).
func wantNoMismatchRestart(t *testing.T, reg *prometheus.Registry) {
	t.Helper()
	all := testenv.MetricSum(t, reg, "converge_relay_restarts_total", nil)
	if active := testenv.MetricSum(t, reg, "converge_relay_restarts_total", map[string]string{"reason": reasonSlotActive}); all != active {
		t.Fatalf("restarts_total = %v (slot_active %v); a mismatch is not a session restart", all, active)
	}
}
