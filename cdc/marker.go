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
	"golang.org/x/sync/errgroup"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
)

// The marker: one goroutine takes the rows Kafka acknowledged, runs the
// published_at UPDATE and only then counts them done in the tracker; the
// receive loop only reads the tracker's confirmable LSN when it sends a
// status update (BENCHMARKS.md, relay).
//
// A row holds its s.sem token from decoding until it is marked published
// (or its produce fails), so the rows decoded and not yet done stay bounded
// by MaxBufferedRecords whatever the speed of the UPDATE.

// produceRecord hands one record of transaction seq to franz-go. The promise
// releases the row's s.sem token on failure; on success the marker releases
// it once the row is marked published.
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
		a := s.tr.ack(seq, outboxID)
		if a.ok {
			s.m.commitToAck.Observe(time.Since(a.commitTime).Seconds())
		}
		if a.pending >= s.cfg.FlushMaxRecords {
			select {
			case s.markKick <- struct{}{}:
			default:
			}
		}
	})
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

// marker flushes every FlushInterval, and at once when FlushMaxRecords rows
// are pending. A failure is kept for the loop (markFailure) and ends it.
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
	}
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

// flush marks the acknowledged rows published (markChunks) and only then
// counts them as done in the tracker, releasing their s.sem tokens. Rows
// that are not yet visible to other sessions (visibility.go) are given back
// to the tracker for the next flush: their transactions, and every later
// one, stay unconfirmed, so the slot never advances past a row that is not
// marked. The fault points fire around the UPDATEs when there is something
// to mark. markDone and the fault point after the UPDATEs happen under
// markMu, which sendStatus also takes to read the confirmable LSN: a status
// update never confirms rows whose RelayAfterAckBeforeConfirm fired. It
// returns how many rows it counted done.
func (s *session) flush(ctx context.Context) (int, error) {
	rows := s.tr.takeAcked()
	if len(rows) == 0 {
		return 0, nil
	}
	if err := s.cfg.Faults.Err(fault.RelayBeforeMarkPublished); err != nil {
		return 0, fmt.Errorf("mark %d outbox rows published: %w", len(rows), err)
	}
	uctx, cancel := context.WithTimeout(ctx, updateTimeout)
	defer cancel()
	done, retry, err := s.markChunks(uctx, rows)
	if err != nil {
		return 0, err
	}
	s.markMu.Lock()
	defer s.markMu.Unlock()
	s.tr.markDone(done)
	s.tr.requeue(retry)
	if err := s.cfg.Faults.Err(fault.RelayAfterAckBeforeConfirm); err != nil {
		err = fmt.Errorf("confirm lsn %s: %w", s.tr.confirmable(), err)
		if s.markErr == nil {
			s.markErr = err
		}
		return 0, err
	}
	for range done {
		<-s.sem
	}
	s.updateGauges()
	return len(done), nil
}

// minMarkChunk is the fewest rows an UPDATE of a flush that is split
// across MarkConcurrency connections gets.
const minMarkChunk = 100

// invisibleWarnAfter is how long a row may stay invisible before the
// relay warns (a synchronous standby that does not confirm holds every
// commit invisible).
const invisibleWarnAfter = 5 * time.Second

// markChunks runs the published_at UPDATEs of rows: chunks of at most
// FlushMaxRecords rows, up to MarkConcurrency of them at once on their own
// connections. It returns after every UPDATE ended, with the first error.
// A chunk whose UPDATE affected fewer rows than it holds is classified
// (outbox.Classify): rows found marked or gone are done, rows not yet
// visible (or visible only after the UPDATE) are returned in retry. On an
// error, chunks that committed before another failed stay marked; no row is
// counted done, so the slot does not move past them and a restarted relay
// produces them again (the UPDATE skips rows already marked).
func (s *session) markChunks(ctx context.Context, rows []ackedRow) (done, retry []ackedRow, err error) {
	if parks := countParks(rows); parks > 0 {
		var marks []ackedRow
		if parks < len(rows) {
			marks = make([]ackedRow, 0, len(rows)-parks)
		}
		var parked []ackedRow
		for _, r := range rows {
			if r.park != nil {
				parked = append(parked, r)
			} else {
				marks = append(marks, r)
			}
		}
		if done, retry, err = s.parkRows(ctx, parked); err != nil {
			return nil, nil, err
		}
		if len(marks) == 0 {
			return done, retry, nil
		}
		d, r, err := s.markChunks(ctx, marks)
		if err != nil {
			return nil, nil, err
		}
		return append(done, d...), append(retry, r...), nil
	}
	size := min(s.cfg.FlushMaxRecords, max(minMarkChunk, (len(rows)+s.cfg.MarkConcurrency-1)/s.cfg.MarkConcurrency))
	var chunks [][]ackedRow
	for start := 0; start < len(rows); start += size {
		chunks = append(chunks, rows[start:min(start+size, len(rows))])
	}
	var mu sync.Mutex
	mark := func(chunk []ackedRow) error {
		ids := make([]string, len(chunk))
		for i, row := range chunk {
			ids[i] = row.outboxID
		}
		n, err := outbox.MarkPublished(ctx, s.pool, ids)
		if err != nil {
			return err
		}
		s.m.publishedMarked.Add(float64(n))
		if int(n) == len(chunk) {
			mu.Lock()
			done = append(done, chunk...)
			mu.Unlock()
			return nil
		}
		pending := make([]outbox.Pending, len(chunk))
		for i, row := range chunk {
			pending[i] = outbox.Pending{ID: row.outboxID, XID: row.xid}
		}
		st, err := outbox.Classify(ctx, s.pool, pending)
		if err != nil {
			return err
		}
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		for i, row := range chunk {
			switch st[i] {
			case outbox.Marked:
				done = append(done, row)
			case outbox.Gone:
				s.m.outboxRowsGone.Inc()
				s.log.WarnContext(ctx, "outbox row deleted after its commit before it was marked published; its event was published",
					slog.String("outbox_id", row.outboxID), slog.Uint64("xid", uint64(row.xid)))
				done = append(done, row)
			default: // Unmarked, Invisible
				s.m.outboxRowsInvisible.Inc()
				if row.invisibleSince.IsZero() {
					row.invisibleSince = now
				} else if d := now.Sub(row.invisibleSince); d >= invisibleWarnAfter && d-invisibleWarnAfter < s.cfg.FlushInterval {
					s.log.WarnContext(ctx, "a published outbox row is still not visible to other sessions; its commit may be waiting for a synchronous standby (the slot waits)",
						slog.String("outbox_id", row.outboxID), slog.Uint64("xid", uint64(row.xid)), slog.Duration("invisible_for", d))
				}
				retry = append(retry, row)
			}
		}
		return nil
	}
	if len(chunks) == 1 {
		if err := mark(chunks[0]); err != nil {
			return nil, nil, err
		}
		return done, retry, nil
	}
	var g errgroup.Group
	g.SetLimit(s.cfg.MarkConcurrency)
	for _, chunk := range chunks {
		g.Go(func() error { return mark(chunk) })
	}
	if err := g.Wait(); err != nil {
		return nil, nil, err
	}
	return done, retry, nil
}

func countParks(rows []ackedRow) int {
	n := 0
	for _, r := range rows {
		if r.park != nil {
			n++
		}
	}
	return n
}

// parkRows parks rows (outbox.Park), one statement each (parking is rare).
// A row Park did not change is classified as in markChunks: found settled
// (published or parked, by an earlier run) or gone it is done, not yet
// visible it is retried.
func (s *session) parkRows(ctx context.Context, rows []ackedRow) (done, retry []ackedRow, err error) {
	for _, row := range rows {
		changed, err := outbox.Park(ctx, s.pool, row.outboxID, row.park.code, row.park.message)
		if err != nil {
			return nil, nil, err
		}
		if changed {
			s.m.rowsParked.WithLabelValues(row.park.code).Inc()
			done = append(done, row)
			continue
		}
		st, err := outbox.Classify(ctx, s.pool, []outbox.Pending{{ID: row.outboxID, XID: row.xid}})
		if err != nil {
			return nil, nil, err
		}
		switch st[0] {
		case outbox.Marked, outbox.Gone:
			done = append(done, row)
		default:
			s.m.outboxRowsInvisible.Inc()
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
