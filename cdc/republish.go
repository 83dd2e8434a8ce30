package cdc

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
)

// Republication of outbox rows outside the replication stream (issue 13):
// a parked row an operator decides to publish (Republish), and the rows the
// slot will not deliver (RepublishUnpublished). Both produce RecordOf the
// row, so consumers see the original message id and deduplicate.

// ErrRepublishFailed: the producer or the broker did not acknowledge a
// republished record (the cause is wrapped: a *kerr.Error such as
// kerr.MessageTooLarge for a record over the producer's 1 MiB limit, which
// retrying cannot fix; kgo.ErrRecordTimeout; the context's error). The
// attempt is recorded on the row, which keeps its state.
var ErrRepublishFailed = errors.New("republished outbox record not acknowledged")

// CodeRepublishFailed is the last_error_code RepublishUnpublished records
// on a row whose record was not acknowledged.
const CodeRepublishFailed = "REPUBLISH_FAILED"

// recordFailureTimeout bounds recording a failed attempt after the
// caller's context ended the produce (a deadline): the attempt happened
// and is recorded all the same.
const recordFailureTimeout = 5 * time.Second

// NewRepublishProducer returns the producer of republications (operator
// decisions, the reconciler's pass, dead-letter replays): acks=all, a 30 s
// record delivery timeout (a republished row stays locked, a reconciler
// pass waits, until the broker answers), and the relay's producer limits
// (franz-go's defaults, 1 MiB per record), so a republished record never
// reaches consumers that could not dead-letter it. opts are appended
// (metrics hooks, TLS).
func NewRepublishProducer(brokers []string, opts ...kgo.Opt) (*kgo.Client, error) {
	return kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordDeliveryTimeout(republishDeliveryTimeout)}, opts...)...)
}

// republishDeliveryTimeout is NewRepublishProducer's record delivery
// timeout.
const republishDeliveryTimeout = 30 * time.Second

// Republish produces the parked outbox row id again (RecordOf) with
// producer and waits for the broker's acknowledgement, then records the
// decision (outbox.Decide: published_at set, by and reason kept). The row
// is locked (SELECT ... FOR UPDATE) from the check to the decision, so a
// concurrent discard waits and then finds it decided: a published row is
// never recorded as discarded. A produce that fails is recorded on the row
// (outbox.RecordParkedFailure: it stays parked and undecided; code as the
// relay records it, e.g. MESSAGE_TOO_LARGE) and returned wrapping
// ErrRepublishFailed. outbox.ErrReasonRequired (blank by or reason, checked
// first), ErrNotFound, ErrNotParked, ErrDecided as outbox.Decide. The
// producer's options bound the wait (use a record delivery timeout), as
// does ctx.
func Republish(ctx context.Context, producer *kgo.Client, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, topic, id, by, reason string) error {
	if strings.TrimSpace(reason) == "" || strings.TrimSpace(by) == "" {
		return outbox.ErrReasonRequired
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("republish outbox row %s: %w", id, err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox_event WHERE outbox_id = $1 FOR UPDATE`, id); err != nil {
		return fmt.Errorf("lock outbox row %s: %w", id, err)
	}
	s, err := outbox.Get(ctx, tx, id)
	if err != nil {
		return err
	}
	switch {
	case s.ParkedAt == nil:
		return fmt.Errorf("%w: %s", outbox.ErrNotParked, id)
	case s.Decision != "":
		return fmt.Errorf("%w: %s was %s", outbox.ErrDecided, id, s.Decision)
	}
	if err := producer.ProduceSync(ctx, RecordOf(s, topic)).FirstErr(); err != nil {
		perr := fmt.Errorf("%w: outbox row %s: %w", ErrRepublishFailed, id, err)
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordFailureTimeout)
		defer cancel()
		if uerr := outbox.RecordParkedFailure(rctx, tx, id, produceErrorCode(err), err.Error()); uerr != nil {
			return errors.Join(perr, uerr)
		}
		if cerr := tx.Commit(rctx); cerr != nil {
			return errors.Join(perr, cerr)
		}
		return perr
	}
	if err := outbox.Decide(ctx, tx, id, outbox.DecisionRepublished, by, reason); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("record republication of outbox row %s (its record was produced: a retry produces it again, a duplicate the inboxes absorb): %w", id, err)
	}
	return nil
}

// Republication is what RepublishUnpublished did.
type Republication struct {
	// Republished are the outbox ids the broker acknowledged, in the
	// order produced. With a nil error they are marked published.
	Republished []string
	// Failed are the rows whose record was not acknowledged, each with the
	// produce error; the attempt is recorded on the row (outbox.RecordFailure,
	// CodeRepublishFailed), which stays unpublished for the next try.
	Failed []FailedRepublication
}

// FailedRepublication is a row RepublishUnpublished could not publish.
type FailedRepublication struct {
	ID  string
	Err error
	// Parked: the record was refused for good (kafkatopic.RefusedRecord:
	// too large, invalid), so the row was parked with that code, as the
	// relay parks it, for an operator to decide; otherwise the attempt was
	// recorded and the next run tries again.
	Parked bool
}

// RepublishUnpublished produces the outbox rows neither published nor
// parked created more than olderThan ago — backlog.Stale: at most limit,
// in created_xid order, which is each task's event order — with their
// original records (RecordOf) in one ProduceSync, marks the acknowledged
// ones published (outbox.MarkPublished) and records the failed attempts
// (outbox.RecordFailure; a record refused for good — too large, invalid:
// kafkatopic.RefusedRecord — parks its row with that code instead, as the
// relay would, so it is not tried again every pass). These are the rows the replication slot will not
// deliver (issue 13: a slot lost and recreated, rows committed before the
// slot existed, a relay down longer than olderThan). The reconciler's pass
// runs it (Config.RepublishAfter, BatchSize) and `converge outbox
// republish --unpublished` on demand.
//
// Rows are not locked and no decision is recorded (a row that is not
// parked needs none): a row the relay publishes meanwhile reaches the topic
// twice, a duplicate the consumers' inboxes absorb (same event id). The
// error is a database error (reading, marking, recording), never a produce
// failure, which is in Failed; with an error, Republished may hold rows
// produced but not marked (a next run produces them again).
func RepublishUnpublished(ctx context.Context, producer *kgo.Client, q dbpool.Querier, backlog *outbox.Backlog,
	topic string, olderThan time.Duration, limit int) (Republication, error) {
	var rep Republication
	stale, err := backlog.Stale(ctx, q, olderThan, limit)
	if err != nil || len(stale) == 0 {
		return rep, err
	}
	recs := make([]*kgo.Record, len(stale))
	for i, s := range stale {
		recs[i] = RecordOf(s, topic)
	}
	for i, pr := range producer.ProduceSync(ctx, recs...) {
		if pr.Err != nil {
			rep.Failed = append(rep.Failed, FailedRepublication{ID: stale[i].ID, Err: pr.Err})
			continue
		}
		rep.Republished = append(rep.Republished, stale[i].ID)
	}
	var errs []error
	if len(rep.Republished) > 0 {
		if _, err := outbox.MarkPublished(ctx, q, rep.Republished); err != nil {
			errs = append(errs, err)
		}
	}
	for i := range rep.Failed {
		f := &rep.Failed[i]
		var err error
		if code, refused := kafkatopic.RefusedRecord(f.Err); refused {
			// Retrying cannot help (issue 13): park it, as the relay does.
			f.Parked, err = outbox.Park(ctx, q, f.ID, code, f.Err.Error())
		} else {
			_, err = outbox.RecordFailure(ctx, q, []string{f.ID}, CodeRepublishFailed, f.Err.Error())
		}
		if err != nil {
			errs = append(errs, err)
			break
		}
	}
	return rep, errors.Join(errs...)
}
