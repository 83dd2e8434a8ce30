package devbroker

import (
	"encoding/binary"
	"net"
	"sync"
)

// maxHeader bounds the bytes buffered to read the client id of a
// connection's first request: size (4), api key (2), version (2),
// correlation id (4), client id length (2) and at most 32767 bytes of id.
const maxHeader = 14 + 32767

// conns is the set of open client connections of the broker, by remote
// address, and how many open connections carry each client id.
type conns struct {
	mu       sync.Mutex
	open     map[string]*conn
	byClient map[string]int
}

func newConns() *conns {
	return &conns{open: map[string]*conn{}, byClient: map[string]int{}}
}

// alive reports whether the connection at remote address host is open or
// an open connection carries clientID. A group member for which it is false
// has no process behind it any more (see the package doc).
func (cs *conns) alive(host, clientID string) bool {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.open[host] != nil || cs.byClient[clientID] > 0
}

// count returns the open connections.
func (cs *conns) count() int {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return len(cs.open)
}

func (cs *conns) add(c *conn) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	cs.open[c.addr] = c
}

func (cs *conns) identify(c *conn, clientID string) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c.closed {
		return
	}
	c.clientID, c.identified = clientID, true
	cs.byClient[clientID]++
}

func (cs *conns) remove(c *conn) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	if cs.open[c.addr] == c {
		delete(cs.open, c.addr)
	}
	if c.identified {
		if cs.byClient[c.clientID]--; cs.byClient[c.clientID] <= 0 {
			delete(cs.byClient, c.clientID)
		}
	}
}

// listener wraps the broker's listener: every accepted connection is
// tracked in conns until it is closed.
type listener struct {
	net.Listener
	conns *conns
}

func (l *listener) Accept() (net.Conn, error) {
	nc, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	c := &conn{Conn: nc, conns: l.conns, addr: nc.RemoteAddr().String()}
	l.conns.add(c)
	return c, nil
}

// conn is a tracked client connection. It reads the client id from the
// header of the connection's first request (request header v1 and v2 both
// start with int32 size, int16 api key, int16 version, int32 correlation
// id, nullable string client id) as the broker reads it; Close and a
// failed Read end the tracking.
type conn struct {
	net.Conn
	conns *conns
	addr  string

	// Guarded by conns.mu.
	clientID   string
	identified bool
	closed     bool

	// Only the broker's reading goroutine touches these.
	head    []byte
	sniffed bool
}

func (c *conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if !c.sniffed && n > 0 {
		c.head = append(c.head, p[:n]...)
		if id, ok, done := parseClientID(c.head); done {
			c.sniffed, c.head = true, nil
			if ok {
				c.conns.identify(c, id)
			}
		}
	}
	if err != nil {
		c.conns.remove(c)
	}
	return n, err
}

func (c *conn) Close() error {
	c.conns.remove(c)
	return c.Conn.Close()
}

// parseClientID reads the client id of the request at the start of b.
// done is false while more bytes are needed; ok is false when the header
// is not a request header (too short a frame, too long a buffer). A null
// client id is the empty string, as Kafka treats it.
func parseClientID(b []byte) (id string, ok, done bool) {
	if len(b) < 14 {
		return "", false, false
	}
	size := int32(binary.BigEndian.Uint32(b[0:4]))
	n := int16(binary.BigEndian.Uint16(b[12:14]))
	switch {
	case n < 0:
		return "", size >= 10, true
	case size < 10+int32(n):
		return "", false, true
	case len(b) < 14+int(n):
		return "", false, len(b) >= maxHeader
	}
	return string(b[14 : 14+int(n)]), true, true
}
