package api

import (
	"context"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// answerLossProxy forwards TCP connections to target. After lose, the
// connections open at that moment still forward what the client sends but
// drop what the server answers (a network that loses the answers); later
// connections are forwarded whole.
type answerLossProxy struct {
	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn
	drops []*atomic.Bool // per connection: drop the server's bytes
}

func newAnswerLossProxy(t *testing.T, target string) *answerLossProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &answerLossProxy{ln: ln}
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
			go p.pipe(up, c, nil)
			go p.pipe(c, up, drop)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

// lose makes the connections open now drop the server's answers.
func (p *answerLossProxy) lose() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.drops {
		d.Store(true)
	}
}

// pipe copies src to dst (dropping the bytes while drop is set) until src
// ends, then closes dst: a peer that hangs up is seen by the other side
// (pgconn's cancel request waits for the server's EOF).
func (p *answerLossProxy) pipe(dst, src net.Conn, drop *atomic.Bool) {
	defer p.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && (drop == nil || !drop.Load()) {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// A single-request create whose COMMIT ran but whose answer was lost (here:
// the network drops PostgreSQL's answers from the moment the second batch
// is built, and the request's deadline closes the connection) is settled
// by its idempotency record, as a group's is: the request gets its task,
// not an error for a task that exists.
func TestLostCommitAnswerOfOneRequestIsSettled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pcfg, err := pgxpool.ParseConfig(b.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newAnswerLossProxy(t, net.JoinHostPort(pcfg.ConnConfig.Host, strconv.Itoa(int(pcfg.ConnConfig.Port))))
	host, port, _ := net.SplitHostPort(proxy.ln.Addr().String())
	pcfg.ConnConfig.Host = host
	p, _ := strconv.Atoi(port)
	pcfg.ConnConfig.Port = uint16(p)
	pcfg.MaxConns = 2 // the warm-up's idle connection, its statements prepared, runs the create; the settle read opens the other
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := &store{pool: pool}
	warm := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "lost-commit-warm-up", "0")
	if _, err := s.createOne(context.Background(), warm.k, warm.p, warm.draft, maxAloneLockTimeout); err != nil {
		t.Fatal(err)
	}

	r := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "lost-commit-answer", "1")
	build := r.draft.build
	r.draft.build = func(now time.Time) (*newTask, error) {
		proxy.lose() // the first batch was answered; the second's answers are lost
		return build(now)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := s.createOne(ctx, r.k, r.p, r.draft, maxAloneLockTimeout)
	if err != nil {
		t.Fatalf("createOne = %v, want the task: its transaction committed", err)
	}
	rec, err := idempotency.Get(context.Background(), b.db.Pool, r.k.Scope, r.k.Key)
	if err != nil || rec.TaskID == nil || *rec.TaskID != n.Task.TaskID {
		t.Fatalf("record %+v, err %v; want it to name task %s", rec, err, n.Task.TaskID)
	}
}
