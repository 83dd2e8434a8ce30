package cdc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/backoff"
)

// Reasons of a mismatch: the values of the reason label of
// converge_relay_publication_mismatch and
// converge_relay_publication_mismatches_total, all exported from the start.
const (
	// mismatchMissing: the publication does not exist (dropped while the
	// relay streamed; the relay creates it again when it opens its next
	// session).
	mismatchMissing = "missing"
	// mismatchNotCovered: the publication does not cover
	// public.outbox_event (the table was dropped from it, or dropped and
	// recreated).
	mismatchNotCovered = "not_covered"
	// mismatchNoInsert: the publication does not publish inserts.
	mismatchNoInsert = "no_insert"
	// mismatchColumns: a pgoutput Relation message of public.outbox_event
	// lacks a column the relay reads (a migration renamed or dropped it).
	mismatchColumns = "columns"
)

var mismatchReasons = []string{mismatchMissing, mismatchNotCovered, mismatchNoInsert, mismatchColumns}

// mismatchError is a finding of a publication check (wrapping
// ErrPublicationMismatch) or of the replication stream (stream true: an
// outbox Relation message without a column, wrapping ErrRelationMismatch;
// the walsender failing on WAL written while the publication did not
// exist, wrapping ErrPublicationMismatch). Its text names the fix.
type mismatchError struct {
	sentinel error
	reason   string // one of mismatchReasons
	msg      string
	stream   bool
}

func (e *mismatchError) Error() string { return e.sentinel.Error() + ": " + e.msg }
func (e *mismatchError) Unwrap() error { return e.sentinel }

// mismatchRelog is how often a mismatch that lasts is logged again.
const mismatchRelog = 5 * time.Minute

// pubState is what the relay last found about the delivery of outbox
// inserts: the last publication check (catalog) and what the last sessions
// met in the stream and could not get past (stream). Both are kept across
// sessions; Relay.Health reports them.
type pubState struct {
	mu      sync.Mutex
	catalog *mismatchError
	stream  *mismatchError
	// streamAt is the WAL position the stream finding was met at: a slot
	// confirmed past it will not meet it again.
	streamAt pglogrepl.LSN
	loggedAt [2]time.Time // last error log of catalog, stream
}

// Health reports whether the relay can deliver outbox inserts: nil, or an
// error wrapping ErrPublicationMismatch (the last publication check found
// that the publication does not exist, does not cover public.outbox_event
// or does not publish inserts; or PostgreSQL cannot decode the WAL written
// while it did not exist) and/or ErrRelationMismatch (the outbox's
// pgoutput Relation message lacks a column the relay reads), whose text
// names the fix. While it is not nil the relay does not stream and the
// slot does not advance (package doc, "Publication checks"). Safe for
// concurrent use; `converge relay` serves it as GET /readyz.
func (r *Relay) Health() error {
	r.pub.mu.Lock()
	defer r.pub.mu.Unlock()
	var errs []error
	if r.pub.catalog != nil {
		errs = append(errs, r.pub.catalog)
	}
	if r.pub.stream != nil {
		errs = append(errs, r.pub.stream)
	}
	return errors.Join(errs...)
}

// noteCatalog records the result of a publication check: nil (the
// publication delivers outbox inserts) or a *mismatchError. Other errors
// (the check could not run) leave the state as it was.
func (r *Relay) noteCatalog(ctx context.Context, err error) {
	var me *mismatchError
	if err != nil && !errors.As(err, &me) {
		return
	}
	r.pub.mu.Lock()
	defer r.pub.mu.Unlock()
	r.note(ctx, &r.pub.catalog, me, 0, "the publication does not deliver outbox inserts; the relay does not stream and the slot stays where it is until it does (checked every SlotSampleInterval)",
		"the publication delivers outbox inserts again; the reconciler republishes the rows written meanwhile")
}

// noteStream records a finding of the stream met at WAL position at (the
// commit LSN of the transaction it was met in), or nil: an outbox Relation
// message of the transaction committed at at mapped. A nil clears the
// finding only from its own position on: a session that resumes from the
// slot's confirmed position may first get transactions committed before
// the one it cannot pass, whose Relation messages still map.
func (r *Relay) noteStream(ctx context.Context, me *mismatchError, at pglogrepl.LSN) {
	r.pub.mu.Lock()
	defer r.pub.mu.Unlock()
	if me == nil && r.pub.stream != nil && at < r.pub.streamAt {
		return
	}
	if me != nil {
		r.pub.streamAt = at
	}
	r.note(ctx, &r.pub.stream, me, 1, "the relay cannot stream past this point of the slot; it tries again every SlotSampleInterval",
		"the relay streams past the point it could not pass")
}

// clearStreamBefore forgets the stream finding once the slot's confirmed
// position passed where it was met (an operator moved the slot past it).
func (r *Relay) clearStreamBefore(ctx context.Context, confirmed pglogrepl.LSN) {
	r.pub.mu.Lock()
	defer r.pub.mu.Unlock()
	if r.pub.stream != nil && confirmed > r.pub.streamAt {
		r.note(ctx, &r.pub.stream, nil, 1, "", "the slot was moved past the point the relay could not pass; the reconciler republishes the outbox rows left behind")
	}
}

// note sets *cur to me, counts and logs a new finding, logs a lasting one
// every mismatchRelog and its end, and sets the gauges; r.pub.mu is held.
func (r *Relay) note(ctx context.Context, cur **mismatchError, me *mismatchError, logIdx int, badMsg, fixedMsg string) {
	prev := *cur
	*cur = me
	now := time.Now()
	switch {
	case me == nil && prev != nil:
		r.log.InfoContext(ctx, fixedMsg, slog.String("was", prev.Error()))
	case me != nil && (prev == nil || prev.reason != me.reason):
		r.m.pubMismatches.WithLabelValues(me.reason).Inc()
		r.log.ErrorContext(ctx, badMsg, slog.String("reason", me.reason), slog.String("error", me.Error()))
		r.pub.loggedAt[logIdx] = now
	case me != nil && now.Sub(r.pub.loggedAt[logIdx]) >= mismatchRelog:
		r.log.ErrorContext(ctx, badMsg, slog.String("reason", me.reason), slog.String("error", me.Error()))
		r.pub.loggedAt[logIdx] = now
	}
	for _, reason := range mismatchReasons {
		v := 0.0
		if (r.pub.catalog != nil && r.pub.catalog.reason == reason) || (r.pub.stream != nil && r.pub.stream.reason == reason) {
			v = 1
		}
		r.m.pubMismatch.WithLabelValues(reason).Set(v)
	}
}

// awaitPublication creates the publication when it is missing and returns
// once it delivers outbox inserts: while it does not
// (ErrPublicationMismatch) it records the finding, samples the slot's
// gauges and checks again every SlotSampleInterval, before the relay holds
// the slot. With
// RepairPublication a mismatch is recorded, then repaired. It returns
// ctx's error when ctx ends while it waits, and any other error of a
// check.
func (s *session) awaitPublication(ctx context.Context) error {
	name := s.cfg.PublicationName
	for {
		created, err := s.store.ensurePublication(ctx, name)
		if created {
			s.log.InfoContext(ctx, "created publication", slog.String("publication", name))
		}
		if errors.Is(err, ErrPublicationMismatch) && s.cfg.RepairPublication {
			s.r.noteCatalog(ctx, err)
			s.log.WarnContext(ctx, "the publication no longer covered the outbox; repairing it (RepairPublication); the reconciler republishes the rows written meanwhile",
				slog.String("publication", name), slog.String("error", err.Error()))
			err = s.store.repairPublication(ctx, name)
		}
		if !errors.Is(err, ErrPublicationMismatch) {
			if err == nil {
				s.r.noteCatalog(ctx, nil)
			}
			return err
		}
		s.r.noteCatalog(ctx, err)
		// The slot (if there is one yet) keeps WAL meanwhile: keep its
		// gauges current for the WAL alerts.
		if st, err := s.store.slotStats(ctx, s.cfg.SlotName); err == nil && st.exists {
			s.setSlotStats(st)
		}
		if !backoff.Wait(ctx, s.cfg.SlotSampleInterval) {
			return ctx.Err()
		}
	}
}

// handleRelation maps a pgoutput Relation message, sent before the first
// change of a relation in a session and after its schema changed. One of
// public.outbox_event must carry every column the relay reads: otherwise
// the finding is recorded (Health) and the session ends before the row
// with ErrRelationMismatch; one that maps clears an earlier finding and
// asks the monitor for a publication check. A Relation message of any
// other table (a publication of several tables) is kept and its rows
// ignored.
func (s *session) handleRelation(ctx context.Context, m *pglogrepl.RelationMessage) error {
	rel, err := newRelation(m)
	if err != nil {
		var me *mismatchError
		if errors.As(err, &me) {
			me.msg += "; restore it with a migration, then stop the relay, move its slot past the rows written without it (SELECT pg_replication_slot_advance('" +
				s.cfg.SlotName + "', pg_current_wal_lsn())) and start it: the reconciler republishes those rows"
			s.r.noteStream(ctx, me, s.txnCommitLSN)
		}
		return err
	}
	s.relations[m.RelationID] = rel
	if rel.outbox {
		s.r.noteStream(ctx, nil, s.txnCommitLSN)
		select {
		case s.checkNow <- struct{}{}:
		default: // a check is already due
		}
	}
	return nil
}

// publicationGone turns the walsender's "publication ... does not exist"
// (SQLSTATE 42704) into a stream finding. PostgreSQL before 18 decodes each
// change with the catalog as of its position and fails on every change
// written while the publication did not exist, even once the relay created
// it again: the sessions cannot pass that WAL until an operator moves the
// slot past it.
func (s *session) publicationGone(ctx context.Context, pgErr *pgconn.PgError) error {
	me := &mismatchError{sentinel: ErrPublicationMismatch, reason: mismatchMissing, stream: true,
		msg: fmt.Sprintf("PostgreSQL cannot decode the WAL written while publication %s did not exist (walsender: %s), even once it exists again; stop the relay, move its slot past that WAL (SELECT pg_replication_slot_advance('%s', pg_current_wal_lsn())) and start it: the reconciler republishes the outbox rows written meanwhile",
			s.cfg.PublicationName, pgErr.Message, s.cfg.SlotName)}
	s.r.noteStream(ctx, me, pglogrepl.LSN(s.r.confirmed.Load()))
	return me
}

// isPublicationGone reports the walsender's error for a publication that
// does not exist.
func isPublicationGone(pgErr *pgconn.PgError) bool {
	return pgErr.Code == pgUndefinedObject && strings.Contains(pgErr.Message, "publication")
}
