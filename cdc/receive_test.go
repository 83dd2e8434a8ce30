package cdc

import (
	"context"
	"errors"
	"net"
	"os"
	"testing"
	"time"
)

// deadlineConn counts the read deadlines set on a real TCP connection.
type deadlineConn struct {
	net.Conn
	sets []time.Time
}

func (c *deadlineConn) SetReadDeadline(t time.Time) error {
	c.sets = append(c.sets, t)
	return c.Conn.SetReadDeadline(t)
}

// tcpPair is a connected pair of loopback TCP connections.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// TestReceiveDeadlineMovesOnlyWhenItMust: while messages flow the deadline
// is set about twice per timeout, not per receive; an earlier status time
// or an expired deadline sets it at once.
func TestReceiveDeadlineMovesOnlyWhenItMust(t *testing.T) {
	t.Parallel()
	c, _ := tcpPair(t)
	dc := &deadlineConn{Conn: c}
	rd := newReceiveDeadline(context.Background(), dc, time.Second)
	defer rd.release()
	t0 := time.Now()
	far := t0.Add(time.Hour) // no status due
	for ms := 0; ms < 2000; ms += 10 {
		if err := rd.before(t0.Add(time.Duration(ms)*time.Millisecond), far); err != nil {
			t.Fatal(err)
		}
	}
	// 200 receives over 2 s with a 1 s timeout: set at 0, then whenever
	// the wanted deadline is more than 0.5 s past the set one.
	if n := len(dc.sets); n < 3 || n > 5 {
		t.Errorf("200 receives over 2s set the deadline %d times, want 3 to 5", n)
	}
	n := len(dc.sets)
	now := t0.Add(2 * time.Second)
	status := now.Add(100 * time.Millisecond)
	if err := rd.before(now, status); err != nil {
		t.Fatal(err)
	}
	if len(dc.sets) != n+1 || !dc.sets[n].Equal(status) {
		t.Fatalf("a status due before the deadline: sets %v, want one more at %v", dc.sets[n:], status)
	}
	if err := rd.before(now.Add(50*time.Millisecond), status); err != nil || len(dc.sets) != n+1 {
		t.Fatalf("same status again: err %v, %d sets, want none more", err, len(dc.sets)-n-1)
	}
	rd.expired()
	if err := rd.before(now.Add(50*time.Millisecond), status); err != nil || len(dc.sets) != n+2 {
		t.Fatalf("after expired: err %v, %d sets, want one more", err, len(dc.sets)-n-1)
	}
}

// TestReceiveDeadlineWakesOnCancel: a read blocked under a far deadline
// returns a timeout soon after the context is cancelled; after release the
// connection has no deadline and the wake-up no longer runs.
func TestReceiveDeadlineWakesOnCancel(t *testing.T) {
	t.Parallel()
	c, s := tcpPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	rd := newReceiveDeadline(ctx, c, time.Hour)
	if err := rd.before(time.Now(), time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	read := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		read <- err
	}()
	time.Sleep(20 * time.Millisecond)
	cancel()
	select {
	case err := <-read:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read after cancel: %v, want a deadline error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a cancelled context did not wake the read")
	}
	rd.release()
	go func() {
		time.Sleep(50 * time.Millisecond)
		s.Write([]byte{1})
	}()
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Fatalf("read after release: %v, want the byte (no deadline left)", err)
	}

	// Released before the cancellation: the wake-up never sets a deadline.
	c2, s2 := tcpPair(t)
	ctx2, cancel2 := context.WithCancel(context.Background())
	rd2 := newReceiveDeadline(ctx2, c2, time.Hour)
	rd2.release()
	cancel2()
	time.Sleep(20 * time.Millisecond)
	go func() {
		time.Sleep(50 * time.Millisecond)
		s2.Write([]byte{1})
	}()
	if _, err := c2.Read(make([]byte, 1)); err != nil {
		t.Fatalf("read after release and cancel: %v, want the byte", err)
	}
}
