package cdc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
)

// The marker: one goroutine records the transactions whose rows Kafka
// acknowledged (outbox.RecordTransactions: one narrow row per transaction)
// and parks the rows that cannot be published, and only then counts them
// done in the tracker; the receive loop only reads the tracker's confirmable
// LSN when it sends a status update (BENCHMARKS.md, relay).
//
// A row holds its s.sem token from decoding until Kafka acknowledged it (or
// its produce failed, or it was parked), so the records in flight stay
// bounded by MaxBufferedRecords; a transaction holds its s.txnSem token from
// its Begin until the slot may pass it, so the transactions held in memory
// stay bounded by MaxBufferedRecords as well, whatever the speed of the
// recording INSERT.

// produceRecord hands one record of transaction seq to franz-go. The promise
// releases the row's s.sem token, except for a row to park: the marker
// releases that one once the row is parked.
func (s *session) produceRecord(seq uint64, outboxID, eventType string, rec *kgo.Record) {
	s.kcl.Produce(s.produceCtx, rec, func(_ *kgo.Record, err error) {
		if err == nil {
			// Kafka acknowledged; an injected error here is a lost confirm.
			err = s.cfg.Faults.Err(fault.RelayPublishConfirmLost)
		}
		if err != nil {
			if s.closing.Load() {
				<-s.sem
				s.tr.fail(seq, nil) // abandoned: produced again after a restart
				return
			}
			s.m.produceErrors.Inc()
			if code, ok := kafkatopic.RefusedRecord(err); ok {
				// Retrying cannot help: park the row (the flush records it
				// and releases the token) and let the stream go on.
				s.log.Error("an outbox record is refused for good (by the producer's 1 MiB limit or by the broker); parking the row (converge outbox list)",
					slog.String("outbox_id", outboxID), slog.String("code", code), slog.String("error", err.Error()))
				s.tr.ackPark(seq, outboxID, parkReason{code: code, message: err.Error()})
				return
			}
			<-s.sem
			if s.produceFailed.Add(1) == 1 { // the rest of the session's failures: counted, recorded, not each logged
				s.log.Error("produce outbox event failed; the relay restarts from the slot",
					slog.String("outbox_id", outboxID), slog.String("error", err.Error()))
			}
			s.tr.fail(seq, &produceError{outboxID: outboxID, code: produceErrorCode(err), err: err})
			return
		}
		s.m.published.WithLabelValues(eventType).Inc()
		a := s.tr.ack(seq)
		<-s.sem
		if a.ok {
			s.m.commitToAck.Observe(time.Since(a.commitTime).Seconds())
		}
		if a.pending >= s.cfg.FlushMaxRecords {
			s.kickMarker()
		}
	})
}

// kickMarker asks the marker for a flush now.
func (s *session) kickMarker() {
	select {
	case s.markKick <- struct{}{}:
	default:
	}
}

// produceError is a record's produce failure that retrying may fix (the
// broker unreachable, a timeout): Run records it on the row
// (outbox.RecordFailure) and restarts the session from the slot.
type produceError struct {
	outboxID, code string
	err            error
}

func (e *produceError) Error() string {
	return fmt.Sprintf("produce outbox row %s: %s", e.outboxID, e.err)
}

func (e *produceError) Unwrap() error { return e.err }

// produceErrorCode is the stable code recorded for a produce failure:
// Kafka's error name, or DELIVERY_TIMEOUT, RETRIES_EXHAUSTED, PRODUCE_FAILED.
func produceErrorCode(err error) string {
	var ke *kerr.Error
	switch {
	case errors.As(err, &ke):
		return ke.Message
	case errors.Is(err, kgo.ErrRecordTimeout):
		return "DELIVERY_TIMEOUT"
	case errors.Is(err, kgo.ErrRecordRetries):
		return "RETRIES_EXHAUSTED"
	}
	return "PRODUCE_FAILED"
}

// startMarker starts the marker goroutine. ctx cancelled ends it at once
// (error paths); stopMarker ends it after a final flush (shutdown).
func (s *session) startMarker(ctx context.Context) {
	s.markKick = make(chan struct{}, 1)
	s.markStop = make(chan struct{})
	s.markExited = make(chan struct{})
	go s.marker(ctx)
}

// marker flushes every FlushInterval, and at once when FlushMaxRecords
// transactions and rows are pending. A failure is kept for the loop
// (markFailure) and ends it.
func (s *session) marker(ctx context.Context) {
	defer close(s.markExited)
	t := time.NewTimer(s.cfg.FlushInterval)
	defer t.Stop()
	for {
		t.Reset(s.cfg.FlushInterval)
		stopping := false
		select {
		case <-s.markStop:
			stopping = true
		case <-s.markKick:
		case <-t.C:
		case <-ctx.Done():
			return
		}
		t.Stop()
		for {
			n, err := s.flush(ctx)
			if err != nil {
				s.setMarkErr(err)
				return
			}
			if stopping {
				return
			}
			// Flush again at once while a full batch waits, unless this
			// flush counted nothing done (rows not yet visible wait for
			// the next interval).
			if n == 0 || s.tr.pending() < s.cfg.FlushMaxRecords {
				break
			}
		}
		if time.Since(s.progressAt) >= s.cfg.StatusInterval {
			s.recordProgress(ctx)
		}
	}
}

// recordProgress writes the tracker's confirmable LSN into relay_progress
// (migration 00020) when it moved since the last write: the position below
// which a later session of this slot's relay does not produce again what
// the slot streams again (loadProgress). The marker calls it at most once
// per StatusInterval, and shutdown once more after the final status update.
// Nothing is written after a marker failure, so a transaction whose
// RelayAfterAckBeforeConfirm fired is never covered. A failed write costs
// only duplicates after a crash of PostgreSQL: it is logged.
func (s *session) recordProgress(ctx context.Context) {
	s.markMu.Lock()
	lsn, failed := s.tr.confirmable(), s.markErr != nil
	s.markMu.Unlock()
	if failed || lsn <= s.progressLSN || s.systemID == "" {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, updateTimeout)
	defer cancel()
	written, err := s.store.recordProgress(pctx, s.cfg.SlotName, s.systemID, s.walsender, lsn)
	if err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "could not record the relay's progress; after a crash of PostgreSQL more may be produced again",
				slog.String("error", err.Error()))
		}
		return
	}
	if !written {
		s.progressAt = time.Now() // tried again a StatusInterval later
		if !s.progressBlocked {
			s.progressBlocked = true
			s.log.WarnContext(ctx, "the relay's progress is not recorded: the server the pool reaches shows the slot not held by this session's walsender (a failover, or a proxy between the relay and PostgreSQL); after a crash of PostgreSQL more may be produced again",
				slog.Uint64("walsender_pid", uint64(s.walsender)))
		}
		return
	}
	s.progressLSN, s.progressAt = lsn, time.Now()
}

// stopMarker makes the marker flush once more and waits for it to end.
// Idempotent.
func (s *session) stopMarker() {
	if s.markStop == nil {
		return
	}
	s.stopMarkerOnce.Do(func() { close(s.markStop) })
	<-s.markExited
}

func (s *session) setMarkErr(err error) {
	s.markMu.Lock()
	defer s.markMu.Unlock()
	if s.markErr == nil {
		s.markErr = err
	}
}

// markFailure returns the marker's failure, or nil.
func (s *session) markFailure() error {
	s.markMu.Lock()
	defer s.markMu.Unlock()
	return s.markErr
}

// flush parks the rows that cannot be published (parkRows), then records
// the settled transactions (outbox.RecordTransactions, at most
// FlushMaxRecords per statement), and only then counts them as done in the
// tracker. Rows to park that are not yet visible to other sessions
// (visibility.go) are given back to the tracker for the next flush: their
// transactions, and every later one, stay unconfirmed. A transaction needs
// no visibility check: its record says that the slot delivered its rows and
// Kafka acknowledged them, which is true whether or not other sessions see
// its commit yet (they see the rows published from the moment they see the
// rows). The fault points fire around the writes when there is something to
// write. recorded and the fault point after the writes happen under markMu,
// which sendStatus also takes to read the confirmable LSN: a status update
// never confirms transactions whose RelayAfterAckBeforeConfirm fired. It
// returns how many transactions and rows it counted done.
func (s *session) flush(ctx context.Context) (int, error) {
	parks := s.tr.takeParks()
	if len(parks) == 0 && s.tr.pending() == 0 {
		return 0, nil
	}
	if err := s.cfg.Faults.Err(fault.RelayBeforeMarkPublished); err != nil {
		return 0, fmt.Errorf("record published outbox transactions: %w", err)
	}
	uctx, cancel := context.WithTimeout(ctx, updateTimeout)
	defer cancel()
	var parked []parkRow
	if len(parks) > 0 {
		done, retry, err := s.parkRows(uctx, parks)
		if err != nil {
			return 0, err
		}
		s.tr.parksDone(done)
		s.tr.requeueParks(retry)
		parked = done
	}
	txns := s.tr.takeReady()
	for start := 0; start < len(txns); start += s.cfg.FlushMaxRecords {
		chunk := txns[start:min(start+s.cfg.FlushMaxRecords, len(txns))]
		xids := make([]uint32, len(chunk))
		for i, x := range chunk {
			xids[i] = x.xid
		}
		n, err := outbox.RecordTransactions(uctx, s.pool, xids)
		if err != nil {
			return 0, err
		}
		s.m.transactionsRecorded.Add(float64(n))
	}
	s.markMu.Lock()
	defer s.markMu.Unlock()
	s.tr.recorded(txns)
	if err := s.cfg.Faults.Err(fault.RelayAfterAckBeforeConfirm); err != nil {
		err = fmt.Errorf("confirm lsn %s: %w", s.tr.confirmable(), err)
		if s.markErr == nil {
			s.markErr = err
		}
		return 0, err
	}
	for range parked {
		<-s.sem
	}
	s.updateGauges()
	return len(txns) + len(parked), nil
}

// invisibleWarnAfter is how long a row to park may stay invisible before
// the relay warns (a synchronous standby that does not confirm holds every
// commit invisible).
const invisibleWarnAfter = 5 * time.Second

// parkRows parks rows (outbox.Park), one statement each (parking is rare).
// A row Park did not change is classified (outbox.Classify): found settled
// (published or parked, by an earlier run) or gone (deleted after its
// commit) it is done; not yet visible (its commit not visible to other
// sessions yet, or visible only after Park's snapshot) it is retried at the
// next flush.
func (s *session) parkRows(ctx context.Context, rows []parkRow) (done, retry []parkRow, err error) {
	now := time.Now()
	for _, row := range rows {
		changed, err := outbox.Park(ctx, s.pool, row.outboxID, row.why.code, row.why.message)
		if err != nil {
			return nil, nil, err
		}
		if changed {
			s.m.rowsParked.WithLabelValues(row.why.code).Inc()
			done = append(done, row)
			continue
		}
		st, err := outbox.Classify(ctx, s.pool, []outbox.Pending{{ID: row.outboxID, XID: row.xid}})
		if err != nil {
			return nil, nil, err
		}
		switch st[0] {
		case outbox.Marked:
			done = append(done, row)
		case outbox.Gone:
			s.m.outboxRowsGone.Inc()
			s.log.WarnContext(ctx, "outbox row to park was deleted after its commit; nothing is left to park",
				slog.String("outbox_id", row.outboxID), slog.Uint64("xid", uint64(row.xid)))
			done = append(done, row)
		default: // Unmarked, Invisible
			s.m.outboxRowsInvisible.Inc()
			if row.invisibleSince.IsZero() {
				row.invisibleSince = now
			} else if d := now.Sub(row.invisibleSince); d >= invisibleWarnAfter && d-invisibleWarnAfter < s.cfg.FlushInterval {
				s.log.WarnContext(ctx, "an outbox row to park is still not visible to other sessions; its commit may be waiting for a synchronous standby (the slot waits)",
					slog.String("outbox_id", row.outboxID), slog.Uint64("xid", uint64(row.xid)), slog.Duration("invisible_for", d))
			}
			retry = append(retry, row)
		}
	}
	return done, retry, nil
}

// markGuard is the state shared by the marker and the loop.
type markGuard struct {
	markMu         sync.Mutex
	markErr        error // first failure of the marker; guarded by markMu
	markKick       chan struct{}
	markStop       chan struct{}
	markExited     chan struct{}
	stopMarkerOnce sync.Once
}
