package cdc

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/testenv"
)

// writeOtherTable writes rows into a table outside the publication and
// returns pg_current_wal_lsn() after the commit: WAL the slot holds without
// any outbox traffic.
func (b *testBundle) writeOtherTable(t *testing.T) pglogrepl.LSN {
	t.Helper()
	ctx := context.Background()
	if _, err := b.db.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS unrelated (id bigserial PRIMARY KEY, v text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.db.Pool.Exec(ctx, `INSERT INTO unrelated (v) SELECT repeat('x', 100) FROM generate_series(1, 1000)`); err != nil {
		t.Fatal(err)
	}
	var lsn string
	if err := b.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	l, err := pglogrepl.ParseLSN(lsn)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// gaugeWithLabel returns the value of the series of gauge name whose label
// key has value v.
func gaugeWithLabel(t *testing.T, reg *prometheus.Registry, name, key, v string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == key && l.GetValue() == v {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{%s=%q} not found", name, key, v)
	return 0
}

func TestRelayHeartbeatAdvancesIdleSlot(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.HeartbeatInterval = 50 * time.Millisecond
	cfg.SlotSampleInterval = 50 * time.Millisecond
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	rr := b.startStreaming(t, cfg)

	// No outbox row is written: only heartbeats can move the slot past the
	// WAL of the other table.
	for range 3 {
		target := b.writeOtherTable(t)
		testenv.Eventually(t, 10*time.Second, "slot confirmed past the other table's WAL", func() bool {
			c, _, _ := b.slotState(t)
			return c >= target
		})
	}
	if n := b.unpublished(t); n != 0 {
		t.Fatalf("%d outbox rows appeared", n)
	}
	if got := counterSum(t, reg, "converge_relay_events_published_total"); got != 0 {
		t.Fatalf("converge_relay_events_published_total = %v, want 0 (heartbeats are not events)", got)
	}
	if got := counterSum(t, reg, "converge_relay_heartbeats_emitted_total"); got < 1 {
		t.Fatalf("converge_relay_heartbeats_emitted_total = %v, want > 0", got)
	}
	if got := gaugeValue(t, reg, "converge_relay_heartbeat_last_received_timestamp_seconds"); got <= 0 {
		t.Fatalf("no heartbeat received (last received %v)", got)
	}
	if rtt := gaugeValue(t, reg, "converge_relay_heartbeat_rtt_seconds"); rtt < 0 || rtt > 10 {
		t.Fatalf("converge_relay_heartbeat_rtt_seconds = %v, want within [0, 10]", rtt)
	}
	if got := gaugeValue(t, reg, "converge_relay_last_acked_lsn"); got < float64(rr.relay.ConfirmedLSN()) {
		t.Fatalf("converge_relay_last_acked_lsn %v behind the confirmed LSN %v", got, float64(rr.relay.ConfirmedLSN()))
	}
	testenv.Eventually(t, 10*time.Second, "slot sampled", func() bool {
		return gaugeWithLabel(t, reg, "converge_relay_slot_wal_status", "status", "reserved") == 1
	})
	if lost := gaugeWithLabel(t, reg, "converge_relay_slot_wal_status", "status", "lost"); lost != 0 {
		t.Fatalf("wal_status lost = %v, want 0", lost)
	}
	lag := gaugeValue(t, reg, "converge_relay_slot_lag_bytes")
	retained := gaugeValue(t, reg, "converge_relay_slot_retained_wal_bytes")
	if lag < 0 || retained < lag {
		t.Fatalf("slot lag %v bytes, retained %v bytes: want 0 <= lag <= retained", lag, retained)
	}
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
}

// Without heartbeats, an idle relay still moves the slot past WAL that
// carried no outbox commit: with no transaction tracked, the walsender's
// sent position from its keepalives is confirmed (everything committed
// before it was received and is done). A fast shutdown of PostgreSQL waits
// for exactly this confirmation (issue 13 review: it hung while the relay
// only confirmed commits). Rows written afterwards are still relayed.
func TestRelayIdleConfirmsKeepalivePosition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.HeartbeatInterval = -1 // disabled
	cfg.SlotSampleInterval = 50 * time.Millisecond
	cfg.StatusInterval = 20 * time.Millisecond
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	b.startStreaming(t, cfg)

	for range 3 {
		target := b.writeOtherTable(t)
		testenv.Eventually(t, 10*time.Second, "idle slot confirmed past the other table's WAL", func() bool {
			c, _, _ := b.slotState(t)
			return c >= target
		})
	}
	if got := counterSum(t, reg, "converge_relay_heartbeats_emitted_total"); got != 0 {
		t.Fatalf("converge_relay_heartbeats_emitted_total = %v with heartbeats disabled", got)
	}
	ev := b.event(t, "task-after-idle", 1)
	b.insertTx(t, ev)
	testenv.Eventually(t, 10*time.Second, "row after the idle period published", func() bool { return b.unpublished(t) == 0 })
	if len(byEventID(b.readAll(t))[ev.id]) != 1 {
		t.Fatal("the row written after the idle period is not in the topic")
	}
}
