package experiment

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/internal/taskevent"
)

// outageFor is how long the database-outage experiment keeps PostgreSQL
// unreachable.
const outageFor = 10 * time.Second

// cutProxy forwards TCP connections to target until cut: then it closes
// every connection and refuses new ones (to the pipeline, PostgreSQL is
// gone: connection refused/reset) until restore.
type cutProxy struct {
	ln     net.Listener
	target string
	down   atomic.Bool
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func newCutProxy(target string) (*cutProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &cutProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

func (p *cutProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.down.Load() {
			c.Close()
			continue
		}
		up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.track(c, up)
		p.wg.Add(2)
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

func (p *cutProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
}

func (p *cutProxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	_, _ = io.Copy(dst, src)
	dst.Close()
	src.Close()
}

// cut closes every connection and refuses new ones.
func (p *cutProxy) cut() {
	p.down.Store(true)
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

func (p *cutProxy) restore() { p.down.Store(false) }

func (p *cutProxy) close() {
	p.ln.Close()
	p.cut()
	p.wg.Wait()
}

// databaseOutage: PostgreSQL becomes unreachable for outageFor under load
// (issue 13, seed 14). The pipeline must not stop: the API answers 503
// DATABASE_UNAVAILABLE, the relay and the other components retry, and
// once PostgreSQL is back the client's retries with the same keys create
// their tasks and every task completes.
func databaseOutage(ctx context.Context, x *X) error {
	u, err := url.Parse(x.env.DatabaseURL)
	if err != nil {
		return err
	}
	proxy, err := newCutProxy(u.Host)
	if err != nil {
		return err
	}
	x.cleanup = append(x.cleanup, proxy.close) // the pipeline uses it until it stops
	viaProxy := *u
	viaProxy.Host = proxy.ln.Addr().String()
	if err := x.start(ctx, nil, func(c *pipeline.Config) { c.DatabaseURL = viaProxy.String() }); err != nil {
		return err
	}
	doc := func(i int) []byte { return []byte(fmt.Sprintf(`{"experiment":"database-outage","n":%d}`, i)) }
	for i := range 5 {
		id, err := x.create(ctx, fmt.Sprintf("exp-outage-before-%d", i), doc(i))
		if err != nil {
			return err
		}
		if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
			return err
		}
	}
	x.step("5 tasks completed; PostgreSQL now unreachable for %s (connections closed, new ones refused) while a client keeps creating", outageFor)
	proxy.cut()
	var unavailable, other int
	var pending []string
	deadline := time.Now().Add(outageFor)
	for i := 0; time.Now().Before(deadline); i++ {
		key := fmt.Sprintf("exp-outage-during-%d", i)
		status, m, _, err := x.post(ctx, key, doc(100+i))
		switch {
		case err != nil:
			other++
		case status == http.StatusServiceUnavailable && m["code"] == "DATABASE_UNAVAILABLE":
			unavailable++
			pending = append(pending, key)
		default:
			other++
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-x.done:
		x.done <- err
		x.check("the pipeline kept running during the outage", false, "it stopped: %v", err)
		return nil
	default:
	}
	x.check("the pipeline kept running during the outage", true, "no component stopped the process")
	x.check("the API answered 503 DATABASE_UNAVAILABLE, not a refused connection", unavailable > 0 && other == 0,
		"%d × 503 DATABASE_UNAVAILABLE, %d other answers or transport errors", unavailable, other)
	proxy.restore()
	x.step("PostgreSQL reachable again; the client retries its %d refused creates with the same keys", len(pending))
	for i, key := range pending {
		var id string
		if err := until(ctx, time.Minute, "create "+key+" accepted", func() bool {
			id, err = x.create(ctx, key, doc(100+i))
			return err == nil
		}); err != nil {
			return err
		}
		_ = id
	}
	for _, id := range x.tasks {
		if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
			return err
		}
	}
	restarts := x.metric("converge_relay_restarts_total", map[string]string{"reason": "database"}) +
		x.metric("converge_component_restarts_total", nil)
	x.check("every task completed after the outage, and the components recovered by themselves", true,
		"%d tasks completed; relay and component restarts meanwhile: %.0f", len(x.tasks), restarts)
	return nil
}
