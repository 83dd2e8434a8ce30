package worker

import (
	"context"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// leaseBy inserts the inbox row of c's TaskCreated event as another
// instance's delivery would: processing, leased to owner for lease.
func (b *testBundle) leaseBy(t *testing.T, c created, owner string, lease time.Duration) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), `
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, locked_by, locked_until)
VALUES ($1, $2, $3, 'processing', $4, now() + $5::bigint * interval '1 millisecond')`,
		DefaultGroup, c.ev.EventID, c.sum, owner, lease.Milliseconds())
	if err != nil {
		t.Fatal(err)
	}
}

// Seed 6: a message found processing under another instance's live lease
// is not processed concurrently: the delivery waits (lease_held, not
// counted against MaxAttempts) and takes the message over once the lease
// has expired, then completes it.
func TestLiveLeaseOfAnotherInstanceIsWaitedFor(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.maxAttempts = 2 // lease waits must not exhaust it
	c := createTask(t, b.db.Pool, []byte(`{"lease":"held"}`))
	b.leaseBy(t, c, "other-instance", 3*time.Second)
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "delivery waits on the lease", func() bool { return rw.count(OutcomeLeaseHeld) >= 2 })
	if s := b.status(c.taskID); s != taskevent.StatusQueued {
		t.Fatalf("task %s while another instance's lease is live, want queued (not processed concurrently)", s)
	}
	if n := b.objects(t, c.taskID); n != 0 {
		t.Fatalf("%d artifacts written while the lease is live, want 0", n)
	}
	testenv.Eventually(t, waitFor, "task completed after the lease expired", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := b.scalar(t, `SELECT locked_by FROM inbox_message WHERE message_id = $1`, c.ev.EventID); got != rw.w.lease.Owner {
		t.Errorf("locked_by = %v, want this worker %q (it took the message over)", got, rw.w.lease.Owner)
	}
	if rw.count(OutcomeProcessed) != 1 || rw.count(OutcomeDeadLettered) != 0 {
		t.Errorf("processed=%v dead_lettered=%v, want 1 0", rw.count(OutcomeProcessed), rw.count(OutcomeDeadLettered))
	}
}

// A holder that finishes the message while another delivery waits on its
// lease ends the wait: the waiting delivery is a duplicate, long before
// the lease would expire.
func TestHolderFinishingEndsTheLeaseWait(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"lease":"finished"}`))
	b.leaseBy(t, c, "other-instance", time.Hour)
	b.produce(t, c.record())
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "delivery waits on the lease", func() bool { return rw.count(OutcomeLeaseHeld) >= 1 })
	if _, err := b.db.Pool.Exec(context.Background(),
		`UPDATE inbox_message SET state = 'completed', completed_at = now() WHERE message_id = $1`, c.ev.EventID); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitFor, "delivery is a duplicate", func() bool { return rw.count(OutcomeDuplicate) == 1 })
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if n := b.objects(t, c.taskID); n != 0 {
		t.Errorf("%d artifacts, want 0 (the holder's work is not repeated)", n)
	}
}

// An instance that gives a record up unfinished (it stops while retrying
// it) releases its lease, so the next instance resumes the record at once
// rather than after InboxLease.
func TestStoppedWorkerReleasesItsLease(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	c := createTask(t, b.db.Pool, []byte(`{"lease":"released"}`))
	b.produce(t, c.record())
	faults := &fault.Set{}
	if err := faults.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	a := b.start(t, faults)
	testenv.Eventually(t, waitFor, "fault fired", func() bool { return faults.Fired(fault.WorkerAfterArtifactWrite) >= 1 })
	if got := b.scalar(t, `SELECT locked_by FROM inbox_message WHERE message_id = $1`, c.ev.EventID); got != a.w.lease.Owner {
		t.Errorf("locked_by = %v while retrying, want %q", got, a.w.lease.Owner)
	}
	a.stop(t)
	if live := b.scalar(t, `SELECT locked_until IS NOT NULL FROM inbox_message WHERE message_id = $1`, c.ev.EventID); live != false {
		t.Fatalf("lease still set after the worker stopped")
	}
	w2 := b.start(t, nil)
	testenv.Eventually(t, waitFor, "task completed by the next instance", func() bool { return b.status(c.taskID) == taskevent.StatusCompleted })
	if w2.count(OutcomeLeaseHeld) != 0 {
		t.Errorf("lease_held = %v, want 0 (the lease was released)", w2.count(OutcomeLeaseHeld))
	}
	if n := b.objects(t, c.taskID); n != 1 {
		t.Errorf("%d artifacts, want 1", n)
	}
}
