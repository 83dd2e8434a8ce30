package cdc

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// insertRaw inserts one outbox row with payload as text, exactly as given.
func (b *testBundle) insertRaw(t *testing.T, e outboxEvent) {
	t.Helper()
	if _, err := b.db.Pool.Exec(context.Background(), `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6)`, e.id, e.taskID, e.version, e.typ, string(e.payload), e.sha); err != nil {
		t.Fatal(err)
	}
}

// storedPayload returns the payload column of row id as text.
func (b *testBundle) storedPayload(t *testing.T, id string) []byte {
	t.Helper()
	var p string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT payload::text FROM outbox_event WHERE outbox_id = $1`, id).Scan(&p); err != nil {
		t.Fatal(err)
	}
	return []byte(p)
}

// oneRecord returns the only record of event id, failing when there is
// not exactly one.
func oneRecord(t *testing.T, ids map[string][]*kgo.Record, id string) *kgo.Record {
	t.Helper()
	if n := len(ids[id]); n != 1 {
		t.Fatalf("event %s: %d records, want 1", id, n)
	}
	return ids[id][0]
}

// TestRelayPayloadForms: a canonical payload is relayed byte for byte; a
// payload whose column is not the hash of the stored bytes (another JSON
// form, another payload) is relayed as it is, column as header, and counted:
// the relay never parses a payload (the consumers refuse such a record).
func TestRelayPayloadForms(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	rr := b.startStreaming(t, cfg)

	canonical := b.event(t, "task-p", 1)
	b.insertRaw(t, canonical)

	reordered := b.event(t, "task-q", 1)
	reordered.payload = []byte(`{"b": 1, "a": 2}`)
	reordered.sha = canonSHA([]byte(`{"a":2,"b":1}`))
	b.insertRaw(t, reordered)

	mismatch := b.event(t, "task-r", 1)
	mismatch.sha = canonSHA([]byte("not this payload"))
	b.insertRaw(t, mismatch)

	testenv.Eventually(t, 10*time.Second, "all rows published", func() bool { return b.unpublished(t) == 0 })
	if err := rr.stop(t); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	ids := byEventID(b.readAll(t))

	r := oneRecord(t, ids, canonical.id)
	checkRecord(t, r, canonical)
	if stored := b.storedPayload(t, canonical.id); !bytes.Equal(r.Value, stored) {
		t.Errorf("value %s, want the stored bytes %s", r.Value, stored)
	}

	r = oneRecord(t, ids, reordered.id)
	if string(r.Value) != `{"b": 1, "a": 2}` {
		t.Errorf("value %s, want the stored bytes {\"b\": 1, \"a\": 2}", r.Value)
	}
	if got := header(r, taskevent.HeaderPayloadSHA256); got != reordered.sha {
		t.Errorf("payload-sha256 header %s, want the column %s", got, reordered.sha)
	}

	r = oneRecord(t, ids, mismatch.id)
	if !bytes.Equal(r.Value, mismatch.payload) {
		t.Errorf("value %s, want the canonical payload %s", r.Value, mismatch.payload)
	}
	if got := header(r, taskevent.HeaderPayloadSHA256); got != mismatch.sha {
		t.Errorf("payload-sha256 header %s, want the column %s", got, mismatch.sha)
	}

	if got := counterSum(t, reg, "converge_relay_payload_hash_mismatches_total"); got != 2 {
		t.Fatalf("converge_relay_payload_hash_mismatches_total = %v, want 2 (the reordered and the mismatching rows)", got)
	}
}
