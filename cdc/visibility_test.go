package cdc

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/testenv"
)

// A transaction whose commit record is flushed and decoded, but which other
// sessions do not see yet (its COMMIT waits for a synchronous standby), is
// relayed to Kafka and its record (outbox_published_transaction) is written
// at once: the record is true whether or not its rows are visible yet. The
// slot must not pass the transaction before that record committed — held
// too here, like every commit — and once commits are visible again the rows
// read as published (issue 9: before, the per-row mark found no row and the
// rows counted as done with published_at NULL for good).
func TestRelayRecordsTransactionCommittedButNotYetVisible(t *testing.T) {
	t.Parallel()
	h := testenv.NewCommitHold(t)
	b := &testBundle{db: h.DB, kafka: testenv.NewKafka(t), slot: "s_held", pub: "p_held"}
	cfg := b.config()
	cfg.HeartbeatInterval = -1 // a heartbeat's commit would be held too
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	rr := b.startStreaming(t, cfg)

	before := rr.relay.ConfirmedLSN()
	h.Hold(t)
	e := b.event(t, "task-held", 1)
	committed := make(chan error, 1)
	go func() {
		ctx := context.Background()
		_, err := b.db.Pool.Exec(ctx, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6)`, e.id, e.taskID, e.version, e.typ, string(e.payload), e.sha)
		committed <- err
	}()

	// The event reaches Kafka although no other session sees its row ...
	testenv.Eventually(t, 20*time.Second, "held event relayed", func() bool {
		return len(byEventID(b.readAll(t))[e.id]) == 1
	})
	// ... and the relay's record of its transaction waits for its own
	// commit, held like the create's.
	testenv.Eventually(t, 20*time.Second, "record of the transaction waiting for its commit", func() bool {
		var n int
		err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE '%INSERT INTO outbox_published_transaction%' AND wait_event = 'SyncRep'`).Scan(&n)
		return err == nil && n == 1
	})
	var visible int
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event`).Scan(&visible); err != nil || visible != 0 {
		t.Fatalf("rows visible while held: %d (%v), want 0", visible, err)
	}
	// Before the held transaction arrived, the idle relay may confirm
	// the keepalive positions of other WAL (other tests share the
	// cluster); once it holds the transaction, the slot stays put.
	held := rr.relay.ConfirmedLSN()
	if held < before {
		t.Fatalf("slot moved back: %s < %s", held, before)
	}
	if n := counterSum(t, reg, "converge_relay_outbox_transactions_recorded_total"); n != 0 {
		t.Fatalf("transactions recorded = %v while the record's commit is held, want 0", n)
	}

	h.Release(t)
	select {
	case err := <-committed:
		if err != nil {
			t.Fatalf("held insert: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("held commit did not return after Release")
	}
	testenv.Eventually(t, 20*time.Second, "row published once commits are visible", func() bool {
		return b.unpublished(t) == 0
	})
	// Once the transaction is done the slot moves on past where it was
	// held (to the commit, or further once idle again).
	testenv.Eventually(t, 20*time.Second, "slot confirmed past the transaction", func() bool {
		return rr.relay.ConfirmedLSN() > held
	})
	if n := counterSum(t, reg, "converge_relay_outbox_transactions_recorded_total"); n != 1 {
		t.Fatalf("transactions recorded = %v, want 1", n)
	}
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
}

// A decoded row that was deleted after its commit is relayed, its
// transaction recorded, and the slot moves on: the record of a transaction
// needs no row to see.
func TestRelayRowDeletedBeforeItsTransactionIsRecorded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	rr := b.startStreaming(t, cfg)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	b.waitReleased(t)
	reg = prometheus.NewRegistry()
	cfg.Registerer = reg

	e := b.event(t, "task-deleted", 1)
	lsn := b.insertTx(t, e)
	if _, err := b.db.Pool.Exec(context.Background(), `DELETE FROM outbox_event WHERE outbox_id = $1`, e.id); err != nil {
		t.Fatal(err)
	}
	rr = b.start(t, cfg)
	testenv.Eventually(t, 20*time.Second, "slot confirmed past the deleted row's transaction", func() bool {
		return rr.relay.ConfirmedLSN() > lsn
	})
	if n := counterSum(t, reg, "converge_relay_outbox_transactions_recorded_total"); n != 1 {
		t.Fatalf("transactions recorded = %v, want 1", n)
	}
	if len(byEventID(b.readAll(t))[e.id]) != 1 {
		t.Fatal("deleted row's event not relayed once")
	}
}
