package cdc

import (
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
)

// tracker decides how far the replication slot may advance.
//
// It holds the decoded transactions in WAL order that are not yet confirmed.
// A transaction is done when its Commit message was seen, every row it
// produced is settled — acknowledged by Kafka, or parked in outbox_event —
// and, if it had rows, the relay recorded it as published
// (outbox.RecordTransactions, migration 00015). The confirmable LSN is the
// end LSN of the last transaction of the longest done prefix: franz-go
// completes partitions independently, so the last acknowledgement says
// nothing about earlier records (DESIGN.md, Pitfalls). Several rows of a
// transaction share its commit, so a restart resumes at transaction
// granularity.
//
// The replication loop calls begin, add and commit; the producer stage calls
// fail for rows it cannot produce; produce promises call ack, ackPark and
// fail from franz-go's goroutines; the marker goroutine calls takeParks,
// parksDone, requeueParks, takeReady and recorded. All methods are safe for
// concurrent use.
type tracker struct {
	mu        sync.Mutex
	confirmed pglogrepl.LSN
	txns      []*txnState // unconfirmed transactions, WAL order
	firstSeq  uint64      // seq of txns[0] (or nextSeq when empty)
	nextSeq   uint64
	parks     []parkRow  // rows to park, not parked yet
	ready     []readyTxn // settled transactions waiting to be recorded
	inFlight  int        // rows produced and not yet settled
	err       error      // first produce failure
	txnTokens chan struct{}
	// produceFailures are the records whose produce failed this session
	// (bounded by MaxBufferedRecords: each was in flight), recorded on
	// their rows when the session ends.
	produceFailures []*produceError
}

// txnState is one decoded transaction.
type txnState struct {
	xid        uint32 // top-level transaction id (pgoutput Begin)
	commitTime time.Time
	endLSN     pglogrepl.LSN
	committed  bool
	failed     bool
	produced   int
	acked      int  // acknowledged by Kafka, or refused for good (to park)
	done       int  // acknowledged, or parked
	queued     bool // in tracker.ready
	recorded   bool // outbox.RecordTransactions committed
}

// settled reports that the transaction's Commit was seen and every row of
// it is acknowledged or parked.
func (x *txnState) settled() bool {
	return x.committed && !x.failed && x.done == x.produced
}

// readyTxn is a settled transaction with rows: the marker records it
// (outbox.RecordTransactions) before the slot may pass it.
type readyTxn struct {
	seq uint64
	xid uint32
}

// parkRow is a row the broker refused for good, or that cannot be decoded:
// its transaction (sequence number and top-level xid), outbox id and why.
// The marker parks it (outbox.Park). invisibleSince is set when a flush found
// the row not yet visible to other sessions (see outbox.Classify).
type parkRow struct {
	seq            uint64
	xid            uint32
	outboxID       string
	invisibleSince time.Time
	why            parkReason
}

// parkReason is a stable error code and the error's text.
type parkReason struct{ code, message string }

// txnAcked reports a transaction whose rows are all acknowledged by Kafka and
// whose Commit was seen (for the commit→ack latency); ok is false otherwise.
type txnAcked struct {
	commitTime time.Time
	ok         bool
	// pending is the number of transactions and rows waiting for the
	// marker after this acknowledgement (set by ack only).
	pending int
}

// newTracker returns a tracker whose confirmable LSN starts at confirmed (the
// slot's confirmed_flush_lsn). txnTokens, when not nil, holds a token for
// every tracked transaction (the caller sends one before begin); the tracker
// takes it back when the transaction is confirmed, which bounds the
// transactions held in memory.
func newTracker(confirmed pglogrepl.LSN, txnTokens chan struct{}) *tracker {
	return &tracker{confirmed: confirmed, txnTokens: txnTokens}
}

func (t *tracker) txn(seq uint64) *txnState {
	if seq < t.firstSeq || seq >= t.nextSeq {
		panic(fmt.Sprintf("cdc tracker: transaction %d not tracked (tracking %d..%d)", seq, t.firstSeq, t.nextSeq))
	}
	return t.txns[seq-t.firstSeq]
}

// begin tracks a new transaction (BeginMessage of top-level transaction
// xid) and returns its sequence number.
func (t *tracker) begin(commitTime time.Time, xid uint32) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	seq := t.nextSeq
	t.nextSeq++
	t.txns = append(t.txns, &txnState{commitTime: commitTime, xid: xid})
	return seq
}

// add counts one row of transaction seq as produced. Call it before handing
// the record to the producer.
func (t *tracker) add(seq uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.txn(seq).produced++
	t.inFlight++
}

// ack records Kafka's acknowledgement of a row of transaction seq: the row
// is settled.
func (t *tracker) ack(seq uint64) txnAcked {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.txn(seq)
	x.acked++
	x.done++
	t.inFlight--
	t.queue(seq, x)
	a := x.ackedResult()
	a.pending = len(t.ready) + len(t.parks)
	return a
}

// ackPark records that row outboxID of transaction seq will never be
// acknowledged for a reason retrying cannot fix (the broker refuses the
// record, the row cannot be decoded): it is settled once the marker parked
// it (parksDone).
func (t *tracker) ackPark(seq uint64, outboxID string, why parkReason) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.txn(seq)
	x.acked++
	t.parks = append(t.parks, parkRow{seq: seq, xid: x.xid, outboxID: outboxID, why: why})
}

// fail records that a row of transaction seq will never be acknowledged, so
// the slot never advances past the transaction in this run. A non-nil err is
// kept as failure() when it is the first; nil means the row was abandoned on
// shutdown.
func (t *tracker) fail(seq uint64, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.txn(seq).failed = true
	if t.err == nil && err != nil {
		t.err = err
	}
	if pe, ok := err.(*produceError); ok { //nolint:errorlint // the marker passes it unwrapped
		t.produceFailures = append(t.produceFailures, pe)
	}
}

// failedProduces returns the records whose produce failed this session
// (fail with a *produceError), in the order they failed.
func (t *tracker) failedProduces() []*produceError {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]*produceError(nil), t.produceFailures...)
}

// commit records the Commit message of transaction seq, whose end LSN (the
// end of its commit record) is endLSN.
func (t *tracker) commit(seq uint64, endLSN pglogrepl.LSN) txnAcked {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.txn(seq)
	x.committed = true
	x.endLSN = endLSN
	a := x.ackedResult()
	t.queue(seq, x)
	t.advance()
	return a
}

// queue puts transaction seq on the ready list once it is settled and has
// rows; t.mu is held.
func (t *tracker) queue(seq uint64, x *txnState) {
	if x.produced > 0 && !x.queued && x.settled() {
		x.queued = true
		t.ready = append(t.ready, readyTxn{seq: seq, xid: x.xid})
	}
}

func (x *txnState) ackedResult() txnAcked {
	if x.committed && !x.failed && x.produced > 0 && x.acked == x.produced {
		return txnAcked{commitTime: x.commitTime, ok: true}
	}
	return txnAcked{}
}

// pending returns how many transactions and rows wait for the marker.
func (t *tracker) pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.ready) + len(t.parks)
}

// take empties *list, a list of t, under t.mu and returns what it held.
func take[T any](t *tracker, list *[]T) []T {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := *list
	*list = nil
	return out
}

// takeParks removes and returns the rows waiting to be parked.
func (t *tracker) takeParks() []parkRow { return take(t, &t.parks) }

// requeueParks gives back rows that a flush could not park (not yet visible
// to other sessions): the next flush takes them again, before the rows
// refused since. Their transactions stay unconfirmed.
func (t *tracker) requeueParks(rows []parkRow) {
	if len(rows) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.parks = append(rows[:len(rows):len(rows)], t.parks...)
}

// parksDone counts rows as settled: call it only after their park committed
// (or after they were found settled already, or gone).
func (t *tracker) parksDone(rows []parkRow) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range rows {
		x := t.txn(r.seq)
		x.done++
		t.inFlight--
		t.queue(r.seq, x)
	}
}

// takeReady removes and returns the settled transactions waiting to be
// recorded, in the order they settled.
func (t *tracker) takeReady() []readyTxn { return take(t, &t.ready) }

// recorded marks transactions as recorded: call it only after
// outbox.RecordTransactions committed for them. It advances the confirmable
// LSN.
func (t *tracker) recorded(txns []readyTxn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range txns {
		t.txn(r.seq).recorded = true
	}
	t.advance()
}

// advance pops the done prefix of transactions and returns their tokens;
// t.mu is held.
func (t *tracker) advance() {
	n := 0
	for _, x := range t.txns {
		if !x.settled() || (x.produced > 0 && !x.recorded) {
			break
		}
		if x.endLSN > t.confirmed {
			t.confirmed = x.endLSN
		}
		n++
	}
	if n == 0 {
		return
	}
	clear(t.txns[:n])
	t.txns = t.txns[n:]
	t.firstSeq += uint64(n)
	if len(t.txns) == 0 {
		t.txns = nil // let the backing array go
	}
	if t.txnTokens != nil {
		for range n {
			<-t.txnTokens
		}
	}
}

// advanceIdle moves the confirmable LSN to lsn (the walsender's sent
// position from a keepalive) when no transaction is tracked: every
// transaction committed before it was then received and is done. It does
// nothing while any transaction is tracked, and never moves back.
func (t *tracker) advanceIdle(lsn pglogrepl.LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.txns) == 0 && lsn > t.confirmed {
		t.confirmed = lsn
	}
}

// confirmable returns the end LSN up to which every transaction is done: the
// LSN the standby status update may report.
func (t *tracker) confirmable() pglogrepl.LSN {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.confirmed
}

// failure returns the first produce failure, or nil.
func (t *tracker) failure() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// stats returns the unconfirmed transactions and the produced rows not yet
// settled.
func (t *tracker) stats() (txns, records int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.txns), t.inFlight
}
