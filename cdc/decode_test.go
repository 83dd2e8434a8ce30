package cdc

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
)

// createdPayload is a typical TaskCreated value, as the API writes it.
func createdPayload(t testing.TB) ([]byte, string) {
	t.Helper()
	now := time.Date(2025, 1, 2, 3, 4, 5, 123456000, time.UTC)
	e := &taskevent.Event{
		EventID: "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", EventType: taskevent.TypeTaskCreated,
		SchemaVersion: taskevent.SchemaVersion, TaskID: "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c", OccurredAt: now,
		Task: taskevent.Task{
			TaskID: "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c", Status: taskevent.StatusQueued, OutputFormat: "jcs",
			InputSHA256: strings.Repeat("ab", 32), InputSize: 4096, CreatedAt: now, UpdatedAt: now,
		},
	}
	value, sum, err := taskevent.Encode(e)
	if err != nil {
		t.Fatal(err)
	}
	return value, sum
}

func TestAppendHeaders(t *testing.T) {
	t.Parallel()
	sha := strings.Repeat("0f", 32)
	tests := []struct {
		name           string
		eventID, typ   string
		version        int64
		sha            string
		room           int // bytes of room in the buffer; -1: valuesLen
		wantSameBuffer bool
	}{
		{"typical", "evt-1", taskevent.TypeTaskCreated, 0, sha, -1, true},
		{"largest version", "evt-2", taskevent.TypeTaskCompleted, math.MaxInt64, sha, -1, true},
		{"smallest version", "evt-3", taskevent.TypeTaskFailed, math.MinInt64, sha, -1, true},
		{"no room: grows", "evt-<&>-é", taskevent.TypeTaskRedriveRequested, 7, sha, 0, false},
		{"empty values", "", "", 1, "", -1, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			want := taskevent.Headers(tc.eventID, tc.typ, tc.version, tc.sha, "tenant-1")
			room := tc.room
			if room < 0 {
				room = valuesLen(&want)
			}
			buf := make([]byte, 0, room)
			var hs [taskevent.NumHeaders]kgo.RecordHeader
			out := appendHeaders(&hs, buf, &want)
			if same := cap(out) == cap(buf); same != tc.wantSameBuffer {
				t.Errorf("buffer kept: %v, want %v (cap %d -> %d)", same, tc.wantSameBuffer, cap(buf), cap(out))
			}
			for i, h := range want {
				if hs[i].Key != h[0] || string(hs[i].Value) != h[1] {
					t.Errorf("header %d = %s=%q, want %s=%q", i, hs[i].Key, hs[i].Value, h[0], h[1])
				}
			}
			// Each value is capped: appending to one leaves the next intact.
			_ = append(hs[0].Value, 'X')
			if string(hs[1].Value) != want[1][1] {
				t.Errorf("appending to the first value changed the second: %q", hs[1].Value)
			}
		})
	}
}

func TestRecord(t *testing.T) {
	t.Parallel()
	canonical, sum := createdPayload(t)
	other := canonSHA([]byte("another payload"))
	tests := []struct {
		name      string
		payload   []byte
		column    string
		wantMatch bool // false: the caller counts a mismatch
	}{
		{name: "canonical, as written", payload: canonical, column: sum, wantMatch: true},
		// The relay trusts a writer whose column is the hash of what it
		// stored: such bytes are relayed unparsed (doc.go "Value").
		{name: "non-canonical bytes with their own hash", payload: []byte(`{"b": 1, "a": 2}`),
			column: canonSHA([]byte(`{"b": 1, "a": 2}`)), wantMatch: true},
		{name: "keys out of order, column = hash of the canonical form", payload: []byte(`{"b": 1, "a": 2}`),
			column: canonSHA([]byte(`{"a":2,"b":1}`))},
		{name: "column of another payload", payload: canonical, column: other},
		{name: "column not a hash", payload: canonical, column: "x"},
		// Not parsed: relayed, and refused by the consumers' decoding.
		{name: "not JSON", payload: []byte(`{"a":`), column: sum},
		{name: "not I-JSON (duplicate member), own hash", payload: []byte(`{"a":1,"a":2}`), column: canonSHA([]byte(`{"a":1,"a":2}`)), wantMatch: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			row := outboxRow{outboxID: "evt-1", aggregateID: "task-1", aggregateVersion: 3, eventType: taskevent.TypeTaskCompleted,
				payload: tc.payload, payloadSHA256: tc.column}
			rec, match := row.record("topic")
			if !bytes.Equal(rec.Value, tc.payload) || &rec.Value[0] != &row.payload[0] {
				t.Errorf("value %s, want the stored payload itself %s", rec.Value, tc.payload)
			}
			if match != tc.wantMatch {
				t.Errorf("hash matches = %v, want %v", match, tc.wantMatch)
			}
			if rec.Topic != "topic" || string(rec.Key) != row.aggregateID {
				t.Errorf("topic %q key %q", rec.Topic, rec.Key)
			}
			want := taskevent.Headers(row.outboxID, row.eventType, row.aggregateVersion, tc.column, row.tenantID) // always the column
			if len(rec.Headers) != len(want) {
				t.Fatalf("%d headers, want %d", len(rec.Headers), len(want))
			}
			for i, h := range want {
				if rec.Headers[i].Key != h[0] || string(rec.Headers[i].Value) != h[1] {
					t.Errorf("header %d = %s=%q, want %s=%q", i, rec.Headers[i].Key, rec.Headers[i].Value, h[0], h[1])
				}
			}
		})
	}
}

// TestRecordAllocs pins the fast path's allocations: the record with its
// headers, and one buffer for the key and the header values.
func TestRecordAllocs(t *testing.T) {
	canonical, sum := createdPayload(t)
	row := outboxRow{outboxID: "evt-1", aggregateID: "task-1", aggregateVersion: 0, eventType: taskevent.TypeTaskCreated,
		payload: canonical, payloadSHA256: sum}
	allocs := testing.AllocsPerRun(100, func() {
		if _, match := row.record("topic"); !match {
			t.Fatal("hash mismatch")
		}
	})
	if allocs > 2 {
		t.Fatalf("record (fast path) allocates %.0f times, want at most 2", allocs)
	}
}

// outboxRelation is the RelationMessage of outbox_event with its columns in
// another order than the relay's and one column it does not read.
func outboxRelation(t testing.TB) *relation {
	t.Helper()
	cols := []string{"created_at", "payload", "outbox_id", "payload_sha256", "aggregate_version", "event_type", "aggregate_id"}
	m := &pglogrepl.RelationMessage{RelationID: 16384, Namespace: outboxSchema, RelationName: outboxTable}
	for _, c := range cols {
		m.Columns = append(m.Columns, &pglogrepl.RelationMessageColumn{Name: c})
	}
	rel, err := newRelation(m)
	if err != nil {
		t.Fatal(err)
	}
	return rel
}

// outboxTuple is an insert tuple of outboxRelation.
func outboxTuple(outboxID, aggregateID, version, eventType string, payload []byte, sum string) *pglogrepl.TupleData {
	col := func(s []byte) *pglogrepl.TupleDataColumn {
		return &pglogrepl.TupleDataColumn{DataType: pglogrepl.TupleDataTypeText, Length: uint32(len(s)), Data: s}
	}
	return &pglogrepl.TupleData{ColumnNum: 7, Columns: []*pglogrepl.TupleDataColumn{
		col([]byte("2025-01-02 03:04:05+00")), col(payload), col([]byte(outboxID)), col([]byte(sum)),
		col([]byte(version)), col([]byte(eventType)), col([]byte(aggregateID)),
	}}
}

func TestDecode(t *testing.T) {
	t.Parallel()
	rel := outboxRelation(t)
	canonical, sum := createdPayload(t)
	tuple := outboxTuple("evt-9", "task-9", "42", taskevent.TypeTaskCreated, append([]byte(nil), canonical...), sum)
	row, err := rel.decode(tuple)
	if err != nil {
		t.Fatal(err)
	}
	// The tuple's bytes belong to the connection's read buffer: the row
	// must not share them.
	for _, c := range tuple.Columns {
		for i := range c.Data {
			c.Data[i] = '#'
		}
	}
	want := outboxRow{outboxID: "evt-9", aggregateID: "task-9", aggregateVersion: 42, eventType: taskevent.TypeTaskCreated,
		payload: canonical, payloadSHA256: sum}
	if row.outboxID != want.outboxID || row.aggregateID != want.aggregateID || row.aggregateVersion != want.aggregateVersion ||
		row.eventType != want.eventType || row.payloadSHA256 != want.payloadSHA256 || !bytes.Equal(row.payload, want.payload) {
		t.Fatalf("decode = %+v, want %+v", row, want)
	}

	if _, err := rel.decode(outboxTuple("evt-9", "task-9", "x", taskevent.TypeTaskCreated, canonical, sum)); !errors.Is(err, ErrInvalidRow) {
		t.Fatalf("decode with aggregate_version x = %v, want ErrInvalidRow", err)
	}
	short := outboxTuple("evt-9", "task-9", "1", taskevent.TypeTaskCreated, canonical, sum)
	short.Columns = short.Columns[1:]
	if _, err := rel.decode(short); !errors.Is(err, ErrInvalidRow) {
		t.Fatalf("decode of a short tuple = %v, want ErrInvalidRow", err)
	}
}

// BenchmarkRecord measures building the Kafka record of a typical TaskCreated
// row (hash only): record alone, and decode+record, the whole per-row work
// from the pgoutput tuple.
func BenchmarkRecord(b *testing.B) {
	canonical, sum := createdPayload(b)
	row := outboxRow{outboxID: "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", aggregateID: "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c",
		aggregateVersion: 0, eventType: taskevent.TypeTaskCreated, payloadSHA256: sum}
	b.Run("fast", func(b *testing.B) {
		row := row
		row.payload = canonical
		b.SetBytes(int64(len(canonical)))
		b.ReportAllocs()
		for b.Loop() {
			if rec, match := row.record("converge.task-events.v1"); !match || len(rec.Value) != len(canonical) {
				b.Fatal("record: hash mismatch")
			}
		}
	})
	b.Run("decode+fast", func(b *testing.B) {
		rel := outboxRelation(b)
		tuple := outboxTuple(row.outboxID, row.aggregateID, "0", row.eventType, canonical, sum)
		b.SetBytes(int64(len(canonical)))
		b.ReportAllocs()
		for b.Loop() {
			r, err := rel.decode(tuple)
			if err != nil {
				b.Fatal(err)
			}
			if _, match := r.record("converge.task-events.v1"); !match {
				b.Fatal("record: hash mismatch")
			}
		}
	})
}
