package outbox

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/converge-run/converge/internal/dbpool"
)

// Commit visibility (issue 9). PostgreSQL writes and flushes a transaction's
// commit record, and wakes the WAL senders, before the committing backend
// leaves the proc array (and, with a synchronous standby, only after the
// standby confirmed). In that window the relay can decode the transaction,
// Kafka can acknowledge its events, and MarkPublished still does not see
// its rows: it changes fewer rows than it was given. Those rows are not
// done. A row's absence is only proof that it is gone (deleted after its
// commit) when the snapshot of the same statement already sees its
// transaction as finished; otherwise the row must be marked later.

// Status is what Unmarked learned about a row MarkPublished did not change.
type Status int

const (
	// Marked: the row is visible and settled: published_at is set (marked
	// by this or an earlier relay run) or it is parked (parked_at): done.
	Marked Status = iota
	// Unmarked: the row is visible but neither published nor parked (it
	// became visible after MarkPublished's or Park's snapshot): try again.
	Unmarked
	// Invisible: the row is not visible and its transaction is still in
	// progress for this session's snapshot: mark it later.
	Invisible
	// Gone: the row is not visible although its transaction is: it was
	// deleted after its commit. Nothing is left to mark: done.
	Gone
)

// Pending is a row MarkPublished was given: its outbox id and the top-level
// transaction id that inserted it (the xid of its pgoutput Begin message).
type Pending struct {
	ID  string
	XID uint32
}

// Classify tells, for rows whose MarkPublished changed fewer rows than it
// was given, which are done (Marked, Gone) and which must be marked later
// (Unmarked, Invisible), in one statement, so that the rows read and the
// snapshot that judges their transactions are the same
// (pg_current_snapshot returns the statement's snapshot). The result has
// one Status per row, in order.
func Classify(ctx context.Context, q dbpool.Querier, rows []Pending) ([]Status, error) {
	ids := make([]string, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	var (
		snapText            string
		published, unmarked []string
	)
	err := q.QueryRow(ctx, `
SELECT pg_current_snapshot()::text,
       COALESCE((SELECT array_agg(outbox_id) FROM outbox_event WHERE outbox_id = ANY($1) AND NOT (`+sqlUnpublishedRow+`)), '{}'),
       COALESCE((SELECT array_agg(outbox_id) FROM outbox_event WHERE outbox_id = ANY($1) AND `+sqlUnpublishedRow+`), '{}')`,
		ids).Scan(&snapText, &published, &unmarked)
	if err != nil {
		return nil, fmt.Errorf("read %d unmarked outbox rows: %w", len(rows), err)
	}
	snap, err := parseSnapshot(snapText)
	if err != nil {
		return nil, err
	}
	state := make(map[string]Status, len(published)+len(unmarked))
	for _, id := range published {
		state[id] = Marked
	}
	for _, id := range unmarked {
		state[id] = Unmarked
	}
	out := make([]Status, len(rows))
	for i, r := range rows {
		st, ok := state[r.ID]
		switch {
		case ok:
			out[i] = st
		case snap.visible(r.XID):
			out[i] = Gone
		default:
			out[i] = Invisible
		}
	}
	return out, nil
}

// snapshot is a pg_snapshot (PostgreSQL 13+): transactions below xmin are
// finished, those at or above xmax had not started, those in xip were in
// progress. Ids are full 64-bit transaction ids (epoch << 32 | xid).
type snapshot struct {
	xmin, xmax uint64
	xip        map[uint64]struct{}
}

// parseSnapshot parses the text form "xmin:xmax:xip1,xip2,...".
func parseSnapshot(s string) (snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return snapshot{}, fmt.Errorf("parse pg_snapshot %q: want xmin:xmax:xip", s)
	}
	var snap snapshot
	var err error
	if snap.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("parse pg_snapshot %q: %w", s, err)
	}
	if snap.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("parse pg_snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		snap.xip = map[uint64]struct{}{}
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return snapshot{}, fmt.Errorf("parse pg_snapshot %q: %w", s, err)
			}
			snap.xip[v] = struct{}{}
		}
	}
	return snap, nil
}

// fullXID widens a 32-bit transaction id that started before the snapshot
// was taken to its 64-bit form: the epoch of xmax, or the epoch before when
// the 32-bit value is not below xmax's low half (it wrapped around since).
func (s snapshot) fullXID(xid uint32) uint64 {
	epoch := s.xmax >> 32
	if uint64(xid) >= s.xmax&0xffffffff && epoch > 0 {
		epoch--
	}
	return epoch<<32 | uint64(xid)
}

// visible reports whether the effects of committed transaction xid are
// visible in the snapshot (PostgreSQL's pg_visible_in_snapshot).
func (s snapshot) visible(xid uint32) bool {
	full := s.fullXID(xid)
	switch {
	case full < s.xmin:
		return true
	case full >= s.xmax:
		return false
	}
	_, inProgress := s.xip[full]
	return !inProgress
}
