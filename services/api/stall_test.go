package api

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/tenant"
)

// stallProxy forwards TCP connections to target until stall: then it keeps
// every connection open and forwards nothing more, as a PostgreSQL that is
// SIGSTOPped or behind a partition that drops packets (connections are not
// refused, they just never answer). After lose, the connections open at that
// moment still forward what the client sends but drop what the server
// answers (a network that loses the answers); later connections are
// forwarded whole. After loseFrom(marker), a connection that sends marker
// drops the server's answers from that message on, or, with stallAtMarker,
// stalls the proxy from that message on (the message is not forwarded).
type stallProxy struct {
	ln      net.Listener
	target  string
	stalled atomic.Bool
	done    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
	drops   []*atomic.Bool // per connection: drop the server's bytes
	marker  atomic.Pointer[[]byte]
	armed   atomic.Int32 // connections that sent the marker
	// stallAtMarker: the first message holding the marker stalls the proxy
	// (it and everything after it are held) instead of losing answers.
	stallAtMarker atomic.Bool
	once          sync.Once
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln, target: target, done: make(chan struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			drop := &atomic.Bool{}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.drops = append(p.drops, drop)
			p.mu.Unlock()
			p.wg.Add(2)
			go p.pipe(c, up, drop, nil)
			go p.pipe(up, c, nil, drop)
		}
	}()
	t.Cleanup(p.close)
	return p
}

// close drops every connection and stops accepting (idempotent).
func (p *stallProxy) close() {
	p.once.Do(func() {
		close(p.done)
		p.ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
}

// proxiedPoolConfig starts a stallProxy to the database of url and returns
// it with a pool configuration of url whose connections go through it.
func proxiedPoolConfig(t *testing.T, url string) (*stallProxy, *pgxpool.Config) {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newStallProxy(t, net.JoinHostPort(pcfg.ConnConfig.Host, strconv.Itoa(int(pcfg.ConnConfig.Port))))
	host, port, _ := net.SplitHostPort(proxy.ln.Addr().String())
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.Host, pcfg.ConnConfig.Port = host, uint16(p)
	return proxy, pcfg
}

// proxiedSetup returns a bundle whose API (requests and authentication)
// reaches its database through a stallProxy, with requestTimeout as its
// RequestTimeout and opts applied, and the proxy. The bundle's db (its
// direct pool), tenant and tokens are those of the database behind the
// proxy.
func proxiedSetup(t *testing.T, requestTimeout time.Duration, opts ...func(*Config)) (*testBundle, *stallProxy) {
	t.Helper()
	var proxy *stallProxy
	b := setupWith(t, func(b *testBundle, c *Config) {
		var pcfg *pgxpool.Config
		proxy, pcfg = proxiedPoolConfig(t, b.db.URL)
		pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		t.Cleanup(proxy.close) // before pool.Close: a stalled proxy's connections do not answer
		c.Pool, c.Auth, c.RequestTimeout = pool, tenant.NewAuthenticator(pool, 0), requestTimeout
		for _, o := range opts {
			o(c)
		}
	})
	return b, proxy
}

// lose makes the connections open now drop the server's answers.
func (p *stallProxy) lose() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.drops {
		d.Store(true)
	}
}

// loseFrom makes a connection drop the server's answers once the client
// has sent marker on it (from the message that holds it on).
func (p *stallProxy) loseFrom(marker string) {
	m := []byte(marker)
	p.marker.Store(&m)
}

// pipe copies src to dst (holding the bytes once stalled, dropping them
// while drop is set) until src ends, then closes dst: a peer that hangs up
// is seen by the other side (pgconn's cancel request waits for the
// server's EOF). On a client's pipe, arm is its connection's drop flag,
// set before the bytes that complete loseFrom's marker are forwarded.
func (p *stallProxy) pipe(dst, src net.Conn, drop, arm *atomic.Bool) {
	defer p.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	var tail []byte // the last bytes forwarded, for a marker split across reads
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if m := p.marker.Load(); arm != nil && m != nil {
				seen := append(tail, buf[:n]...)
				if bytes.Contains(seen, *m) && !arm.Swap(true) {
					p.armed.Add(1)
					if p.stallAtMarker.Load() {
						p.stalled.Store(true)
					}
				}
				tail = append(tail[:0], seen[max(0, len(seen)-len(*m)):]...)
			}
			if p.stalled.Load() {
				<-p.done // hold the bytes: nothing answers
				return
			}
			if drop == nil || !drop.Load() {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// A PostgreSQL that stops answering (connections open, nothing comes back)
// makes a request answer 503 DATABASE_UNAVAILABLE after RequestTimeout,
// not hang for the outage (issue 13 review: a SIGSTOPped postmaster held
// POST and GET for 90 s).
func TestDatabaseThatStopsAnsweringIs503(t *testing.T) {
	t.Parallel()
	b, proxy := proxiedSetup(t, time.Second)
	if r := b.post(t, "stall-before", []byte(`{"document":{"a":1}}`)); r.status != http.StatusAccepted && r.status != http.StatusCreated {
		t.Fatalf("create before the stall: %d %s", r.status, r.body)
	}
	proxy.stalled.Store(true)
	start := time.Now()
	r := b.post(t, "stall-during", []byte(`{"document":{"a":2}}`))
	took := time.Since(start)
	if r.status != http.StatusServiceUnavailable || r.json(t)["code"] != CodeDatabaseUnavailable {
		t.Fatalf("create while PostgreSQL does not answer: %d %s; want 503 %s", r.status, r.body, CodeDatabaseUnavailable)
	}
	if took > 10*time.Second {
		t.Errorf("the 503 took %s; RequestTimeout is 1s", took)
	}
	t.Logf("503 after %s", took.Round(10*time.Millisecond))
}
