package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
)

// failure describes why a record is dead-lettered.
type failure struct {
	class    string // taskevent.ClassDeterministic or ClassRetryable
	code     string
	err      error
	attempts int
	first    time.Time
	last     time.Time
}

// deadLetter parks r (seed 13.5): it produces the dead-letter record and
// waits for the broker's acknowledgement, then records the outcome in one
// transaction (inbox -> failed, the task -> failed with the error code and
// a TaskFailed event when the record is a verified task event of a task
// that exists and is not terminal). Each step is retried with backoff until
// it succeeds; the record is produced once per call. It returns false only
// when ctx ended before the outcome was durable: the offset is then not
// committed and the record comes again (a second dead letter of the same
// origin offset is recorded once by the reconciler).
func (w *Worker) deadLetter(ctx context.Context, cl *kgo.Client, r *kgo.Record, f failure, log *slog.Logger) bool {
	dlq := taskevent.DeadLetterRecord(r, taskevent.DeadLetter{Topic: w.cfg.DeadLetterTopic, Group: w.cfg.Group, Class: f.class, Code: f.code,
		Message: f.err.Error(), Attempts: f.attempts, ProcessorVersion: w.cfg.ProcessorVersion, First: f.first, Last: f.last})
	for n := 0; ; n++ {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		err := cl.ProduceSync(pctx, dlq).FirstErr()
		cancel()
		if err == nil {
			break
		}
		if code, refused := kafkatopic.RefusedRecord(err); refused && len(dlq.Value) > 0 {
			// Retrying cannot help and would hold the partition for good
			// (issue 13 review): park the record without its value.
			log.WarnContext(ctx, "the dead-letter topic refuses the record; dead-lettering it without its value",
				slog.String("code", code), slog.Int("value_bytes", len(dlq.Value)), slog.Any("err", err))
			dlq = withoutValue(dlq, code)
			continue
		}
		log.WarnContext(ctx, "produce dead letter failed; retrying", slog.String("topic", w.cfg.DeadLetterTopic), slog.Any("err", err))
		if !backoff.Sleep(ctx, w.cfg.RetryBackoffMin, w.cfg.RetryBackoffMax, n) {
			return false
		}
	}
	for n := 0; ; n++ {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		err := w.recordDeadLetter(actx, r, f.code, errors.Is(f.err, ErrNotYetVisible), w.visibleBy(r, f.first))
		cancel()
		if err == nil {
			break
		}
		log.WarnContext(ctx, "record dead letter failed; retrying", slog.Any("err", err))
		if !backoff.Sleep(ctx, w.cfg.RetryBackoffMin, w.cfg.RetryBackoffMax, n) {
			return false
		}
	}
	w.m.deadLettered.WithLabelValues(f.code).Inc()
	log.WarnContext(ctx, "record dead-lettered", slog.String("class", f.class), slog.String("code", f.code),
		slog.Int("attempts", f.attempts), slog.String("dlq_topic", w.cfg.DeadLetterTopic), slog.Any("err", f.err))
	return true
}

// withoutValue is dlq with an empty value and the dlq-value-omitted
// header saying why and how large the value was.
func withoutValue(dlq *kgo.Record, code string) *kgo.Record {
	hs := append(dlq.Headers[:len(dlq.Headers):len(dlq.Headers)], kgo.RecordHeader{
		Key: taskevent.HeaderDLQValueOmitted, Value: []byte(fmt.Sprintf("%s: %d bytes", code, len(dlq.Value)))})
	return &kgo.Record{Topic: dlq.Topic, Key: dlq.Key, Headers: hs}
}

// recordDeadLetter is the transaction after the dead-letter topic
// acknowledged: the inbox row of the message (when it has an id) becomes
// failed with the code (or an inbox_conflict row for another payload), and
// a verified event's task that exists and is not terminal moves to failed
// (compare-and-set on its version) with a TaskFailed outbox event — except
// when notVisible (the error wrapped ErrNotYetVisible: TASK_NOT_FOUND, or
// the task seen at a version older than the event's): a task visible now
// was only not visible then, and is never failed for it. A verified event
// whose task is not found (not visible yet: the record failed before it
// read the database) is an error, so that the caller retries, until
// waitUntil (visibleBy: VisibilityTimeout after the earlier of the record's
// timestamp and its first failure, so that a record stamped in the future
// does not hold its partition; the zero time waits for nothing); then the
// task is left alone. A
// record that does not pass the contract checks names a task it cannot be
// trusted about, so its task is left alone (the reconciler re-drives a
// task that makes no progress).
func (w *Worker) recordDeadLetter(ctx context.Context, r *kgo.Record, code string, notVisible bool, waitUntil time.Time) error {
	hdr := headers(r)
	ev, verr := verifyRecord(r, hdr)
	msgID := hdr[taskevent.HeaderEventID]
	if msgID == "" {
		if dec, err := taskevent.Decode(r.Value); err == nil {
			msgID = dec.EventID
		}
	}
	return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		if msgID != "" {
			conflict, err := inbox.RecordFailure(ctx, tx, inbox.Delivery{Consumer: w.cfg.Group, MessageID: msgID,
				PayloadSHA256: canon.SHA256Hex(r.Value), Topic: r.Topic, Partition: r.Partition, Offset: r.Offset}, code)
			if err != nil {
				return err
			}
			if conflict {
				return nil // another payload under this id: the task is not this record's
			}
		}
		if verr != nil {
			return nil
		}
		t, found, err := task.Lock(ctx, tx, ev.TaskID)
		if err == nil && !found && !notVisible && time.Now().Before(waitUntil) {
			// A verified event's task exists: its transaction committed.
			// Not found means not visible yet (issue 9): a record failed
			// before any read of the database (a fault, a contract error
			// of the payload) is dead-lettered within milliseconds, inside
			// that window. Retried (deadLetter's loop) until the visibility
			// timeout, so that the task is failed now rather than left
			// queued for the reconciler's re-drive; past it, left alone.
			return fmt.Errorf("task %s of the dead letter: %w", ev.TaskID, ErrNotYetVisible)
		}
		if err != nil || !found || taskevent.Terminal(t.Status) {
			return err
		}
		if notVisible {
			// The failure may only have meant that the event's
			// transaction was not visible yet (ErrNotYetVisible, issue
			// 9): the task is not failed for it. The reconciler
			// re-drives it if it makes no progress, and resolves the dead
			// letter once it completed.
			w.log.WarnContext(ctx, "task dead-lettered because its event's transaction was not visible is left for the reconciler's re-drive",
				slog.String("task_id", t.TaskID), slog.String("status", t.Status), slog.Int64("version", t.Version), slog.String("code", code))
			return nil
		}
		c, err := task.FailIfNotTerminal(ctx, tx, t.TaskID, t.Version, code)
		if err != nil {
			return err
		}
		if !c.Applied {
			return fmt.Errorf("task %s left %s/v%d: %w", t.TaskID, t.Status, t.Version, errConcurrentChange)
		}
		if _, err := outbox.Insert(ctx, tx, taskevent.TypeTaskFailed, c.Task); err != nil {
			return err
		}
		w.log.WarnContext(ctx, "task failed by a dead letter", slog.String("task_id", c.Task.TaskID), slog.Int64("version", c.Task.Version), slog.String("code", code))
		return nil
	})
}
