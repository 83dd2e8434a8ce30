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
	kind string // begin, add, ack, commit, fail, abandon, flush, want
	txn  int
	id   string
	lsn  pglogrepl.LSN // commit: end LSN; want: confirmable LSN
}

func begin(txn int) trackerOp          { return trackerOp{kind: "begin", txn: txn} }
func add(txn int, id string) trackerOp { return trackerOp{kind: "add", txn: txn, id: id} }
func ack(txn int, id string) trackerOp { return trackerOp{kind: "ack", txn: txn, id: id} }
func commit(txn int, lsn pglogrepl.LSN) trackerOp {
	return trackerOp{kind: "commit", txn: txn, lsn: lsn}
}
func fail(txn int) trackerOp    { return trackerOp{kind: "fail", txn: txn} }
func abandon(txn int) trackerOp { return trackerOp{kind: "abandon", txn: txn} }
func flush() trackerOp          { return trackerOp{kind: "flush"} }

// flushExcept marks every acknowledged row done except id, which the flush
// found not yet visible and gives back (tracker.requeue).
func flushExcept(id string) trackerOp  { return trackerOp{kind: "flushExcept", id: id} }
func want(lsn pglogrepl.LSN) trackerOp { return trackerOp{kind: "want", lsn: lsn} }

func TestTracker(t *testing.T) {
	t.Parallel()
	const start = pglogrepl.LSN(10)
	tests := []struct {
		name    string
		ops     []trackerOp
		wantErr bool
	}{
		{
			name: "multi-row transaction confirms only when every row is marked published",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), add(0, "c"), commit(0, 100),
				want(start),
				ack(0, "a"), ack(0, "c"), flush(), want(start),
				ack(0, "b"), want(start), // acknowledged but not yet marked published
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
			name: "rows acknowledged before their commit is seen wait for the commit",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), ack(0, "a"), ack(0, "b"), flush(),
				want(start),
				commit(0, 100), want(100),
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
			name: "a row not yet visible holds its transaction and every later one until a flush marks it",
			ops: []trackerOp{
				begin(0), add(0, "a"), add(0, "b"), commit(0, 100),
				begin(1), add(1, "c"), commit(1, 200),
				ack(0, "a"), ack(0, "b"), ack(1, "c"), flushExcept("b"), want(start),
				flushExcept("b"), want(start), // still not visible: given back again
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
			tr := newTracker(start)
			var seqs []uint64
			for i, op := range tc.ops {
				switch op.kind {
				case "begin":
					if op.txn != len(seqs) {
						t.Fatalf("op %d: begin txn %d out of order", i, op.txn)
					}
					seqs = append(seqs, tr.begin(time.Now(), 0))
				case "add":
					tr.add(seqs[op.txn])
				case "ack":
					tr.ack(seqs[op.txn], op.id)
				case "commit":
					tr.commit(seqs[op.txn], op.lsn)
				case "fail":
					tr.fail(seqs[op.txn], errors.New("boom"))
				case "abandon":
					tr.fail(seqs[op.txn], nil)
				case "flush":
					tr.markDone(tr.takeAcked())
				case "flushExcept":
					var done, back []ackedRow
					for _, r := range tr.takeAcked() {
						if r.outboxID == op.id {
							back = append(back, r)
						} else {
							done = append(done, r)
						}
					}
					tr.markDone(done)
					tr.requeue(back)
					if tr.pending() != len(back) {
						t.Fatalf("op %d: pending = %d after requeue, want %d", i, tr.pending(), len(back))
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
		})
	}
}

func TestTrackerAckedAndStats(t *testing.T) {
	t.Parallel()
	tr := newTracker(0)
	commitTime := time.Now().Add(-time.Second)

	// Last ack after the commit completes the transaction.
	s0 := tr.begin(commitTime, 0)
	tr.add(s0)
	tr.add(s0)
	if a := tr.commit(s0, 100); a.ok {
		t.Fatal("commit reported a transaction with unacknowledged rows as acknowledged")
	}
	if a := tr.ack(s0, "a"); a.ok {
		t.Fatal("first of two acks reported the transaction acknowledged")
	}
	if a := tr.ack(s0, "b"); !a.ok || !a.commitTime.Equal(commitTime) {
		t.Fatalf("last ack = %+v, want ok with the commit time", a)
	}

	// Commit after the last ack completes the transaction.
	s1 := tr.begin(commitTime, 0)
	tr.add(s1)
	if a := tr.ack(s1, "c"); a.ok {
		t.Fatal("ack before commit reported the transaction acknowledged")
	}
	if a := tr.commit(s1, 200); !a.ok {
		t.Fatal("commit after the last ack did not report the transaction acknowledged")
	}

	if txns, recs := tr.stats(); txns != 2 || recs != 3 {
		t.Fatalf("stats = %d txns, %d records; want 2, 3", txns, recs)
	}
	if n := tr.pending(); n != 3 {
		t.Fatalf("pending = %d, want 3", n)
	}
	rows := tr.takeAcked()
	tr.markDone(rows)
	if txns, recs := tr.stats(); txns != 0 || recs != 0 {
		t.Fatalf("stats after markDone = %d txns, %d records; want 0, 0", txns, recs)
	}
	if got := tr.confirmable(); got != 200 {
		t.Fatalf("confirmable = %s, want %s", got, pglogrepl.LSN(200))
	}
	// Sequence numbers keep counting after the prefix was popped.
	s2 := tr.begin(commitTime, 0)
	if s2 != s1+1 {
		t.Fatalf("seq = %d, want %d", s2, s1+1)
	}
	tr.commit(s2, 300)
	if got := tr.confirmable(); got != 300 {
		t.Fatalf("confirmable = %s, want %s", got, pglogrepl.LSN(300))
	}
}
