package cdc

import (
	"context"
	"net"
	"sync"
	"time"
)

// receiveDeadline bounds the stream loop's receives with the replication
// connection's read deadline, moved only when it must be, instead of one
// context with a deadline per message: pgconn watches every cancellable
// context it is given (a timer, an AfterFunc registration and their removal
// per receive), which cost about a fifth of the relay's CPU at three
// messages (BEGIN, INSERT, COMMIT) per outbox transaction (BENCHMARKS.md,
// session of 2026-12-06, fourth). The receives themselves are given
// context.Background(), which pgconn does not watch.
//
// A deadline that passes makes the blocked read return a timeout, which
// pgconn does not treat as fatal (a partly read message stays buffered), so
// the loop sends its status update and receives again. Cancelling the
// stream's context sets the deadline to now, which wakes a blocked read the
// same way.
type receiveDeadline struct {
	conn    net.Conn
	timeout time.Duration // the longest one wait may block (Config.ReceiveTimeout)
	until   time.Time     // the deadline set on conn; zero: none yet

	mu       sync.Mutex
	released bool
	stopWake func() bool
}

// newReceiveDeadline arms the wake-up of conn's reads on ctx's cancellation.
// release must be called before conn is used without deadlines again.
func newReceiveDeadline(ctx context.Context, conn net.Conn, timeout time.Duration) *receiveDeadline {
	d := &receiveDeadline{conn: conn, timeout: timeout}
	d.stopWake = context.AfterFunc(ctx, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if !d.released {
			_ = d.conn.SetReadDeadline(time.Now())
		}
	})
	return d
}

// before makes the next receive return by min(now+timeout, status), the
// time the next status update is due. It moves the connection's deadline
// only when the current one has passed, is later than wanted, or is more
// than half a timeout earlier than wanted. While messages flow that is once
// per status interval when the interval is the shorter (the deadline is then
// the status time; with the defaults, 1 s each, once a second), else about
// twice per timeout; never per message. The caller checks its
// context after before returns: a cancellation that came between the check
// and a deadline set here was overwritten by it.
func (d *receiveDeadline) before(now, status time.Time) error {
	want := now.Add(d.timeout)
	if status.Before(want) {
		want = status
	}
	if now.Before(d.until) && !want.Before(d.until) && want.Sub(d.until) <= d.timeout/2 {
		return nil
	}
	d.until = want
	return d.conn.SetReadDeadline(want)
}

// expired forgets the deadline after a receive timed out, so that before
// sets the next one.
func (d *receiveDeadline) expired() { d.until = time.Time{} }

// release disarms the wake-up and clears the connection's read deadline.
// After it returns, the wake-up neither runs nor is running.
func (d *receiveDeadline) release() {
	d.stopWake()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.released = true
	_ = d.conn.SetReadDeadline(time.Time{})
}
