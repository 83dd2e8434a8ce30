package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// parkedRow writes a TaskCreated outbox row of taskID and parks it as the
// relay does for a record the broker refuses.
func parkedRow(t *testing.T, db *testenv.DB, taskID string) string {
	t.Helper()
	ctx := context.Background()
	ev := mustEvent(t, taskID)
	if ok, err := outbox.InsertOnce(ctx, db.Pool, ev); err != nil || !ok {
		t.Fatalf("InsertOnce = %v, %v", ok, err)
	}
	if ok, err := outbox.Park(ctx, db.Pool, ev.EventID, "MESSAGE_TOO_LARGE", "too large"); err != nil || !ok {
		t.Fatalf("Park = %v, %v", ok, err)
	}
	return ev.EventID
}

// `converge outbox list|show|discard|republish`: a parked row is listed,
// discarded once with who and why (a second decision is refused); another
// is republished with its original event id and marked published; bad
// requests (no reason, unknown id, a row that is not parked) change nothing.
func TestOutboxCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	kafka := testenv.NewKafka(t)
	env := &runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	discard := parkedRow(t, db, "task-discard")
	again := parkedRow(t, db, "task-republish")

	if err := (&OutboxListCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, Limit: 10}).Run(env); err != nil {
		t.Fatal(err)
	}
	if err := (&OutboxShowCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: discard}).Run(env); err != nil {
		t.Fatal(err)
	}
	if err := (&OutboxShowCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: "no-such-row"}).Run(env); !errors.Is(err, outbox.ErrNotFound) {
		t.Errorf("show of an unknown id = %v, want ErrNotFound", err)
	}
	if err := (&OutboxDiscardCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: discard, Reason: "  ", By: "ops"}).Run(env); !errors.Is(err, outbox.ErrReasonRequired) {
		t.Errorf("discard with a blank reason = %v, want ErrReasonRequired", err)
	}
	if err := (&OutboxDiscardCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: discard, Reason: "test event, never needed", By: "ops"}).Run(env); err != nil {
		t.Fatal(err)
	}
	if err := (&OutboxDiscardCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: discard, Reason: "again", By: "ops"}).Run(env); !errors.Is(err, outbox.ErrDecided) {
		t.Errorf("second discard = %v, want ErrDecided", err)
	}
	s, err := outbox.Get(ctx, db.Pool, discard)
	if err != nil {
		t.Fatal(err)
	}
	if s.Decision != outbox.DecisionDiscarded || s.DecidedBy != "ops" || s.Reason != "test event, never needed" || s.PublishedAt != nil {
		t.Fatalf("discarded row = %+v", s)
	}

	rep := &OutboxRepublishCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, KafkaBrokers: kafka.Brokers, Topic: kafka.Topic, Reason: "broker limit raised", By: "ops"}
	rep.ID = discard
	if err := rep.Run(env); !errors.Is(err, outbox.ErrDecided) {
		t.Errorf("republish of a discarded row = %v, want ErrDecided", err)
	}
	rep.ID = again
	if err := rep.Run(env); err != nil {
		t.Fatal(err)
	}
	s, err = outbox.Get(ctx, db.Pool, again)
	if err != nil {
		t.Fatal(err)
	}
	if s.Decision != outbox.DecisionRepublished || s.PublishedAt == nil || s.Attempts != 2 || s.DecidedBy != "ops" {
		t.Fatalf("republished row = %+v; want republished, published, 2 attempts", s)
	}
	if err := rep.Run(env); !errors.Is(err, outbox.ErrDecided) {
		t.Errorf("second republish = %v, want ErrDecided", err)
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(kafka.Brokers...), kgo.ConsumeTopics(kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var got *kgo.Record
	for got == nil && pctx.Err() == nil {
		cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) { got = r })
	}
	if got == nil {
		t.Fatal("no republished record in the topic")
	}
	want := taskevent.Headers(again, taskevent.TypeTaskCreated, 1, s.PayloadSHA256, "")
	if string(got.Key) != "task-republish" || string(got.Value) != string(s.Payload) || string(got.Headers[0].Value) != want[0][1] {
		t.Fatalf("republished record key %q headers %v; want the row's task id and event id %s", got.Key, got.Headers, again)
	}
}

// `converge outbox republish --unpublished` runs the reconciler's
// republication once, on demand (issue 13): the rows neither published nor
// parked older than --older-than reach the topic with their original key
// and event id, oldest first, and are marked published; a younger row, a
// parked row and a published row are left alone; a second run finds
// nothing. Flags that do not go together are refused before anything runs.
func TestOutboxRepublishUnpublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	kafka := testenv.NewKafka(t)
	env := &runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	row := func(taskID, age string) string {
		t.Helper()
		ev := mustEvent(t, taskID)
		if ok, err := outbox.InsertOnce(ctx, db.Pool, ev); err != nil || !ok {
			t.Fatalf("InsertOnce = %v, %v", ok, err)
		}
		if _, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET created_at = now() - $2::interval WHERE outbox_id = $1`, ev.EventID, age); err != nil {
			t.Fatal(err)
		}
		return ev.EventID
	}
	lost1 := row("task-lost-1", "2 hours")
	lost2 := row("task-lost-2", "1 hour")
	young := row("task-young", "10 seconds")
	parked := parkedRow(t, db, "task-parked")
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET created_at = now() - interval '1 hour' WHERE outbox_id = $1`, parked); err != nil {
		t.Fatal(err)
	}
	done := row("task-done", "1 hour")
	if _, err := outbox.MarkPublished(ctx, db.Pool, []string{done}); err != nil {
		t.Fatal(err)
	}

	base := OutboxRepublishCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, KafkaBrokers: kafka.Brokers, Topic: kafka.Topic, OlderThan: time.Minute, Limit: 10}
	for name, change := range map[string]func(*OutboxRepublishCmd){
		"neither an id nor --unpublished": func(*OutboxRepublishCmd) {},
		"both an id and --unpublished":    func(c *OutboxRepublishCmd) { c.ID, c.Unpublished, c.Reason = parked, true, "x" },
		"--unpublished with --reason":     func(c *OutboxRepublishCmd) { c.Unpublished, c.Reason = true, "x" },
		"--unpublished with --by":         func(c *OutboxRepublishCmd) { c.Unpublished, c.By = true, "ops" },
		"--unpublished --limit 0":         func(c *OutboxRepublishCmd) { c.Unpublished, c.Limit = true, 0 },
		"--unpublished --older-than 0":    func(c *OutboxRepublishCmd) { c.Unpublished, c.OlderThan = true, 0 },
		"an id without --reason":          func(c *OutboxRepublishCmd) { c.ID = parked },
	} {
		cmd := base
		change(&cmd)
		if err := cmd.Run(env); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}

	cmd := base
	cmd.Unpublished = true
	if err := cmd.Run(env); err != nil {
		t.Fatal(err)
	}
	state := func(id string) outbox.Stored {
		t.Helper()
		s, err := outbox.Get(ctx, db.Pool, id)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, id := range []string{lost1, lost2} {
		if s := state(id); s.PublishedAt == nil || s.Attempts != 1 || s.Decision != "" {
			t.Errorf("lost row %s after the run: %+v; want published once, no decision", id, s)
		}
	}
	if s := state(young); s.PublishedAt != nil {
		t.Errorf("young row published: %+v", s)
	}
	if s := state(parked); s.PublishedAt != nil || s.Decision != "" {
		t.Errorf("parked row touched: %+v", s)
	}
	if s := state(done); s.Attempts != 1 {
		t.Errorf("published row produced again: %+v", s)
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(kafka.Brokers...), kgo.ConsumeTopics(kafka.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	got := map[string]string{} // event id -> key
	for len(got) < 2 && pctx.Err() == nil {
		cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == taskevent.HeaderEventID {
					got[string(h.Value)] = string(r.Key)
				}
			}
		})
	}
	if len(got) != 2 || got[lost1] != "task-lost-1" || got[lost2] != "task-lost-2" {
		t.Fatalf("records in the topic (event id -> key) = %v; want the two lost rows with their task ids", got)
	}

	if err := cmd.Run(env); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{lost1, lost2} {
		if s := state(id); s.Attempts != 1 {
			t.Errorf("second run produced %s again: %+v", id, s)
		}
	}
}

func mustEvent(t *testing.T, taskID string) *taskevent.Event {
	t.Helper()
	now := time.Now().UTC()
	ev, err := outbox.NewEvent(taskevent.TypeTaskCreated, taskevent.Task{TaskID: taskID, Status: taskevent.StatusQueued, Version: 1,
		OutputFormat: "jcs", InputSHA256: "0000000000000000000000000000000000000000000000000000000000000000", InputSize: 2,
		CreatedAt: now, UpdatedAt: now}, now)
	if err != nil {
		t.Fatal(err)
	}
	return &ev
}

// `converge inbox conflicts` lists what the worker recorded for a reused
// message id; --limit 0 is refused.
func TestInboxConflictsCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	env := &runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := (&InboxConflictsCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, Limit: 10}).Run(env); err != nil {
		t.Fatal(err)
	}
	d := inbox.Delivery{Consumer: "converge-worker", MessageID: "evt-1", PayloadSHA256: strings.Repeat("b", 64), Topic: "t", Partition: 2, Offset: 7}
	if err := inbox.InsertConflict(ctx, db.Pool, d, strings.Repeat("a", 64)); err != nil {
		t.Fatal(err)
	}
	cs, err := inbox.ListConflicts(ctx, db.Pool, 10)
	if err != nil || len(cs) != 1 || cs[0].MessageID != "evt-1" || cs[0].Offset != 7 || cs[0].StoredSHA256 != strings.Repeat("a", 64) {
		t.Fatalf("ListConflicts = %+v, %v", cs, err)
	}
	if err := (&InboxConflictsCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, Limit: 10}).Run(env); err != nil {
		t.Fatal(err)
	}
	if err := (&InboxConflictsCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, Limit: 0}).Run(env); err == nil {
		t.Fatal("--limit 0 accepted")
	}
}
