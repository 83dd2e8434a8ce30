package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
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
func drives(eventType string) bool {
	return eventType == taskevent.TypeTaskCreated || eventType == taskevent.TypeTaskRedriveRequested
}

func headers(r *kgo.Record) map[string]string {
	h := make(map[string]string, len(r.Headers))
	for _, kv := range r.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return h
}

// verifyRecord checks a record against the contract of package taskevent:
// payload hash header, decodable value, event id header, key.
func verifyRecord(r *kgo.Record, hdr map[string]string) (*taskevent.Event, error) {
	if sum := canon.SHA256Hex(r.Value); hdr[taskevent.HeaderPayloadSHA256] != sum {
		return nil, &DeterministicError{Code: CodePayloadHashMismatch,
			Err: fmt.Errorf("header %q, value hashes to %s", hdr[taskevent.HeaderPayloadSHA256], sum)}
	}
	ev, err := taskevent.Decode(r.Value)
	if err != nil {
		return nil, &DeterministicError{Code: CodeInvalidEvent, Err: err}
	}
	if id := hdr[taskevent.HeaderEventID]; id != ev.EventID {
		return nil, &DeterministicError{Code: CodeEventIDMismatch, Err: fmt.Errorf("header %q, value %q", id, ev.EventID)}
	}
	if string(r.Key) != ev.TaskID {
		return nil, &DeterministicError{Code: CodeKeyMismatch, Err: fmt.Errorf("key %q, task %q", r.Key, ev.TaskID)}
	}
	return ev, nil
}

// job is one TaskCreated delivery being processed.
type job struct {
	rec      *kgo.Record
	ev       *taskevent.Event
	sha      string // payload SHA-256 (the inbox's payload hash)
	task     taskevent.Task
	effect   effectRow
	planned  bool   // this delivery inserted the effect row
	artifact []byte // canonical bytes, the effect's request
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
		w.m.effects.WithLabelValues(kindArtifactPut, effectStarted).Inc()
	}
	return w.execute(ctx, j)
}

// intake is the first transaction: register the message in the inbox, move
// the task queued -> running, canonicalize the document and write the
// effect's ledger row before the effect is attempted. A non-empty outcome
// means the delivery is finished (duplicate, conflict, failed transform).
func (w *Worker) intake(ctx context.Context, tx pgx.Tx, j *job) (string, error) {
	group, ev := w.cfg.Group, j.ev
	inserted, err := insertInbox(ctx, tx, group, ev.EventID, j.sha)
	if err != nil {
		return "", err
	}
	if !inserted {
		row, err := lockInbox(ctx, tx, group, ev.EventID)
		if err != nil {
			return "", err
		}
		if row.PayloadSHA256 != j.sha {
			w.log.ErrorContext(ctx, "message id reused with a different payload", slog.String("event_id", ev.EventID),
				slog.String("stored_sha256", row.PayloadSHA256), slog.String("payload_sha256", j.sha))
			return OutcomeConflict, insertInboxConflict(ctx, tx, conflictRecord{Consumer: group, MessageID: ev.EventID,
				PayloadSHA256: j.sha, StoredSHA256: row.PayloadSHA256, Topic: j.rec.Topic, Partition: j.rec.Partition, Offset: j.rec.Offset})
		}
		if err := touchInbox(ctx, tx, group, ev.EventID); err != nil {
			return "", err
		}
		if row.State != inboxProcessing {
			return OutcomeDuplicate, nil
		}
		// processing: an earlier delivery stopped mid-way; resume it (the
		// ledger makes the effect safe to resume, seed 13.3).
	}
	// The common case, a queued task, reads the document and the live
	// effect in the round trip that starts the task.
	task, ok, in, err := startTaskWithInputs(ctx, tx, ev.TaskID, ev.TaskVersion)
	if err != nil {
		return "", err
	}
	if !ok {
		var found bool
		task, found, err = getTask(ctx, tx, ev.TaskID)
		switch {
		case err != nil:
			return "", err
		case !found:
			return "", &DeterministicError{Code: CodeTaskNotFound, Err: fmt.Errorf("task %s", ev.TaskID)}
		case task.Status == taskevent.StatusRunning:
			// resumed below with the task's current attempt
		case taskevent.Terminal(task.Status):
			if _, err := finishInbox(ctx, tx, group, ev.EventID, inboxCompleted,
				map[string]any{"task_version": task.Version, "task_status": task.Status}); err != nil {
				return "", err
			}
			return OutcomeDuplicate, nil
		default:
			return "", &DeterministicError{Code: CodeTaskVersionConflict,
				Err: fmt.Errorf("task %s is %s at version %d, event version %d", task.TaskID, task.Status, task.Version, ev.TaskVersion)}
		}
	}
	j.task = task
	if !ok {
		// resumed: read what the batch read for a task that started
		if in.doc, in.docFound, err = getDocument(ctx, tx, task.TaskID); err != nil {
			return "", err
		}
		if in.live, in.liveFound, err = liveEffect(ctx, tx, task.TaskID); err != nil {
			return "", err
		}
	}
	doc, found := in.doc, in.docFound
	if !found {
		return "", &DeterministicError{Code: CodeTaskInputNotFound, Err: fmt.Errorf("task %s", task.TaskID)}
	}
	out, err := canon.Transform(doc)
	if err != nil {
		var ce *canon.Error
		if !errors.As(err, &ce) {
			return "", fmt.Errorf("canonicalize task %s: %w", task.TaskID, err)
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
	attempt := task.Attempt
	if in.liveFound {
		attempt = in.live.Attempt
	}
	token := artifact.Token(task.TaskID, attempt)
	want := effectRow{EffectID: token, TaskID: task.TaskID, Attempt: attempt, Kind: kindArtifactPut, Token: token,
		TargetIdentity: "artifact://" + token, State: effectStarted, RequestSHA256: canon.SHA256Hex(out), RequestSize: int64(len(out))}
	eff, planned, err := planEffect(ctx, tx, want)
	if err != nil {
		return "", err
	}
	if eff.RequestSHA256 != want.RequestSHA256 || eff.RequestSize != want.RequestSize || eff.TaskID != task.TaskID {
		return "", &DeterministicError{Code: CodeEffectRequestMismatch,
			Err: fmt.Errorf("effect %s records request %s (%d bytes), computed %s (%d bytes)", eff.EffectID, eff.RequestSHA256, eff.RequestSize, want.RequestSHA256, want.RequestSize)}
	}
	j.effect, j.planned = eff, planned
	return "", nil
}

// execute performs the effect through the ledger (seed 7, 7.1): observe the
// store by token first, write only when absent, resolve a timeout by
// observation, read back and verify, then complete or fail the task.
func (w *Worker) execute(ctx context.Context, j *job) (string, error) {
	eff := j.effect
	switch eff.State {
	case effectVerified:
		sha := eff.RequestSHA256
		if eff.ObservedSHA256 != nil {
			sha = *eff.ObservedSHA256
		}
		return w.complete(ctx, j, effectVerified, sha, eff.RequestSize)
	case effectCompensationRequired, effectCompensated, effectFailed:
		// An earlier delivery or the reconciler found the effect bad; finish
		// the task as failed (and the compensation, if still required).
		code := CodeArtifactVerificationFailed
		if eff.ErrorCode != nil {
			code = *eff.ErrorCode
		}
		outcome, err := w.fail(ctx, j, eff.State, eff.State, nil, code)
		if err == nil && eff.State == effectCompensationRequired {
			sha := eff.RequestSHA256
			if eff.ObservedSHA256 != nil {
				sha = *eff.ObservedSHA256
			}
			w.compensate(ctx, eff, sha, eff.RequestSize)
		}
		return outcome, err
	}
	from := eff.State // planned, started, unknown or completed: not known to be done
	_, err := w.store.Head(eff.Token)
	switch {
	case err == nil:
		// present: resolved by observation, never written twice (seed 13.3)
	case errors.Is(err, artifact.ErrInvalidToken):
		return w.fail(ctx, j, from, effectFailed, nil, CodeArtifactTokenInvalid)
	case errors.Is(err, artifact.ErrNotFound):
		_, perr := w.store.Put(eff.Token, j.task.TaskID, eff.Attempt, j.artifact)
		switch {
		case perr == nil, errors.Is(perr, artifact.ErrTokenConflict):
			// a conflict is caught by the read-back below
		case errors.Is(perr, artifact.ErrTimeout):
			// A timeout is not "did not happen" (seed 7): record unknown,
			// then resolve by observing the same token.
			ok, err := setEffectState(ctx, w.pool, eff.EffectID, from, effectUnknown, nil, nil)
			if err != nil {
				return "", err
			}
			if !ok {
				return "", fmt.Errorf("effect %s: %w", eff.EffectID, errConcurrentChange)
			}
			w.m.effects.WithLabelValues(kindArtifactPut, effectUnknown).Inc()
			from = effectUnknown
		default:
			return "", fmt.Errorf("put artifact %s: %w", eff.Token, perr)
		}
	default:
		return "", fmt.Errorf("head artifact %s: %w", eff.Token, err)
	}
	obs, err := w.store.Observe(eff.Token)
	if errors.Is(err, artifact.ErrNotFound) {
		// Absent after the write (or after a timeout that did not commit):
		// retry with the same token.
		return "", fmt.Errorf("read back artifact %s: %w", eff.Token, err)
	}
	if err != nil {
		return "", fmt.Errorf("read back artifact %s: %w", eff.Token, err)
	}
	if !Verified(obs, j.task.TaskID, eff.Attempt, eff.RequestSize, eff.RequestSHA256) {
		w.log.ErrorContext(ctx, "artifact verification failed", slog.String("task_id", j.task.TaskID), slog.String("token", eff.Token),
			slog.String("expected_sha256", eff.RequestSHA256), slog.String("observed_sha256", obs.SHA256),
			slog.Int64("expected_size", eff.RequestSize), slog.Int64("observed_size", obs.Size))
		outcome, err := w.fail(ctx, j, from, effectCompensationRequired, &obs.SHA256, CodeArtifactVerificationFailed)
		if err == nil {
			w.compensate(ctx, eff, obs.SHA256, obs.Size)
		}
		return outcome, err
	}
	if err := w.faults.Err(fault.WorkerAfterArtifactWrite); err != nil {
		return "", err
	}
	return w.complete(ctx, j, from, obs.SHA256, obs.Size)
}

// Verified reports whether an artifact read back is the one expected: same
// task id and attempt in its metadata, and the bytes actually stored have
// the expected size and SHA-256 (seed 7.1).
func Verified(obs artifact.Observation, taskID string, attempt int, size int64, sha string) bool {
	return obs.Meta.TaskID == taskID && obs.Meta.Attempt == attempt &&
		obs.Size == size && obs.SHA256 == sha && obs.Meta.Size == size && obs.Meta.SHA256 == sha
}

// complete is the completion transaction (seed 10): inbox -> completed,
// task running -> completed, effect -> verified, TaskCompleted outbox event.
// Every transaction of the worker touches rows in the order inbox, task,
// effect, outbox, so concurrent deliveries of one message do not deadlock.
func (w *Worker) complete(ctx context.Context, j *job, from, sha string, size int64) (string, error) {
	var t taskevent.Task
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var err error
		if t, err = w.completeInTx(ctx, tx, j, from, sha, size); err != nil {
			return err
		}
		_, err = insertOutbox(ctx, tx, taskevent.TypeTaskCompleted, t)
		return err
	})
	if OneVerifiedViolation(err) {
		// Another effect of the task was verified meanwhile (an earlier
		// attempt's, by the reconciler): retry; the next intake completes
		// the task with that one, and the reconciler hides this artifact.
		return "", fmt.Errorf("effect %s: another artifact of task %s is verified: %w", j.effect.EffectID, j.task.TaskID, errConcurrentChange)
	}
	if err != nil {
		return "", err
	}
	if from != effectVerified {
		w.m.effects.WithLabelValues(kindArtifactPut, effectVerified).Inc()
	}
	if t.CompletedAt != nil {
		w.m.endToEnd.Observe(t.CompletedAt.Sub(t.CreatedAt).Seconds())
	}
	w.log.InfoContext(ctx, "task completed", slog.String("task_id", t.TaskID), slog.Int64("version", t.Version),
		slog.String("artifact_sha256", sha), slog.Int64("artifact_size", size))
	return OutcomeProcessed, nil
}

// completeInTx moves, in one round trip (a batch executed in this order),
// the inbox processing -> completed, the task running -> completed and the
// effect from -> verified (unless already verified); any of them not
// applying is errConcurrentChange (and the transaction is rolled back).
func (w *Worker) completeInTx(ctx context.Context, tx pgx.Tx, j *job, from, sha string, size int64) (taskevent.Task, error) {
	raw, err := json.Marshal(map[string]any{"task_version": j.task.Version + 1, "artifact_sha256": sha})
	if err != nil {
		return taskevent.Task{}, fmt.Errorf("encode inbox result: %w", err)
	}
	b := &pgx.Batch{}
	b.Queue(sqlFinishInbox, w.cfg.Group, j.ev.EventID, inboxCompleted, string(raw))
	b.Queue(sqlCompleteTask, j.task.TaskID, j.task.Version, sha, size)
	if from != effectVerified {
		b.Queue(sqlSetEffectState, j.effect.EffectID, from, effectVerified, &sha, (*string)(nil))
	}
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	tag, err := br.Exec()
	if err != nil {
		return taskevent.Task{}, fmt.Errorf("finish inbox message %s as %s: %w", j.ev.EventID, inboxCompleted, err)
	}
	if tag.RowsAffected() != 1 {
		return taskevent.Task{}, fmt.Errorf("inbox message %s left processing: %w", j.ev.EventID, errConcurrentChange)
	}
	t, ok, err := oneTask(br.QueryRow(), "complete task "+j.task.TaskID)
	if err != nil {
		return t, err
	}
	if !ok {
		return t, fmt.Errorf("task %s left running/v%d: %w", j.task.TaskID, j.task.Version, errConcurrentChange)
	}
	if from != effectVerified {
		tag, err := br.Exec()
		if err != nil {
			return t, fmt.Errorf("effect %s %s -> %s: %w", j.effect.EffectID, from, effectVerified, err)
		}
		if tag.RowsAffected() != 1 {
			return t, fmt.Errorf("effect %s left %s: %w", j.effect.EffectID, from, errConcurrentChange)
		}
	}
	if err := br.Close(); err != nil {
		return t, fmt.Errorf("complete task %s: %w", j.task.TaskID, err)
	}
	return t, nil
}

// fail is the failure transaction: inbox -> failed, task running -> failed
// with code, effect from -> to (when they differ) with the observed hash
// and code, TaskFailed outbox event.
func (w *Worker) fail(ctx context.Context, j *job, from, to string, observed *string, code string) (string, error) {
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		return w.failInTx(ctx, tx, j, code, func() error {
			if from == to {
				return nil
			}
			return w.moveEffect(ctx, tx, j, from, to, observed, &code)
		})
	})
	if err != nil {
		return "", err
	}
	if from != to {
		w.m.effects.WithLabelValues(kindArtifactPut, to).Inc()
	}
	return OutcomeFailed, nil
}

// failInTx moves the inbox to failed and the task running -> failed with
// code, runs effect (when not nil), and writes the TaskFailed outbox event,
// in tx.
func (w *Worker) failInTx(ctx context.Context, tx pgx.Tx, j *job, code string, effect func() error) error {
	if err := w.finishInbox(ctx, tx, j, inboxFailed, map[string]any{"task_version": j.task.Version + 1, "error_code": code}); err != nil {
		return err
	}
	t, ok, err := failTask(ctx, tx, j.task.TaskID, j.task.Version, code)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("task %s left running/v%d: %w", j.task.TaskID, j.task.Version, errConcurrentChange)
	}
	if effect != nil {
		if err := effect(); err != nil {
			return err
		}
	}
	if _, err := insertOutbox(ctx, tx, taskevent.TypeTaskFailed, t); err != nil {
		return err
	}
	w.log.WarnContext(ctx, "task failed", slog.String("task_id", t.TaskID), slog.Int64("version", t.Version), slog.String("code", code))
	return nil
}

// finishInbox moves the delivery's inbox row processing -> state, or fails
// with errConcurrentChange.
func (w *Worker) finishInbox(ctx context.Context, tx pgx.Tx, j *job, state string, result any) error {
	ok, err := finishInbox(ctx, tx, w.cfg.Group, j.ev.EventID, state, result)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("inbox message %s left processing: %w", j.ev.EventID, errConcurrentChange)
	}
	return nil
}

// moveEffect moves the delivery's effect from -> to, or fails with
// errConcurrentChange.
func (w *Worker) moveEffect(ctx context.Context, tx pgx.Tx, j *job, from, to string, observed, code *string) error {
	ok, err := setEffectState(ctx, tx, j.effect.EffectID, from, to, observed, code)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("effect %s left %s: %w", j.effect.EffectID, from, errConcurrentChange)
	}
	return nil
}

// compensate hides an artifact that failed verification (seed 8): a ledger
// row of kind artifact.hide with token "compensation-for-<effect_id>" is
// written first, then the store hides the object, the hide is verified by
// observing that the token is gone, and the original effect moves
// compensation_required -> compensated. A failure leaves the effect in
// compensation_required for the reconciler; it is logged, not returned,
// because the task's outcome is already durable.
func (w *Worker) compensate(ctx context.Context, eff effectRow, observedSHA string, observedSize int64) {
	hide := effectRow{EffectID: "compensation-for-" + eff.EffectID, TaskID: eff.TaskID, Attempt: eff.Attempt, Kind: kindArtifactHide,
		Token: "compensation-for-" + eff.EffectID, TargetIdentity: eff.TargetIdentity, State: effectStarted,
		RequestSHA256: observedSHA, RequestSize: observedSize}
	err := func() error {
		h, planned, err := planEffect(ctx, w.pool, hide)
		if err != nil {
			return err
		}
		if planned {
			w.m.effects.WithLabelValues(kindArtifactHide, effectStarted).Inc()
		}
		if h.State != effectVerified {
			if err := w.store.Hide(eff.Token); err != nil {
				return err
			}
			if _, err := w.store.Head(eff.Token); !errors.Is(err, artifact.ErrNotFound) {
				return fmt.Errorf("artifact %s still readable after hide (%v)", eff.Token, err)
			}
			ok, err := setEffectState(ctx, w.pool, h.EffectID, h.State, effectVerified, nil, nil)
			if err != nil {
				return err
			}
			if ok {
				w.m.effects.WithLabelValues(kindArtifactHide, effectVerified).Inc()
			}
		}
		ok, err := setEffectState(ctx, w.pool, eff.EffectID, effectCompensationRequired, effectCompensated, nil, nil)
		if err != nil {
			return err
		}
		if ok {
			w.m.effects.WithLabelValues(kindArtifactPut, effectCompensated).Inc()
		}
		return nil
	}()
	if err != nil {
		w.log.ErrorContext(ctx, "compensation incomplete; left to the reconciler", slog.String("effect_id", eff.EffectID), slog.Any("err", err))
	}
}
