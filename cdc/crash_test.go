package cdc

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	dto "github.com/prometheus/client_model/go"

	"github.com/converge-run/converge/internal/testenv"
)

// TestPostgresCrashDoesNotProduceRecordedTransactionsAgain: PostgreSQL 15
// writes a logical slot's confirmed_flush_lsn to disk only when its
// restart_lsn moves, so after a crash the slot resumes from an older
// position and streams again transactions whose rows the relay had
// published and recorded. The restarted session recognizes them by their
// record (outbox.RecordedSince over the slot's catalog_xmin) and does not
// produce them again: every event is in Kafka once, and the ones written
// after the crash are relayed as usual.
func TestPostgresCrashDoesNotProduceRecordedTransactionsAgain(t *testing.T) {
	t.Parallel()
	cl, db := testenv.NewCluster(t)
	b := &testBundle{db: db, kafka: testenv.NewKafka(t), slot: "s_crash", pub: "p_crash"}
	rr := b.start(t, b.config())
	b.waitStreaming(t, rr)

	var before []outboxEvent
	var last pglogrepl.LSN
	for i := range 20 {
		evs := []outboxEvent{b.event(t, fmt.Sprintf("task-%d", i), 1), b.event(t, fmt.Sprintf("task-%d", i), 2)}
		before = append(before, evs...)
		last = b.insertTx(t, evs...)
	}
	testenv.Eventually(t, 20*time.Second, "relay confirmed past the last commit, every row recorded", func() bool {
		return rr.relay.ConfirmedLSN() > last && b.unpublished(t) == 0
	})

	cl.Crash(t)
	cl.Start(t)
	// The relay's session failed with the server; it connects again by
	// itself. A transaction written now shows when it streams again.
	var resumed pglogrepl.LSN
	testenv.Eventually(t, 30*time.Second, "PostgreSQL accepts writes again", func() bool {
		_, err := b.db.Pool.Exec(context.Background(), `SELECT 1`)
		return err == nil
	})
	after := []outboxEvent{b.event(t, "task-after", 1)}
	resumed = b.insertTx(t, after...)
	testenv.Eventually(t, 60*time.Second, "relay confirmed past the commit after the crash", func() bool {
		return rr.relay.ConfirmedLSN() > resumed && b.unpublished(t) == 0
	})

	ids := byEventID(b.readAll(t))
	for _, e := range append(before, after...) {
		rs := ids[e.id]
		if len(rs) != 1 {
			t.Errorf("event %s: %d records in Kafka, want 1", e.id, len(rs))
			continue
		}
		checkRecord(t, rs[0], e)
	}
	// The slot's state on disk is the one written when it was created (no
	// checkpoint ran since: the first timed one is minutes away, and an
	// immediate shutdown writes none), so the slot streamed the 20
	// transactions again and the session skipped their rows.
	var m dto.Metric
	if err := rr.relay.m.rowsAlreadyPublished.Write(&m); err != nil {
		t.Fatal(err)
	}
	skipped := m.GetCounter().GetValue()
	t.Logf("rows streamed again after the crash and not produced again: %.0f of %d", skipped, len(before))
	if skipped == 0 || skipped > float64(len(before)) {
		t.Errorf("%.0f rows counted as streamed again and skipped, want between 1 and the %d written before the crash", skipped, len(before))
	}
}
