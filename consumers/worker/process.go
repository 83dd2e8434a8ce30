package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
)

// handle processes one record once. It returns the outcome, or an error
// that Retryable classifies.
func (w *Worker) handle(ctx context.Context, r *kgo.Record) (string, error) {
	hdr := headers(r)
	if t, ok := hdr[taskevent.HeaderEventType]; ok && !drives(t) {
		return OutcomeIgnored, nil
	}
	ev, err := verifyRecord(r, hdr)
	if err != nil {
		return "", err
	}
	if !drives(ev.EventType) {
		if t, ok := hdr[taskevent.HeaderEventType]; ok {
			return "", &DeterministicError{Code: CodeEventTypeMismatch, Err: fmt.Errorf("header %s, value %s", t, ev.EventType)}
		}
		return OutcomeIgnored, nil
	}
	if err := w.faults.ErrKey(fault.WorkerProcessError, ev.TaskID, ev.Task.InputSHA256); err != nil {
		return "", &DeterministicError{Code: CodeInjectedProcessingError, Err: err}
	}
	return w.process(ctx, r, ev, hdr[taskevent.HeaderPayloadSHA256])
}

// drives reports whether an event type asks the worker to drive its task:
// TaskCreated, and TaskRedriveRequested from the reconciler.
func drives[T string | []byte](eventType T) bool {
	return string(eventType) == taskevent.TypeTaskCreated || string(eventType) == taskevent.TypeTaskRedriveRequested
}

// eventType returns the value of r's event-type header
// (taskevent.HeaderEventType; the last one, as headers keeps it) without
// copying it, and whether r has one. runOf reads it for every record it
// passes over, most of them events the worker ignores: headers would copy
// all of a record's headers into a new map.
func eventType(r *kgo.Record) ([]byte, bool) {
	var v []byte
	found := false
	for _, kv := range r.Headers {
		if kv.Key == taskevent.HeaderEventType {
			v, found = kv.Value, true
		}
	}
	return v, found
}

// headers returns r's headers as a map (the last value of a repeated key).
func headers(r *kgo.Record) map[string]string {
	h := make(map[string]string, len(r.Headers))
	for _, kv := range r.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return h
}

// verifyRecord checks a record against the contract of package taskevent
// (taskevent.CheckRecord); a breach is deterministic, with its code.
func verifyRecord(r *kgo.Record, hdr map[string]string) (*taskevent.Event, error) {
	ev, err := taskevent.CheckRecord(r.Key, r.Value, hdr)
	var ce *taskevent.ContractError
	if errors.As(err, &ce) {
		return nil, &DeterministicError{Code: ce.Code, Err: ce.Err}
	}
	return ev, err
}

// job is one TaskCreated delivery being processed.
type job struct {
	rec      *kgo.Record
	ev       *taskevent.Event
	sha      string // payload SHA-256 (the inbox's payload hash)
	task     taskevent.Task
	effect   ledger.Effect
	planned  bool   // this delivery inserted the effect row
	artifact []byte // canonical bytes, the effect's request
	// written: the effect is performed as part of a run, which wrote the
	// run's objects together (artifact.Store.PutManyUnsynced) with writeErr
	// this one's outcome, and syncs the artifact store's directory once for
	// all of them before their completion; perform reads it back.
	written  bool
	writeErr error
	// idx is the record's index in its run's records (runOf).
	idx int
}

// process runs the worker protocol for a verified TaskCreated event (seed 6,
// 7, 7.1, 10): intake transaction, effect, completion transaction.
func (w *Worker) process(ctx context.Context, r *kgo.Record, ev *taskevent.Event, sha string) (string, error) {
	j := &job{rec: r, ev: ev, sha: sha}
	var outcome string
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var err error
		outcome, err = w.intake(ctx, tx, j)
		return err
	})
	if err != nil {
		return "", err
	}
	if outcome != "" {
		return outcome, nil
	}
	if j.planned {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Started)).Inc()
	}
	return w.execute(ctx, j)
}

// intake is the first transaction: register the message in the inbox, move
// the task queued -> running, canonicalize the document and write the
// effect's ledger row before the effect is attempted. A non-empty outcome
// means the delivery is finished (duplicate, conflict, failed transform).
func (w *Worker) intake(ctx context.Context, tx pgx.Tx, j *job) (string, error) {
	group, ev := w.cfg.Group, j.ev
	inserted, err := inbox.Register(ctx, tx, group, ev.EventID, j.sha, w.lease)
	if err != nil {
		return "", err
	}
	if !inserted {
		row, err := inbox.Lock(ctx, tx, group, ev.EventID)
		if err != nil {
			return "", err
		}
		if row.PayloadSHA256 != j.sha {
			w.log.ErrorContext(ctx, "message id reused with a different payload", slog.String("event_id", ev.EventID),
				slog.String("stored_sha256", row.PayloadSHA256), slog.String("payload_sha256", j.sha))
			return OutcomeConflict, inbox.InsertConflict(ctx, tx, inbox.Delivery{Consumer: group, MessageID: ev.EventID,
				PayloadSHA256: j.sha, Topic: j.rec.Topic, Partition: j.rec.Partition, Offset: j.rec.Offset}, row.PayloadSHA256)
		}
		if row.State != inbox.Processing {
			if err := inbox.Touch(ctx, tx, group, ev.EventID); err != nil {
				return "", err
			}
			return OutcomeDuplicate, nil
		}
		// processing: an earlier delivery stopped mid-way, or another
		// instance is processing it now (a rebalance moved the partition
		// while its attempt runs). Resume it once its lease allows (seed
		// 6); the ledger makes the effect safe to resume (seed 13.3).
		if err := inbox.Acquire(ctx, tx, group, ev.EventID, row, w.lease); err != nil {
			return "", err
		}
	}
	// The common case, a queued task, reads the document and the live
	// effect in the round trip that starts the task.
	var (
		started             task.Changed
		doc                 []byte
		docFound, liveFound bool
		live                ledger.Effect
	)
	b := &pgx.Batch{}
	task.QueueStartIfQueuedReadingDocument(b, ev.TaskID, ev.TaskVersion, &started, &doc, &docFound)
	ledger.QueueLive(b, ev.TaskID, &live, &liveFound)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return "", err
	}
	t := started.Task
	if !started.Applied {
		if w.afterStartMissed != nil {
			w.afterStartMissed()
		}
		var found bool
		t, found, err = task.Get(ctx, tx, ev.TaskID)
		switch {
		case err != nil:
			return "", err
		case !found:
			// Not found may mean not visible yet (ErrNotYetVisible).
			return "", &DeterministicError{Code: CodeTaskNotFound, Err: fmt.Errorf("task %s: %w", ev.TaskID, ErrNotYetVisible)}
		case t.Version < ev.TaskVersion:
			// The event's transaction wrote this version (a dead-letter
			// replay re-opening the task): what this session sees is
			// older, so that transaction is not visible yet either.
			return "", &DeterministicError{Code: CodeTaskVersionConflict,
				Err: fmt.Errorf("task %s is %s at version %d, event version %d: %w", t.TaskID, t.Status, t.Version, ev.TaskVersion, ErrNotYetVisible)}
		case t.Status == taskevent.StatusQueued:
			// At a version the start's compare-and-set accepts (older ones
			// are the case above): that statement did not see the row
			// version this later one sees. A transaction became visible
			// between the two: the event's own (issue 9's window; seen
			// under load on 2026-12-07, where this was dead-lettered as
			// TASK_VERSION_CONFLICT and a valid task failed), or a
			// dead-letter replay re-opening the task. This statement's
			// snapshot sees it, so the start is made again here; should it
			// still not apply, the task changed once more and the attempt
			// is retried.
			again, err := task.StartIfQueued(ctx, tx, ev.TaskID, ev.TaskVersion)
			if err != nil {
				return "", err
			}
			if !again.Applied {
				return "", fmt.Errorf("task %s was queued at version %d and then changed before its start (event version %d): %w",
					t.TaskID, t.Version, ev.TaskVersion, errConcurrentChange)
			}
			t = again.Task // started: its document and live effect are read below
		case t.Status == taskevent.StatusRunning:
			// resumed below with the task's current attempt
		case taskevent.Terminal(t.Status):
			if _, err := inbox.Finish(ctx, tx, group, ev.EventID, inbox.Completed,
				map[string]any{"task_version": t.Version, "task_status": t.Status}); err != nil {
				return "", err
			}
			if t.Status == taskevent.StatusCancelled {
				return OutcomeCancelled, nil // its CAS on queued refused: never started
			}
			return OutcomeDuplicate, nil
		default:
			return "", &DeterministicError{Code: CodeTaskVersionConflict,
				Err: fmt.Errorf("task %s is %s at version %d, event version %d", t.TaskID, t.Status, t.Version, ev.TaskVersion)}
		}
		// resumed, or started by the second try: the batch's reads were made
		// before the start did not apply; read them again in this
		// transaction
		if doc, docFound, err = task.Document(ctx, tx, t.TaskID); err != nil {
			return "", err
		}
		if live, liveFound, err = ledger.Live(ctx, tx, t.TaskID); err != nil {
			return "", err
		}
	}
	j.task = t
	if !docFound {
		return "", &DeterministicError{Code: CodeTaskInputNotFound, Err: fmt.Errorf("task %s", t.TaskID)}
	}
	out, outSHA, err := task.CanonicalInput(doc, t.InputSHA256)
	if err != nil {
		var ce *canon.Error
		if !errors.As(err, &ce) {
			return "", fmt.Errorf("canonicalize task %s: %w", t.TaskID, err)
		}
		// The API validated the document, so this means the validation and
		// the transform disagree; the result is the same every time.
		if err := w.failInTx(ctx, tx, j, ce.Code, nil); err != nil {
			return "", err
		}
		return OutcomeFailed, nil
	}
	j.artifact = out
	// A task re-opened by a dead-letter replay (or re-driven) may have an
	// artifact effect of an earlier attempt whose outcome is not known
	// (planned, started, unknown) or that is verified: resume it with its
	// own attempt and token (seed 7: retry with the same token) instead of
	// writing a second artifact under a new token, which the reconciler
	// could verify next to the first.
	attempt := t.Attempt
	if liveFound {
		attempt = live.Attempt
	}
	want := ledger.NewPut(t.TaskID, attempt, outSHA, int64(len(out)))
	eff, planned, err := ledger.Plan(ctx, tx, want)
	if err != nil {
		return "", err
	}
	if eff.RequestSHA256 != want.RequestSHA256 || eff.RequestSize != want.RequestSize || eff.TaskID != t.TaskID {
		return "", &DeterministicError{Code: CodeEffectRequestMismatch,
			Err: fmt.Errorf("effect %s records request %s (%d bytes), computed %s (%d bytes)", eff.EffectID, eff.RequestSHA256, eff.RequestSize, want.RequestSHA256, want.RequestSize)}
	}
	j.effect, j.planned = eff, planned
	return "", nil
}

// execute performs the effect through the ledger, then completes the task
// (or it ended otherwise: failed).
func (w *Worker) execute(ctx context.Context, j *job) (string, error) {
	v, outcome, err := w.perform(ctx, j)
	if err != nil || outcome != "" {
		return outcome, err
	}
	return w.complete(ctx, j, v.from, v.sha, v.size)
}

// verifiedEffect is an effect perform found verified: the ledger state it
// read (verified already, or the state the completion moves to verified)
// and the artifact's SHA-256 and size.
type verifiedEffect struct {
	from ledger.State
	sha  string
	size int64
}

// perform performs the delivery's effect through the ledger (seed 7, 7.1):
// observe the store by token first, write only when absent, resolve a
// timeout by observation, read back and verify. It returns the verified
// effect, ready for the completion transaction; or a non-empty outcome when
// the delivery ended otherwise (the task failed, in its own transaction);
// or an error, which Retryable classifies.
func (w *Worker) perform(ctx context.Context, j *job) (verifiedEffect, string, error) {
	eff := j.effect
	switch eff.State {
	case ledger.Verified:
		sha := eff.RequestSHA256
		if eff.ObservedSHA256 != nil {
			sha = *eff.ObservedSHA256
		}
		return verifiedEffect{from: ledger.Verified, sha: sha, size: eff.RequestSize}, "", nil
	case ledger.CompensationRequired, ledger.Compensated, ledger.Failed:
		// An earlier delivery or the reconciler found the effect bad; finish
		// the task as failed (and the compensation, if still required).
		code := CodeArtifactVerificationFailed
		if eff.ErrorCode != nil {
			code = *eff.ErrorCode
		}
		outcome, err := w.fail(ctx, j, "", nil, code)
		if err == nil && eff.State == ledger.CompensationRequired {
			w.compensate(ctx, eff, eff.RequestSize)
		}
		return verifiedEffect{}, outcome, err
	}
	from := eff.State // planned, started, unknown or completed: not known to be done
	// Put looks the token up first and writes only when it is absent
	// (seed 13.3: an object already there is resolved by observation,
	// never written twice; its name is synced all the same); a run wrote
	// its objects already (PutManyUnsynced).
	perr := j.writeErr
	if !j.written {
		_, perr = w.store.Put(eff.Token, j.task.TaskID, eff.Attempt, j.artifact)
	}
	switch {
	case perr == nil, errors.Is(perr, artifact.ErrTokenConflict):
		// a conflict is caught by the read-back below
	case errors.Is(perr, artifact.ErrInvalidToken):
		outcome, err := w.fail(ctx, j, ledger.Failed, func(tx pgx.Tx) (bool, error) {
			return ledger.MarkFailed(ctx, tx, eff.EffectID, from, CodeArtifactTokenInvalid)
		}, CodeArtifactTokenInvalid)
		return verifiedEffect{}, outcome, err
	case errors.Is(perr, artifact.ErrTimeout):
		// A timeout is not "did not happen" (seed 7): record unknown,
		// then resolve by observing the same token.
		ok, err := ledger.MarkUnknown(ctx, w.pool, eff.EffectID, from)
		if err != nil {
			return verifiedEffect{}, "", err
		}
		if !ok {
			return verifiedEffect{}, "", fmt.Errorf("effect %s: %w", eff.EffectID, errConcurrentChange)
		}
		w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Unknown)).Inc()
		from = ledger.Unknown
	default:
		return verifiedEffect{}, "", fmt.Errorf("put artifact %s: %w", eff.Token, perr)
	}
	obs, err := w.store.Observe(eff.Token)
	if err != nil {
		// Absent after the write (or after a timeout that did not commit):
		// retry with the same token.
		return verifiedEffect{}, "", fmt.Errorf("read back artifact %s: %w", eff.Token, err)
	}
	if !ledger.Verify(obs, eff) {
		w.log.ErrorContext(ctx, "artifact verification failed", slog.String("task_id", j.task.TaskID), slog.String("token", eff.Token),
			slog.String("expected_sha256", eff.RequestSHA256), slog.String("observed_sha256", obs.SHA256),
			slog.Int64("expected_size", eff.RequestSize), slog.Int64("observed_size", obs.Size))
		outcome, err := w.fail(ctx, j, ledger.CompensationRequired, func(tx pgx.Tx) (bool, error) {
			return ledger.RequireCompensation(ctx, tx, eff.EffectID, from, &obs.SHA256, CodeArtifactVerificationFailed)
		}, CodeArtifactVerificationFailed)
		if err == nil {
			eff.State, eff.ObservedSHA256 = ledger.CompensationRequired, &obs.SHA256
			w.compensate(ctx, eff, obs.Size)
		}
		return verifiedEffect{}, outcome, err
	}
	if err := w.faults.Err(fault.WorkerAfterArtifactWrite); err != nil {
		return verifiedEffect{}, "", err
	}
	return verifiedEffect{from: from, sha: obs.SHA256, size: obs.Size}, "", nil
}

// complete is the completion transaction (seed 10): inbox -> completed,
// task running -> completed, effect -> verified, TaskCompleted outbox event.
// Every transaction of the worker touches rows in the order inbox, task,
// effect, outbox, so concurrent deliveries of one message do not deadlock.
func (w *Worker) complete(ctx context.Context, j *job, from ledger.State, sha string, size int64) (string, error) {
	var t taskevent.Task
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var err error
		if t, err = w.completeInTx(ctx, tx, j, from, sha, size); err != nil {
			return err
		}
		_, err = outbox.Insert(ctx, tx, taskevent.TypeTaskCompleted, t)
		return err
	})
	if ledger.OneVerifiedViolation(err) {
		// Another effect of the task was verified meanwhile (an earlier
		// attempt's, by the reconciler): retry; the next intake completes
		// the task with that one, and the reconciler hides this artifact.
		return "", fmt.Errorf("effect %s: another artifact of task %s is verified: %w", j.effect.EffectID, j.task.TaskID, errConcurrentChange)
	}
	if err != nil {
		return "", err
	}
	w.completed(ctx, t, from, sha, size)
	return OutcomeProcessed, nil
}

// completed counts and logs a completion that committed.
func (w *Worker) completed(ctx context.Context, t taskevent.Task, from ledger.State, sha string, size int64) {
	if from != ledger.Verified {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Verified)).Inc()
	}
	if t.CompletedAt != nil {
		w.m.endToEnd.Observe(t.CompletedAt.Sub(t.CreatedAt).Seconds())
	}
	w.log.InfoContext(ctx, "task completed", slog.String("task_id", t.TaskID), slog.Int64("version", t.Version),
		slog.String("artifact_sha256", sha), slog.Int64("artifact_size", size))
}

// completeInTx moves, in one round trip (a batch executed in this order),
// the inbox processing -> completed, the task running -> completed and the
// effect from -> verified (unless already verified); any of them not
// applying is errConcurrentChange (and the transaction is rolled back).
func (w *Worker) completeInTx(ctx context.Context, tx pgx.Tx, j *job, from ledger.State, sha string, size int64) (taskevent.Task, error) {
	var (
		finished, verified bool
		completed          task.Changed
	)
	b := &pgx.Batch{}
	if err := inbox.QueueFinish(b, w.cfg.Group, j.ev.EventID, inbox.Completed,
		map[string]any{"task_version": j.task.Version + 1, "artifact_sha256": sha}, &finished); err != nil {
		return taskevent.Task{}, err
	}
	task.QueueCompleteIfRunning(b, j.task.TaskID, j.task.Version, sha, size, &completed)
	if from != ledger.Verified {
		ledger.QueueMarkVerified(b, j.effect.EffectID, from, &sha, &verified)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return taskevent.Task{}, fmt.Errorf("complete task %s: %w", j.task.TaskID, err)
	}
	switch {
	case !finished:
		return taskevent.Task{}, fmt.Errorf("inbox message %s left processing: %w", j.ev.EventID, errConcurrentChange)
	case !completed.Applied:
		return taskevent.Task{}, fmt.Errorf("task %s left running/v%d: %w", j.task.TaskID, j.task.Version, errConcurrentChange)
	case from != ledger.Verified && !verified:
		return taskevent.Task{}, fmt.Errorf("effect %s left %s: %w", j.effect.EffectID, from, errConcurrentChange)
	}
	return completed.Task, nil
}

// fail is the failure transaction: inbox -> failed, task running -> failed
// with code, the delivery's effect moved to state to by move (when move is
// not nil; its not applying is errConcurrentChange), TaskFailed outbox event.
func (w *Worker) fail(ctx context.Context, j *job, to ledger.State, move func(pgx.Tx) (bool, error), code string) (string, error) {
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var effect func() error
		if move != nil {
			effect = func() error {
				ok, err := move(tx)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("effect %s left %s: %w", j.effect.EffectID, j.effect.State, errConcurrentChange)
				}
				return nil
			}
		}
		return w.failInTx(ctx, tx, j, code, effect)
	})
	if err != nil {
		return "", err
	}
	if move != nil {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(to)).Inc()
	}
	return OutcomeFailed, nil
}

// failInTx moves the inbox to failed and the task running -> failed with
// code, runs effect (when not nil), and writes the TaskFailed outbox event,
// in tx.
func (w *Worker) failInTx(ctx context.Context, tx pgx.Tx, j *job, code string, effect func() error) error {
	ok, err := inbox.Finish(ctx, tx, w.cfg.Group, j.ev.EventID, inbox.Failed, map[string]any{"task_version": j.task.Version + 1, "error_code": code})
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("inbox message %s left processing: %w", j.ev.EventID, errConcurrentChange)
	}
	c, err := task.FailIfRunning(ctx, tx, j.task.TaskID, j.task.Version, code)
	if err != nil {
		return err
	}
	if !c.Applied {
		return fmt.Errorf("task %s left running/v%d: %w", j.task.TaskID, j.task.Version, errConcurrentChange)
	}
	if effect != nil {
		if err := effect(); err != nil {
			return err
		}
	}
	if _, err := outbox.Insert(ctx, tx, taskevent.TypeTaskFailed, c.Task); err != nil {
		return err
	}
	w.log.WarnContext(ctx, "task failed", slog.String("task_id", c.Task.TaskID), slog.Int64("version", c.Task.Version), slog.String("code", code))
	return nil
}

// compensate hides an artifact that failed verification (ledger.Compensate,
// seed 8). A failure leaves the effect compensation_required for the
// reconciler; it is logged, not returned, because the task's outcome is
// already durable.
func (w *Worker) compensate(ctx context.Context, eff ledger.Effect, observedSize int64) {
	c, err := ledger.Compensate(ctx, w.pool, w.store, eff, observedSize)
	if c.HidePlanned {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactHide), string(ledger.Started)).Inc()
	}
	if c.HideVerified {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactHide), string(ledger.Verified)).Inc()
	}
	if c.Applied {
		w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Compensated)).Inc()
	}
	if err != nil {
		w.log.ErrorContext(ctx, "compensation incomplete; left to the reconciler", slog.String("effect_id", eff.EffectID), slog.Any("err", err))
	}
}
