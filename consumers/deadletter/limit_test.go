package deadletter

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// failAgain makes the redelivery of a replayed task fail again the way the
// worker does: the task fails with code, and both records in flight are
// dead-lettered anew from new origin offsets — the re-published original
// (same message id) and the TaskRedriveRequested event the replay wrote
// (a fresh message id). It returns the two new dead letters' ids, the
// re-drive's last.
func (b *testBundle) failAgain(t *testing.T, taskID string, orig *kgo.Record, code string) (int64, int64) {
	t.Helper()
	if _, err := b.db.Pool.Exec(context.Background(),
		`UPDATE task SET status = 'failed', version = version + 2, terminal_error_code = $2 WHERE task_id = $1`, taskID, code); err != nil {
		t.Fatal(err)
	}
	again := *orig
	again.Offset = b.nextOffset
	b.nextOffset++
	redrive := *orig
	redrive.Offset = b.nextOffset
	b.nextOffset++
	redrive.Headers = nil
	for _, h := range orig.Headers {
		switch h.Key {
		case taskevent.HeaderEventID:
			h.Value = []byte(uuid.Must(uuid.NewV7()).String())
		case taskevent.HeaderEventType:
			h.Value = []byte(taskevent.TypeTaskRedriveRequested)
		}
		redrive.Headers = append(redrive.Headers, h)
	}
	return b.park(t, &again, code), b.park(t, &redrive, code)
}

// The replay limit holds per task: each replay that fails again makes two
// new dead letters (the original record's and the re-drive event's, which
// has a new message id), and replaying the newest one each time still
// counts every replay of the task; the (limit+1)-th is refused whichever
// dead letter is chosen.
func TestReplayLimitHoldsPerTask(t *testing.T) {
	t.Parallel()
	b := setup(t) // MaxReplays 3
	ctx := context.Background()
	code := worker.CodeInjectedProcessingError
	taskID, orig := b.failedTask(t, code)
	newest := b.park(t, orig, code)
	var all []int64
	all = append(all, newest)
	for i := 1; i <= DefaultMaxReplays; i++ {
		res, err := b.svc.Replay(ctx, newest, Request{Reason: "try " + testenv.Itoa(i), By: "erin"})
		if err != nil {
			t.Fatal(err)
		}
		want := "replay " + testenv.Itoa(i) + " of 3 of task " + taskID
		if res.Outcome != OutcomeReplayed || !strings.Contains(res.Message, want) {
			t.Fatalf("replay %d of dead letter %d: %+v, want replayed %q", i, newest, res, want)
		}
		a, r := b.failAgain(t, taskID, orig, code)
		all = append(all, a, r)
		newest = r // the re-drive's dead letter: a message never replayed
	}
	n := b.published(t)
	// Every dead letter of the task still parked is refused now.
	refused := 0
	for _, id := range all {
		d, err := b.svc.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if d.State != StateParked {
			continue
		}
		res, err := b.svc.Replay(ctx, id, Request{Reason: "once more", By: "erin"})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != OutcomeRefused || res.State != StateRefused || !strings.Contains(res.Message, "task "+taskID+" replayed 3 times") {
			t.Errorf("replay of parked dead letter %d past the limit: %+v, want refused", id, res)
		}
		refused++
	}
	if refused != 4 { // the original record's of each failure, the last re-drive's
		t.Errorf("%d parked dead letters refused, want 4", refused)
	}
	if got := b.published(t); got != n {
		t.Errorf("%d records published past the limit", got-n)
	}
	if s := b.scalar(t, `SELECT status FROM task WHERE task_id = $1`, taskID); s != taskevent.StatusFailed {
		t.Errorf("task %v past the limit, want failed", s)
	}
	if sum := b.scalar(t, `SELECT sum(replay_count) FROM dead_letter WHERE task_id = $1`, taskID); sum != int64(DefaultMaxReplays) {
		t.Errorf("task replayed %v times, want %d", sum, DefaultMaxReplays)
	}
}

// A refused dead letter is resolved once its task completed (by another
// route) or failed for another reason: the replay request checks the task
// first and answers a no-op, so it stops counting as unresolved.
func TestRefusedDeadLetterResolvedWhenTaskDone(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxReplays = 1 })
	ctx := context.Background()
	code := worker.CodeInjectedProcessingError
	refuse := func() (string, int64) {
		taskID, orig := b.failedTask(t, code)
		first := b.park(t, orig, code)
		if res, err := b.svc.Replay(ctx, first, Request{Reason: "try 1"}); err != nil || res.Outcome != OutcomeReplayed {
			t.Fatalf("first replay: %+v %v", res, err)
		}
		again, _ := b.failAgain(t, taskID, orig, code)
		if res, err := b.svc.Replay(ctx, again, Request{Reason: "try 2"}); err != nil || res.Outcome != OutcomeRefused {
			t.Fatalf("second replay: %+v %v, want refused", res, err)
		}
		if res, err := b.svc.Replay(ctx, again, Request{Reason: "try 3"}); err != nil || res.Outcome != OutcomeRefused ||
			!strings.Contains(res.Message, "refused earlier") {
			t.Fatalf("third replay: %+v %v, want refused earlier", res, err)
		}
		return taskID, again
	}
	doneTask, doneDL := refuse()
	otherTask, otherDL := refuse()
	unresolved, err := b.svc.Store().Unresolved(ctx)
	if err != nil || unresolved != 4 { // per task: the refused one and the re-drive's parked one
		t.Fatalf("unresolved %d %v, want 4", unresolved, err)
	}
	if _, err := b.db.Pool.Exec(ctx, `
UPDATE task SET status = 'completed', version = version + 2, terminal_error_code = NULL, artifact_sha256 = $2, artifact_size = 1, completed_at = now()
WHERE task_id = $1`, doneTask, sum([]byte("x"))); err != nil {
		t.Fatal(err)
	}
	if _, err := b.db.Pool.Exec(ctx, `UPDATE task SET terminal_error_code = $2 WHERE task_id = $1`, otherTask, worker.CodeArtifactVerificationFailed); err != nil {
		t.Fatal(err)
	}
	n := b.published(t)
	for _, tc := range []struct {
		id   int64
		want string
	}{
		{doneDL, "task " + doneTask + " is already completed; nothing to replay"},
		{otherDL, "task " + otherTask + " failed with " + worker.CodeArtifactVerificationFailed + ", not because of this dead letter; nothing to replay"},
	} {
		res, err := b.svc.Replay(ctx, tc.id, Request{Reason: "task done", By: "frank"})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != OutcomeNoop || res.State != StateResolved || res.Message != tc.want {
			t.Errorf("replay of refused dead letter %d: %+v, want noop resolved %q", tc.id, res, tc.want)
		}
		if d, _ := b.svc.Get(ctx, tc.id); d.State != StateResolved || d.LastReplayBy == nil || *d.LastReplayBy != "frank" {
			t.Errorf("dead letter %d: %+v", tc.id, d)
		}
	}
	if got := b.published(t); got != n {
		t.Errorf("%d records published by no-op replays", got-n)
	}
	if unresolved, _ := b.svc.Store().Unresolved(ctx); unresolved != 2 {
		t.Errorf("unresolved %d, want 2 (the re-drives' parked dead letters)", unresolved)
	}
}

// Resolve marks a dead letter resolved without publishing (no producer
// needed), records who/when/why, keeps its replay count, and is a no-op
// when asked again; a replay of it afterwards is a no-op too.
func TestResolve(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxReplays = 1 })
	ctx := context.Background()
	code := worker.CodeInjectedProcessingError
	noKafka, err := New(Config{Pool: b.db.Pool, Logger: b.svc.cfg.Logger})
	if err != nil {
		t.Fatal(err)
	}
	taskID, orig := b.failedTask(t, code)
	parked := b.park(t, orig, code)
	if _, err := noKafka.Resolve(ctx, parked, Request{Reason: " "}); !errors.Is(err, ErrReasonRequired) {
		t.Errorf("blank reason: %v", err)
	}
	if _, err := noKafka.Resolve(ctx, parked+1000, Request{Reason: "x"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown id: %v", err)
	}
	res, err := noKafka.Resolve(ctx, parked, Request{Reason: "fixed by hand in the database", By: "gina"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Outcome != OutcomeResolved || res.State != StateResolved || res.TaskReopened || !strings.Contains(res.Message, "was parked") {
		t.Fatalf("resolve: %+v", res)
	}
	d, _ := b.svc.Get(ctx, parked)
	if d.State != StateResolved || d.LastReplayBy == nil || *d.LastReplayBy != "gina" || d.LastReplayReason == nil ||
		*d.LastReplayReason != "fixed by hand in the database" || d.LastReplayAt == nil || d.LastReplayOutcome == nil || *d.LastReplayOutcome != res.Message {
		t.Errorf("resolved dead letter %+v", d)
	}
	if res, err := noKafka.Resolve(ctx, parked, Request{Reason: "again"}); err != nil || res.Outcome != OutcomeNoop || res.State != StateResolved {
		t.Errorf("second resolve: %+v %v", res, err)
	}
	if res, err := b.svc.Replay(ctx, parked, Request{Reason: "replay"}); err != nil || res.Outcome != OutcomeNoop || !strings.Contains(res.Message, "already resolved") {
		t.Errorf("replay of a resolved dead letter: %+v %v", res, err)
	}
	if s := b.scalar(t, `SELECT status FROM task WHERE task_id = $1`, taskID); s != taskevent.StatusFailed {
		t.Errorf("task %v after resolve, want failed (untouched)", s)
	}

	// A refused dead letter (limit 1) is resolved too; its replay count stays.
	task2, orig2 := b.failedTask(t, code)
	first := b.park(t, orig2, code)
	if res, err := b.svc.Replay(ctx, first, Request{Reason: "try"}); err != nil || res.Outcome != OutcomeReplayed {
		t.Fatalf("replay: %+v %v", res, err)
	}
	again, redrive := b.failAgain(t, task2, orig2, code)
	if res, err := b.svc.Replay(ctx, again, Request{Reason: "try 2"}); err != nil || res.Outcome != OutcomeRefused {
		t.Fatalf("replay: %+v %v, want refused", res, err)
	}
	for _, id := range []int64{again, redrive, first} {
		if res, err := noKafka.Resolve(ctx, id, Request{Reason: "gave up: input is broken", By: "gina"}); err != nil || res.Outcome != OutcomeResolved {
			t.Errorf("resolve %d: %+v %v", id, res, err)
		}
	}
	if d, _ := b.svc.Get(ctx, first); d.ReplayCount != 1 {
		t.Errorf("replay count %d after resolve, want 1 (kept)", d.ReplayCount)
	}
	if n, _ := b.svc.Store().Unresolved(ctx); n != 0 {
		t.Errorf("%d unresolved dead letters after resolving them all", n)
	}
	if n := b.published(t); n != 1 {
		t.Errorf("%d records published, want 1 (the one replay)", n)
	}
	// Resolves are not replays: the counter holds the replay requests only
	// (one noop, one replayed, one refused).
	for _, o := range []string{OutcomeNoop, OutcomeRefused, OutcomeReplayed} {
		if got := b.replays(o); got != 1 {
			t.Errorf("replays_total{outcome=%s} = %v, want 1", o, got)
		}
	}
}

// ResolveCompleted resolves the parked and refused dead letters whose task
// has completed since, and nothing else.
func TestResolveCompleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	code := worker.CodeInjectedProcessingError
	doneTask, done := b.task(t, taskevent.StatusCompleted, "", []byte(`{"done":1}`))
	parkedDone := b.park(t, done, code)
	refusedDone := b.park(t, &kgo.Record{Topic: done.Topic, Offset: 500, Key: done.Key, Value: done.Value, Headers: done.Headers, Timestamp: done.Timestamp}, code)
	replayedDone := b.park(t, &kgo.Record{Topic: done.Topic, Offset: 501, Key: done.Key, Value: done.Value, Headers: done.Headers, Timestamp: done.Timestamp}, code)
	_, failed := b.failedTask(t, code)
	parkedFailed := b.park(t, failed, code)
	err := pgx.BeginFunc(ctx, b.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE dead_letter SET state = 'refused', last_replay_at = now() WHERE dead_letter_id = $1`, refusedDone); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE dead_letter SET state = 'replayed', replay_count = 1, last_replay_at = now() WHERE dead_letter_id = $1`, replayedDone)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := b.svc.Store().ResolveCompleted(ctx, 1)
	if err != nil || len(got) != 1 || got[0].ID != parkedDone || got[0].TaskID != doneTask || got[0].From != StateParked {
		t.Fatalf("first batch (limit 1): %+v %v", got, err)
	}
	got, err = b.svc.Store().ResolveCompleted(ctx, 10)
	if err != nil || len(got) != 1 || got[0].ID != refusedDone || got[0].From != StateRefused {
		t.Fatalf("second batch: %+v %v", got, err)
	}
	if got, err := b.svc.Store().ResolveCompleted(ctx, 10); err != nil || len(got) != 0 {
		t.Fatalf("third batch: %+v %v, want nothing left", got, err)
	}
	for id, want := range map[int64]string{parkedDone: StateResolved, refusedDone: StateResolved, replayedDone: StateReplayed, parkedFailed: StateParked} {
		d, _ := b.svc.Get(ctx, id)
		if d.State != want {
			t.Errorf("dead letter %d %s, want %s", id, d.State, want)
		}
		if want == StateResolved && (d.LastReplayBy == nil || *d.LastReplayBy != ResolvedBy || d.LastReplayOutcome == nil ||
			*d.LastReplayOutcome != "task "+doneTask+" is already completed; nothing to replay (resolved by the reconciler)") {
			t.Errorf("dead letter %d: %+v", id, d)
		}
	}
}
