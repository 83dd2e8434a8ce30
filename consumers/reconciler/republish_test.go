package reconciler

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// Rows the slot did not deliver (here: written while no relay ran, as after
// a lost slot was recreated) are republished by a pass once older than
// RepublishAfter — with their original key, value and event id, oldest
// first — and marked published; younger rows, published rows and parked
// rows are left alone; a second pass republishes nothing (issue 13).
func TestPassRepublishesUndeliveredRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	producer := newProducer(t, kafka)
	b := setup(t, Config{Producer: producer, RepublishAfter: 10 * time.Minute, Topic: kafka.Topic})
	insert := func(id, task string, version int, ago string, published bool) {
		t.Helper()
		payload := `{"n":` + id[len(id)-1:] + `}`
		if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, published_at)
VALUES ($1, $2, $3, 'TaskCreated', $4, $5, now() - $6::interval, CASE WHEN $7 THEN now() END)`,
			id, task, version, payload, sum([]byte(payload)), ago, published); err != nil {
			t.Fatal(err)
		}
	}
	insert("lost-1", "task-a", 1, "1 hour", false)
	insert("lost-2", "task-a", 2, "50 minutes", false)
	insert("young-3", "task-b", 1, "1 minute", false)
	insert("done-4", "task-c", 1, "1 hour", true)
	insert("parked-5", "task-d", 1, "1 hour", false)
	if ok, err := outbox.Park(ctx, b.db.Pool, "parked-5", "MESSAGE_TOO_LARGE", "x"); err != nil || !ok {
		t.Fatalf("Park = %v, %v", ok, err)
	}

	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.OutboxRepublished != 2 || res.OutboxParked != 1 {
		t.Fatalf("pass = %+v; want 2 republished, 1 parked", res)
	}
	var unpublished []string
	rows, err := b.db.Pool.Query(ctx, `SELECT outbox_id FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL ORDER BY outbox_id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		unpublished = append(unpublished, id)
	}
	if rows.Err() != nil || len(unpublished) != 2 || unpublished[0] != "parked-5" || unpublished[1] != "young-3" {
		t.Fatalf("unpublished after the pass: %v, %v; want parked-5, young-3", unpublished, rows.Err())
	}

	got := readRecords(t, kafka, 2)
	if len(got) != 2 {
		t.Fatalf("%d records in the topic, want 2", len(got))
	}
	for i, want := range []string{"lost-1", "lost-2"} {
		var eventID string
		for _, h := range got[i].Headers {
			if h.Key == taskevent.HeaderEventID {
				eventID = string(h.Value)
			}
		}
		if eventID != want || string(got[i].Key) != "task-a" || got[i].Partition != got[0].Partition {
			t.Fatalf("record %d: event id %q key %q partition %d; want %s, task-a, one partition in order", i, eventID, got[i].Key, got[i].Partition, want)
		}
	}
	res, err = b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 0 {
		t.Fatalf("second pass = %+v, %v; want nothing republished", res, err)
	}
}

// The issue-13 case end to end: the slot is dropped and recreated (as after
// ErrSlotLost) with rows written in between, which the new slot never
// streams; a reconciler pass publishes them, so every row reaches the topic.
func TestSlotRecreatedRowsReachTheTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	producer := newProducer(t, kafka)
	b := setup(t, Config{Producer: producer, RepublishAfter: 2 * time.Second, Topic: kafka.Topic})
	slot := "s_" + b.db.Name
	startRelay := func() (stop func()) {
		t.Helper()
		r, err := cdc.New(cdc.Config{DatabaseURL: b.db.URL, Brokers: kafka.Brokers, Topic: kafka.Topic, SlotName: slot, PublicationName: "p_" + b.db.Name,
			FlushInterval: 20 * time.Millisecond, StatusInterval: 100 * time.Millisecond, Logger: b.r.log})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(rctx) }()
		testenv.Eventually(t, 10*time.Second, "relay streaming", func() bool { return r.ConfirmedLSN() != 0 })
		return func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("relay: %v", err)
			}
		}
	}
	insert := func(id string) {
		t.Helper()
		payload := `{"id":"` + id + `"}`
		if _, err := b.db.Pool.Exec(ctx, `INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $1, 1, 'TaskCreated', $2, $3)`, id, payload, sum([]byte(payload))); err != nil {
			t.Fatal(err)
		}
	}
	unpublished := func() int {
		var n int
		if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	stop := startRelay()
	insert("before-loss")
	testenv.Eventually(t, 10*time.Second, "first row published by the relay", func() bool { return unpublished() == 0 })
	stop()
	if _, err := b.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err != nil {
		t.Fatal(err)
	}
	insert("between-1")
	insert("between-2")
	stop = startRelay() // a new slot: it starts after the rows above
	defer stop()
	insert("after-recreate")
	testenv.Eventually(t, 10*time.Second, "row after the new slot published by the relay", func() bool {
		var pub bool
		return b.db.Pool.QueryRow(ctx, `SELECT outbox_published_at(outbox_event) IS NOT NULL FROM outbox_event WHERE outbox_id = 'after-recreate'`).Scan(&pub) == nil && pub
	})
	if n := unpublished(); n != 2 {
		t.Fatalf("%d rows unpublished after the slot was recreated, want the 2 written in between", n)
	}
	time.Sleep(2 * time.Second) // older than RepublishAfter
	res, err := b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 2 {
		t.Fatalf("pass = %+v, %v; want 2 republished", res, err)
	}
	seen := map[string]bool{}
	for _, r := range readRecords(t, kafka, 4) {
		seen[string(r.Key)] = true
	}
	for _, id := range []string{"before-loss", "between-1", "between-2", "after-recreate"} {
		if !seen[id] {
			t.Errorf("row %s never reached the topic", id)
		}
	}
}

// A republication the broker does not acknowledge (here: no broker answers
// within the delivery timeout) is recorded on its row (REPUBLISH_FAILED,
// one attempt more), which stays unpublished for the next pass; the pass
// itself does not fail.
func TestPassRecordsFailedRepublication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	down, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"), kgo.RecordDeliveryTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(down.Close)
	b := setup(t, Config{Producer: down, RepublishAfter: time.Minute})
	payload := `{"n":1}`
	if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at)
VALUES ('lost', 'task-a', 1, 'TaskCreated', $1, $2, now() - interval '1 hour')`, payload, sum([]byte(payload))); err != nil {
		t.Fatal(err)
	}
	res, err := b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 0 {
		t.Fatalf("pass = %+v, %v; want no error, nothing republished", res, err)
	}
	s, err := outbox.Get(ctx, b.db.Pool, "lost")
	if err != nil {
		t.Fatal(err)
	}
	if s.PublishedAt != nil || s.ParkedAt != nil || s.Attempts != 1 || s.LastErrorCode != cdc.CodeRepublishFailed || s.LastError == "" {
		t.Fatalf("row after the failed republication = %+v; want unpublished, 1 attempt, %s", s, cdc.CodeRepublishFailed)
	}
}

// Issue 13, the publication case end to end: outbox_event is dropped from
// the relay's publication while it streams, rows are written, the
// publication is fixed (ALTER PUBLICATION ... ADD TABLE). The relay stops
// streaming while the publication is wrong and resumes after the fix by
// itself (Run never returns); pgoutput left the rows of the gap out of the
// slot's stream, so they stay unpublished — never marked without being
// produced — until a reconciler pass republishes them: every row reaches
// the topic with its event id, and every row marked published is in it.
func TestPublicationRepairedRowsReachTheTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	producer := newProducer(t, kafka)
	b := setup(t, Config{Producer: producer, RepublishAfter: 2 * time.Second, Topic: kafka.Topic})
	pub := "p_" + b.db.Name
	r, err := cdc.New(cdc.Config{DatabaseURL: b.db.URL, Brokers: kafka.Brokers, Topic: kafka.Topic, SlotName: "s_" + b.db.Name, PublicationName: pub,
		FlushInterval: 20 * time.Millisecond, StatusInterval: 100 * time.Millisecond, SlotSampleInterval: 100 * time.Millisecond, Logger: b.r.log})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	}()
	testenv.Eventually(t, 10*time.Second, "relay streaming", func() bool { return r.ConfirmedLSN() != 0 })
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := b.db.Pool.Exec(ctx, q, args...); err != nil {
			t.Fatal(err)
		}
	}
	insert := func(id string) {
		t.Helper()
		payload := `{"id":"` + id + `"}`
		exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $1, 1, 'TaskCreated', $2, $3)`, id, payload, sum([]byte(payload)))
	}
	published := func(id string) bool {
		var p bool
		return b.db.Pool.QueryRow(ctx, `SELECT outbox_published_at(outbox_event) IS NOT NULL FROM outbox_event WHERE outbox_id = $1`, id).Scan(&p) == nil && p
	}

	insert("before-drop")
	testenv.Eventually(t, 10*time.Second, "row before the drop published by the relay", func() bool { return published("before-drop") })
	exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox_event`)
	testenv.Eventually(t, 10*time.Second, "relay reports the mismatch", func() bool { return errors.Is(r.Health(), cdc.ErrPublicationMismatch) })
	insert("gap-1")
	insert("gap-2")
	exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox_event`)
	testenv.Eventually(t, 10*time.Second, "relay healthy again", func() bool { return r.Health() == nil })
	insert("after-fix")
	testenv.Eventually(t, 10*time.Second, "row after the fix published by the relay", func() bool { return published("after-fix") })
	for _, id := range []string{"gap-1", "gap-2"} {
		if published(id) {
			t.Fatalf("%s marked published, but the slot never streamed it and no one republished it", id)
		}
	}
	select {
	case err := <-done:
		t.Fatalf("relay returned %v during the mismatch", err)
	default:
	}

	time.Sleep(2 * time.Second) // older than RepublishAfter
	res, err := b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 2 {
		t.Fatalf("pass = %+v, %v; want the 2 rows of the gap republished", res, err)
	}
	ids := []string{"before-drop", "gap-1", "gap-2", "after-fix"}
	seen := map[string]bool{}
	for _, rec := range readRecords(t, kafka, len(ids)) {
		for _, h := range rec.Headers {
			if h.Key == taskevent.HeaderEventID {
				seen[string(h.Value)] = true
			}
		}
	}
	for _, id := range ids {
		if !seen[id] || !published(id) {
			t.Errorf("row %s: in the topic %v, marked published %v; want both", id, seen[id], published(id))
		}
	}
	var markedNotProduced int
	if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NOT NULL AND NOT (outbox_id = ANY($1))`,
		keys(seen)).Scan(&markedNotProduced); err != nil || markedNotProduced != 0 {
		t.Fatalf("%d rows marked published without a record in the topic (%v)", markedNotProduced, err)
	}
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A row the slot did not deliver whose record is refused for good (here:
// over the producer's 1 MiB limit, MESSAGE_TOO_LARGE) is parked by the
// pass, as the relay parks it, instead of being produced again at every
// pass; the other rows of the pass are republished.
func TestPassParksARefusedRepublication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafka := testenv.NewKafka(t)
	b := setup(t, Config{Producer: newProducer(t, kafka), RepublishAfter: time.Minute, Topic: kafka.Topic})
	small, huge := `{"n":1}`, `{"pad":"`+strings.Repeat("x", 2<<20)+`"}`
	for _, r := range []struct{ id, payload string }{{"huge", huge}, {"small", small}} {
		if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at)
VALUES ($1, $1, 1, 'TaskCreated', $2, $3, now() - interval '1 hour')`, r.id, r.payload, sum([]byte(r.payload))); err != nil {
			t.Fatal(err)
		}
	}
	res, err := b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 1 {
		t.Fatalf("pass = %+v, %v; want the small row republished", res, err)
	}
	s, err := outbox.Get(ctx, b.db.Pool, "huge")
	if err != nil {
		t.Fatal(err)
	}
	if s.ParkedAt == nil || s.PublishedAt != nil || s.LastErrorCode != "MESSAGE_TOO_LARGE" || s.Attempts != 1 {
		t.Fatalf("huge row after the pass = %+v; want parked, MESSAGE_TOO_LARGE, 1 attempt", s)
	}
	res, err = b.r.Pass(ctx)
	if err != nil || res.OutboxRepublished != 0 {
		t.Fatalf("second pass = %+v, %v; want nothing republished", res, err)
	}
	if s, _ := outbox.Get(ctx, b.db.Pool, "huge"); s.Attempts != 1 {
		t.Errorf("the parked row was tried again: %d attempts", s.Attempts)
	}
}

// newProducer is an acks=all producer on kafka, closed when t ends.
func newProducer(t *testing.T, kafka *testenv.Kafka) *kgo.Client {
	t.Helper()
	p, err := kgo.NewClient(kgo.SeedBrokers(kafka.Brokers...), kgo.RequiredAcks(kgo.AllISRAcks()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// readRecords reads the task-events topic from the start until it has n
// records or 10 s passed, and returns what it read.
func readRecords(t *testing.T, kafka *testenv.Kafka, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kafka.Brokers...), kgo.ConsumeTopics(kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) < n && ctx.Err() == nil {
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) { got = append(got, r) })
	}
	return got
}
