package reconciler

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	dto "github.com/prometheus/client_model/go"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/testenv"
)

// A compensation whose hide timed out after it happened (seed 14) is
// reconciled by observation: the token is gone, so the hide is recorded
// verified without hiding again, and the effect becomes compensated.
func TestCompensationTimeoutReconciledByObservation(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{EffectDeadline: time.Second})
	ctx := context.Background()
	data := []byte(`{"a":1}`)
	tok := b.effectFor(t, ledger.CompensationRequired, data, time.Hour)
	b.put(t, tok, 1, data)
	// The worker's compensation: ledger row first, then a hide that
	// happens but times out.
	e := testenv.RequireEffect(t, b.db.Pool, ledger.KindArtifactPut, tok)
	if h, _, err := ledger.Plan(ctx, b.db.Pool, ledger.NewCompensation(e, sum(data), int64(len(data)))); err != nil || h.State != ledger.Started {
		t.Fatalf("plan hide: %s %v", h.State, err)
	}
	faults := &fault.Set{}
	if err := faults.Arm(fault.ArtifactHideTimeoutAfterCommit, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	workerStore, err := artifact.Open(b.store.Root(), faults)
	if err != nil {
		t.Fatal(err)
	}
	if err := workerStore.Hide(tok); !errors.Is(err, artifact.ErrTimeout) {
		t.Fatalf("hide = %v, want a timeout", err)
	}
	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Compensated != 1 || res.CompensationsObserved != 1 || res.Errors != 0 {
		t.Errorf("pass = %+v, want 1 compensation observed", res)
	}
	if got := b.effect(t, ledger.KindArtifactPut, tok).state; got != ledger.Compensated {
		t.Errorf("effect %s, want compensated", got)
	}
	if got := b.effect(t, "artifact.hide", "compensation-for-"+tok).state; got != ledger.Verified {
		t.Errorf("hide %s, want verified", got)
	}
	if got := b.actions(ActionCompensationObserved); got != 1 {
		t.Errorf("actions{kind=compensation_observed} = %v", got)
	}
}

// A task left queued past TaskDeadline is re-driven once per version by a
// TaskRedriveRequested outbox event; inbox rows of terminal tasks left
// processing are released (unless a worker's lease on them is live); expired in_progress idempotency records without
// a task are removed; unpublished outbox rows are reported.
func TestScansRedriveReleaseResolve(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{TaskDeadline: time.Minute, InboxLease: time.Minute, OutboxThreshold: time.Minute})
	ctx := context.Background()
	stuck := b.effectFor(t, ledger.Verified, []byte(`1`), 0)
	stuckTask := stuck[:len(stuck)-len(".attempt-1")]
	done := b.effectFor(t, ledger.Verified, []byte(`2`), 0)
	doneTask := done[:len(done)-len(".attempt-1")]
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := b.db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`UPDATE task SET status = 'queued', updated_at = now() - interval '1 hour' WHERE task_id = $1`, stuckTask)
	exec(`UPDATE task SET status = 'failed', terminal_error_code = 'X' WHERE task_id = $1`, doneTask)
	exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at)
VALUES ('ev-done', $1, 1, 'TaskFailed', '{}', $2, now() - interval '1 hour')`, doneTask, sum([]byte("x")))
	exec(`INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, last_seen_at)
VALUES ('converge-worker', 'ev-done', $1, 'processing', now() - interval '1 hour')`, sum([]byte("x")))
	// Also stale by last_seen_at, but under a live lease of a worker (seed
	// 6): that delivery is still in its attempt, the row is not released.
	exec(`INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, published_at)
VALUES ('ev-leased', $1, 2, 'TaskFailed', '{}', $2, now() - interval '1 hour', now())`, doneTask, sum([]byte("x")))
	exec(`INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, last_seen_at, locked_by, locked_until)
VALUES ('converge-worker', 'ev-leased', $1, 'processing', now() - interval '1 hour', 'w-1', now() + interval '1 hour')`, sum([]byte("x")))
	exec(`INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, locked_until, expires_at)
VALUES ('s', 'k-expired', $1, 'in_progress', now() - interval '1 minute', now() + interval '1 day')`, sum([]byte("y")))

	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.TasksRedriven != 1 || res.InboxReleased != 1 || res.IdempotencyResolved != 1 || res.OutboxUnpublished != 1 {
		t.Errorf("pass = %+v", res)
	}
	var typ string
	var version int64
	if err := b.db.Pool.QueryRow(ctx, `SELECT event_type, aggregate_version FROM outbox_event WHERE aggregate_id = $1 AND event_type <> 'TaskCreated'`, stuckTask).Scan(&typ, &version); err != nil || typ != "TaskRedriveRequested" || version != 1 {
		t.Errorf("re-drive event %s v%d (%v)", typ, version, err)
	}
	var state string
	_ = b.db.Pool.QueryRow(ctx, `SELECT state FROM inbox_message WHERE message_id = 'ev-done'`).Scan(&state)
	if state != "completed" {
		t.Errorf("inbox %s, want completed", state)
	}
	_ = b.db.Pool.QueryRow(ctx, `SELECT state FROM inbox_message WHERE message_id = 'ev-leased'`).Scan(&state)
	if state != "processing" {
		t.Errorf("leased inbox row %s, want processing (its lease is live)", state)
	}
	// A second pass re-drives nothing more: one re-drive per task version.
	res, err = b.r.Pass(ctx)
	if err != nil || res.TasksRedriven != 0 || res.InboxReleased != 0 || res.IdempotencyResolved != 0 {
		t.Errorf("second pass = %+v %v", res, err)
	}
}

// A dead letter parked or refused whose task has completed since (by
// another route) is resolved by a pass — counted as dead_letter_resolved —
// and no longer counts in converge_deadletter_unresolved; one of a task
// still failed is left to a person.
func TestScanResolvesDeadLettersOfCompletedTasks(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{})
	ctx := context.Background()
	done := b.effectFor(t, ledger.Verified, []byte(`1`), 0)
	doneTask := done[:len(done)-len(".attempt-1")]
	failed := b.effectFor(t, ledger.Verified, []byte(`2`), 0)
	failedTask := failed[:len(failed)-len(".attempt-1")]
	if _, err := b.db.Pool.Exec(ctx, `UPDATE task SET status = 'failed', terminal_error_code = 'X' WHERE task_id = $1`, failedTask); err != nil {
		t.Fatal(err)
	}
	if _, err := b.db.Pool.Exec(ctx, `
UPDATE task SET status = 'completed', version = 2, artifact_sha256 = $2, artifact_size = 1, completed_at = now() WHERE task_id = $1`,
		doneTask, sum([]byte("1"))); err != nil {
		t.Fatal(err)
	}
	store := deadletter.NewStore(b.db.Pool)
	now := time.Now().UTC()
	for i, task := range []string{doneTask, doneTask, failedTask} {
		msg := uuid.NewString()
		d := deadletter.DeadLetter{OriginTopic: "converge.task-events.v1", OriginOffset: int64(i), ConsumerGroup: "converge-worker",
			Key: []byte(task), Value: []byte(`{}`), Headers: []deadletter.Header{}, MessageID: &msg, TaskID: &task,
			ErrorClass: "deterministic", ErrorCode: "X", Attempts: 1, ProcessorVersion: "t", FirstFailureAt: now, LastFailureAt: now}
		if ok, err := store.Insert(ctx, d); err != nil || !ok {
			t.Fatalf("insert dead letter: %v %v", ok, err)
		}
	}
	if _, err := b.db.Pool.Exec(ctx, `UPDATE dead_letter SET state = 'refused', last_replay_at = now() WHERE origin_offset = 1`); err != nil {
		t.Fatal(err)
	}
	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.DeadLettersResolved != 2 || b.actions(ActionDeadLetterResolved) != 2 {
		t.Errorf("pass = %+v, actions{kind=dead_letter_resolved} = %v, want 2", res, b.actions(ActionDeadLetterResolved))
	}
	var m dto.Metric
	if err := b.r.m.unresolved.Write(&m); err != nil || m.GetGauge().GetValue() != 1 {
		t.Errorf("converge_deadletter_unresolved = %v (%v), want 1 (the failed task's)", m.GetGauge().GetValue(), err)
	}
	var states string
	if err := b.db.Pool.QueryRow(ctx, `SELECT string_agg(state, ',' ORDER BY origin_offset) FROM dead_letter`).Scan(&states); err != nil || states != "resolved,resolved,parked" {
		t.Errorf("states %q %v", states, err)
	}
	if res, err := b.r.Pass(ctx); err != nil || res.DeadLettersResolved != 0 {
		t.Errorf("second pass = %+v %v", res, err)
	}
}
