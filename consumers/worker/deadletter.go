package worker

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/taskevent"
)

// Headers the worker adds to a dead-lettered record (DESIGN.md "Kafka
// contract"). The original key, value and headers are kept unchanged; any
// header with the "dlq-" prefix is removed first, so re-dead-lettering
// replaces these headers instead of appending them.
const (
	HeaderDLQPrefix           = "dlq-"
	HeaderDLQOriginalTopic    = "dlq-original-topic"
	HeaderDLQOriginalPart     = "dlq-original-partition"
	HeaderDLQOriginalOffset   = "dlq-original-offset"
	HeaderDLQConsumerGroup    = "dlq-consumer-group"
	HeaderDLQErrorClass       = "dlq-error-class"
	HeaderDLQErrorCode        = "dlq-error-code"
	HeaderDLQErrorMessage     = "dlq-error-message"
	HeaderDLQAttempts         = "dlq-attempts"
	HeaderDLQProcessorVersion = "dlq-processor-version"
	HeaderDLQFirstFailureAt   = "dlq-first-failure-at"
	HeaderDLQLastFailureAt    = "dlq-last-failure-at"
)

// Error classes (header dlq-error-class, dead_letter.error_class).
const (
	// ClassDeterministic: the error recurs on every attempt (Retryable is
	// false); dead-lettered at the first failure.
	ClassDeterministic = "deterministic"
	// ClassRetryable: a retryable error persisted through MaxAttempts
	// attempts.
	ClassRetryable = "retryable"
)

// maxErrorMessage bounds the dlq-error-message header (bytes).
const maxErrorMessage = 1024

// failure describes why a record is dead-lettered.
type failure struct {
	class    string
	code     string
	err      error
	attempts int
	first    time.Time
	last     time.Time
}

// DeadLetterRecord returns the record to produce to the dead-letter topic
// for r: same key, value and headers (minus any "dlq-" header), plus the
// dlq-* headers describing the failure (DESIGN.md "Kafka contract").
func DeadLetterRecord(r *kgo.Record, dlqTopic, group, class, code, message string, attempts int, processorVersion string, first, last time.Time) *kgo.Record {
	out := &kgo.Record{Topic: dlqTopic, Key: r.Key, Value: r.Value}
	for _, h := range r.Headers {
		if strings.HasPrefix(h.Key, HeaderDLQPrefix) {
			if h.Key == HeaderDLQFirstFailureAt {
				if t, err := time.Parse(time.RFC3339Nano, string(h.Value)); err == nil && t.Before(first) {
					first = t
				}
			}
			continue
		}
		out.Headers = append(out.Headers, h)
	}
	if len(message) > maxErrorMessage {
		message = message[:maxErrorMessage]
	}
	for _, kv := range [][2]string{
		{HeaderDLQOriginalTopic, r.Topic},
		{HeaderDLQOriginalPart, strconv.Itoa(int(r.Partition))},
		{HeaderDLQOriginalOffset, strconv.FormatInt(r.Offset, 10)},
		{HeaderDLQConsumerGroup, group},
		{HeaderDLQErrorClass, class},
		{HeaderDLQErrorCode, code},
		{HeaderDLQErrorMessage, message},
		{HeaderDLQAttempts, strconv.Itoa(attempts)},
		{HeaderDLQProcessorVersion, processorVersion},
		{HeaderDLQFirstFailureAt, first.UTC().Format(time.RFC3339Nano)},
		{HeaderDLQLastFailureAt, last.UTC().Format(time.RFC3339Nano)},
	} {
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: kv[0], Value: []byte(kv[1])})
	}
	return out
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
	dlq := DeadLetterRecord(r, w.cfg.DeadLetterTopic, w.cfg.Group, f.class, f.code, f.err.Error(), f.attempts, w.cfg.ProcessorVersion, f.first, f.last)
	for n := 0; ; n++ {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		err := cl.ProduceSync(pctx, dlq).FirstErr()
		cancel()
		if err == nil {
			break
		}
		log.WarnContext(ctx, "produce dead letter failed; retrying", slog.String("topic", w.cfg.DeadLetterTopic), slog.Any("err", err))
		if !w.sleep(ctx, n) {
			return false
		}
	}
	for n := 0; ; n++ {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.AttemptTimeout)
		err := w.recordDeadLetter(actx, r, f.code)
		cancel()
		if err == nil {
			break
		}
		log.WarnContext(ctx, "record dead letter failed; retrying", slog.Any("err", err))
		if !w.sleep(ctx, n) {
			return false
		}
	}
	w.m.deadLettered.WithLabelValues(f.code).Inc()
	log.WarnContext(ctx, "record dead-lettered", slog.String("class", f.class), slog.String("code", f.code),
		slog.Int("attempts", f.attempts), slog.String("dlq_topic", w.cfg.DeadLetterTopic), slog.Any("err", f.err))
	return true
}

// sleep waits the backoff of retry n; false when ctx ended first.
func (w *Worker) sleep(ctx context.Context, n int) bool {
	t := time.NewTimer(backoff(w.cfg.RetryBackoffMin, w.cfg.RetryBackoffMax, n))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// recordDeadLetter is the transaction after the dead-letter topic
// acknowledged: the inbox row of the message (when it has an id) becomes
// failed with the code (or an inbox_conflict row for another payload), and
// a verified event's task that exists and is not terminal moves to failed
// (compare-and-set on its version) with a TaskFailed outbox event. A record
// that does not pass the contract checks names a task it cannot be trusted
// about, so its task is left alone (the reconciler re-drives a task that
// makes no progress).
func (w *Worker) recordDeadLetter(ctx context.Context, r *kgo.Record, code string) error {
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
			outcome, err := recordFailure(ctx, tx, conflictRecord{Consumer: w.cfg.Group, MessageID: msgID,
				PayloadSHA256: canon.SHA256Hex(r.Value), Topic: r.Topic, Partition: r.Partition, Offset: r.Offset}, code)
			if err != nil {
				return err
			}
			if outcome == OutcomeConflict {
				return nil // another payload under this id: the task is not this record's
			}
		}
		if verr != nil {
			return nil
		}
		task, found, err := lockTask(ctx, tx, ev.TaskID)
		if err != nil || !found || taskevent.Terminal(task.Status) {
			return err
		}
		t, ok, err := failTaskAt(ctx, tx, task.TaskID, task.Status, task.Version, code)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("task %s left %s/v%d: %w", task.TaskID, task.Status, task.Version, errConcurrentChange)
		}
		if _, err := insertOutbox(ctx, tx, taskevent.TypeTaskFailed, t); err != nil {
			return err
		}
		w.log.WarnContext(ctx, "task failed by a dead letter", slog.String("task_id", t.TaskID), slog.Int64("version", t.Version), slog.String("code", code))
		return nil
	})
}
