package cdc

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
)

// trackerOp is one step of a tracker scenario. txn indexes the scenario's
// transactions in begin order.
type trackerOp struct {
	kind string // begin, add, ack, park, commit, fail, abandon, flush, flushParksExcept, want
	txn  int
	id   string
	lsn  pglogrepl.LSN // commit: end LSN; want: confirmable LSN
}

func begin(txn int) trackerOp          { return trackerOp{kind: "begin", txn: txn} }
func add(txn int, id string) trackerOp { return trackerOp{kind: "add", txn: txn, id: id} }
func ack(txn int, id string) trackerOp { return trackerOp{kind: "ack", txn: txn, id: id} }

// park: the row is refused for good (tracker.ackPark); a flush parks it.
func park(txn int, id string) trackerOp { return trackerOp{kind: "park", txn: txn, id: id} }
func commit(txn int, lsn pglogrepl.LSN) trackerOp {
	return trackerOp{kind: "commit", txn: txn, lsn: lsn}
}
func fail(txn int) trackerOp    { return trackerOp{kind: "fail", txn: txn} }
func abandon(txn int) trackerOp { return trackerOp{kind: "abandon", txn: txn} }

// flush parks the rows to park, then records the settled transactions.
func flush() trackerOp { return trackerOp{kind: "flush"} }

// flushParksExcept is a flush that found row id (to park) not yet visible
// and gives it back (tracker.requeueParks).
func flushParksExcept(id string) trackerOp { return trackerOp{kind: "flushParksExcept", id: id} }
func want(lsn pglogrepl.LSN) trackerOp     { return trackerOp{kind: "want", lsn: lsn} }

func TestTracker(t *testing.T) {
	t.Parallel()
	const start = pglogrepl.LSN(10)
	tests := []struct {
		name    string
		ops     []trackerOp
		wantErr bool
	}{
		{
			name: "multi-row transaction confirms only when every row is acknowledged and the transaction recorded",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), add(0, "c"), commit(0, 100),
				want(start),
				ack(0, "a"), ack(0, "c"), flush(), want(start),
				ack(0, "b"), want(start), // settled but not yet recorded
				flush(), want(100),
			},
		},
		{
			name: "out-of-order acks across transactions confirm the contiguous prefix only",
			ops: []trackerOp{
				begin(0), add(0, "a"), commit(0, 100),
				begin(1), add(1, "b"), commit(1, 200),
				begin(2), add(2, "c"), commit(2, 300),
				ack(2, "c"), ack(1, "b"), flush(), want(start),
				ack(0, "a"), flush(), want(300),
			},
		},
		{
			name: "a done transaction after an unfinished one is not confirmed",
			ops: []trackerOp{
				begin(0), add(0, "a"), commit(0, 100),
				begin(1), add(1, "b1"), add(1, "b2"), commit(1, 200),
				begin(2), add(2, "c"), commit(2, 300),
				ack(0, "a"), ack(1, "b1"), ack(2, "c"), flush(), want(100),
				ack(1, "b2"), flush(), want(300),
			},
		},
		{
			name: "rows acknowledged before their commit is seen wait for the commit and a record",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), ack(0, "a"), ack(0, "b"), flush(),
				want(start),
				commit(0, 100), want(start),
				flush(), want(100),
			},
		},
		{
			name: "an empty transaction (a heartbeat) is confirmed at its commit, never past an unfinished one",
			ops: []trackerOp{
				begin(0), commit(0, 100), want(100),
				begin(1), add(1, "a"), commit(1, 200),
				begin(2), commit(2, 300), want(100),
				ack(1, "a"), flush(), want(300),
			},
		},
		{
			name: "a failed produce blocks the slot and is reported",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), commit(0, 100),
				begin(1), add(1, "c"), commit(1, 200),
				ack(0, "a"), fail(0), ack(1, "c"), flush(), want(start),
			},
			wantErr: true,
		},
		{
			name: "an abandoned record blocks the slot without an error",
			ops: []trackerOp{
				begin(0), add(0, "a"), commit(0, 100),
				begin(1), add(1, "b"), commit(1, 200),
				ack(1, "b"), abandon(0), flush(), want(start),
			},
		},
		{
			name: "a row parked settles its transaction like an acknowledgement",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), commit(0, 100),
				ack(0, "a"), park(0, "b"), want(start),
				flush(), want(100),
			},
		},
		{
			name: "a row to park not yet visible holds its transaction and every later one until a flush parks it",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), commit(0, 100),
				begin(1), add(1, "c"), commit(1, 200),
				ack(0, "a"), park(0, "b"), ack(1, "c"), flushParksExcept("b"), want(start),
				flushParksExcept("b"), want(start), // still not visible: given back again
				flush(), want(200),
			},
		},
		{
			name: "the confirmable LSN never moves back",
			ops: []trackerOp{
				begin(0), commit(0, 5), want(start),
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tokens := make(chan struct{}, 100)
			tr := newTracker(start, tokens)
			var seqs []uint64
			flushTracker := func(keep string) {
				var done, back []parkRow
				for _, r := range tr.takeParks() {
					if r.outboxID == keep {
						back = append(back, r)
					} else {
						done = append(done, r)
					}
				}
				tr.parksDone(done)
				tr.requeueParks(back)
				tr.recorded(tr.takeReady())
			}
			for i, op := range tc.ops {
				switch op.kind {
				case "begin":
					if op.txn != len(seqs) {
						t.Fatalf("op %d: begin txn %d out of order", i, op.txn)
					}
					tokens <- struct{}{}
					seqs = append(seqs, tr.begin(time.Now(), uint32(100+op.txn)))
				case "add":
					tr.add(seqs[op.txn])
				case "ack":
					tr.ack(seqs[op.txn])
				case "park":
					tr.ackPark(seqs[op.txn], op.id, parkReason{code: "TEST"})
				case "commit":
					tr.commit(seqs[op.txn], op.lsn)
				case "fail":
					tr.fail(seqs[op.txn], errors.New("boom"))
				case "abandon":
					tr.fail(seqs[op.txn], nil)
				case "flush":
					flushTracker("")
				case "flushParksExcept":
					flushTracker(op.id)
					if tr.pending() != 1 {
						t.Fatalf("op %d: pending = %d after requeue, want 1", i, tr.pending())
					}
				case "want":
					if got := tr.confirmable(); got != op.lsn {
						t.Fatalf("op %d: confirmable = %s, want %s", i, got, op.lsn)
					}
				}
			}
			if err := tr.failure(); (err != nil) != tc.wantErr {
				t.Fatalf("failure() = %v, want error: %v", err, tc.wantErr)
			}
			if txns, _ := tr.stats(); len(tokens) != txns {
				t.Fatalf("%d transaction tokens held for %d tracked transactions", len(tokens), txns)
			}
		})
	}
}

func TestTrackerAckedAndStats(t *testing.T) {
	t.Parallel()
	tr := newTracker(0, nil)
	commitTime := time.Now().Add(-time.Second)

	// Last ack after the commit completes the transaction.
	s0 := tr.begin(commitTime, 7)
	tr.add(s0)
	tr.add(s0)
	if a := tr.commit(s0, 100); a.ok {
		t.Fatal("commit reported a transaction with unacknowledged rows as acknowledged")
	}
	if a := tr.ack(s0); a.ok {
		t.Fatal("first of two acks reported the transaction acknowledged")
	}
	if a := tr.ack(s0); !a.ok || !a.commitTime.Equal(commitTime) || a.pending != 1 {
		t.Fatalf("last ack = %+v, want ok with the commit time and 1 transaction pending", a)
	}

	// Commit after the last ack completes the transaction.
	s1 := tr.begin(commitTime, 8)
	tr.add(s1)
	if a := tr.ack(s1); a.ok {
		t.Fatal("ack before commit reported the transaction acknowledged")
	}
	if a := tr.commit(s1, 200); !a.ok {
		t.Fatal("commit after the last ack did not report the transaction acknowledged")
	}

	if txns, recs := tr.stats(); txns != 2 || recs != 0 {
		t.Fatalf("stats = %d txns, %d records; want 2, 0 (acknowledged rows are not in flight)", txns, recs)
	}
	if n := tr.pending(); n != 2 {
		t.Fatalf("pending = %d, want 2", n)
	}
	ready := tr.takeReady()
	if len(ready) != 2 || ready[0].xid != 7 || ready[1].xid != 8 {
		t.Fatalf("ready = %+v, want xids 7 and 8", ready)
	}
	if got := tr.confirmable(); got != 0 {
		t.Fatalf("confirmable = %s before the record, want 0", got)
	}
	tr.recorded(ready)
	if txns, recs := tr.stats(); txns != 0 || recs != 0 {
		t.Fatalf("stats after recorded = %d txns, %d records; want 0, 0", txns, recs)
	}
	if got := tr.confirmable(); got != 200 {
		t.Fatalf("confirmable = %s, want %s", got, pglogrepl.LSN(200))
	}
	// Sequence numbers keep counting after the prefix was popped.
	s2 := tr.begin(commitTime, 9)
	if s2 != s1+1 {
		t.Fatalf("seq = %d, want %d", s2, s1+1)
	}
	tr.commit(s2, 300)
	if got := tr.confirmable(); got != 300 {
		t.Fatalf("confirmable = %s, want %s", got, pglogrepl.LSN(300))
	}
}
