package experiment

import (
	"context"
	"errors"
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

// keepCreating posts a create every 100 ms until d has passed, with the
// keys prefix-0, prefix-1, ... and doc(i), and hands each answer to seen
// (err is a transport error).
func (x *X) keepCreating(ctx context.Context, d time.Duration, prefix string, doc func(int) []byte,
	seen func(key string, status int, m map[string]any, err error)) {
	deadline := time.Now().Add(d)
	for i := 0; time.Now().Before(deadline) && ctx.Err() == nil; i++ {
		key := fmt.Sprintf("%s-%d", prefix, i)
		status, m, _, err := x.post(ctx, key, doc(i))
		seen(key, status, m, err)
		time.Sleep(100 * time.Millisecond)
	}
}

// stopped reports whether the pipeline has stopped by itself, and its
// error (wait and stop still see it).
func (x *X) stopped() (bool, error) {
	select {
	case err := <-x.done:
		x.done <- err
		return true, err
	default:
		return false, nil
	}
}

// restarts is the restarts counted meanwhile: the relay's sessions (every
// reason) and the supervised components.
func (x *X) restarts() (relay, components float64) {
	return x.metric("converge_relay_restarts_total", nil), x.metric("converge_component_restarts_total", nil)
}

// databaseOutage: PostgreSQL becomes unreachable for Env.Outage under load
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
	outage := x.env.Outage
	x.step("5 tasks completed; PostgreSQL now unreachable for %s (connections closed, new ones refused) while a client keeps creating", outage)
	proxy.cut()
	var unavailable, other int
	var pending []string
	during := func(i int) []byte { return doc(100 + i) }
	x.keepCreating(ctx, outage, "exp-outage-during", during, func(key string, status int, m map[string]any, err error) {
		switch {
		case err != nil:
			other++
		case status == http.StatusServiceUnavailable && m["code"] == "DATABASE_UNAVAILABLE":
			unavailable++
			pending = append(pending, key)
		default:
			other++
		}
	})
	if ok, err := x.stopped(); ok {
		x.check("the pipeline kept running during the outage", false, "it stopped: %v", err)
		return nil
	}
	x.check("the pipeline kept running during the outage", true, "no component stopped the process")
	x.check("the API answered 503 DATABASE_UNAVAILABLE, not a refused connection", unavailable > 0 && other == 0,
		"%d × 503 DATABASE_UNAVAILABLE, %d other answers or transport errors", unavailable, other)
	proxy.restore()
	back := time.Now()
	x.step("PostgreSQL reachable again; the client retries its %d refused creates with the same keys", len(pending))
	for i, key := range pending {
		if err := until(ctx, time.Minute, "create "+key+" accepted", func() bool {
			_, err = x.create(ctx, key, during(i))
			return err == nil
		}); err != nil {
			return err
		}
	}
	for _, id := range x.tasks {
		if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
			return err
		}
	}
	took := time.Since(back).Round(100 * time.Millisecond)
	x.rep.Counts["seconds_to_converge_after_outage"] = took.Seconds()
	if ok, err := x.stopped(); ok {
		x.check("the pipeline kept running after the outage", false, "it stopped: %v", err)
		return nil
	}
	relay, components := x.restarts()
	x.check("every task completed after the outage, and the components recovered by themselves", true,
		"%d tasks completed %s after PostgreSQL came back; relay session restarts %.0f, component restarts %.0f", len(x.tasks), took, relay, components)
	return nil
}

// kafkaOutage: the Kafka broker is stopped for Env.Outage under load and
// restarted on the same address with its persisted log (issue 13). Every
// client of the pipeline (relay producer, worker, projector, dead-letter
// intake, lag sampler, replay producer) loses its connections and gets
// connection refused. The API keeps accepting tasks: they commit to
// PostgreSQL and the outbox holds their events; nothing stops the process;
// once Kafka is back every accepted task completes with one verified
// artifact and every outbox row is published.
func kafkaOutage(ctx context.Context, x *X) error {
	broker := x.env.Broker
	if broker == nil {
		return errors.New("kafka-outage needs a broker it can stop and restart (Env.Broker, see NewBroker)")
	}
	if err := x.start(ctx, nil, nil); err != nil {
		return err
	}
	doc := func(i int) []byte { return []byte(fmt.Sprintf(`{"experiment":"kafka-outage","n":%d}`, i)) }
	for i := range 5 {
		id, err := x.create(ctx, fmt.Sprintf("exp-kafka-outage-before-%d", i), doc(i))
		if err != nil {
			return err
		}
		if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
			return err
		}
	}
	outage := x.env.Outage
	x.step("5 tasks completed; Kafka now stopped for %s (the broker closes every connection, its port refuses new ones) while a client keeps creating", outage)
	if err := broker.Stop(); err != nil {
		return fmt.Errorf("stop the broker: %w", err)
	}
	down := true
	defer func() {
		if down { // an early return: the pipeline's shutdown needs the broker
			_ = broker.Restart()
		}
	}()
	var accepted, other int
	var during []string
	var otherSample string
	x.keepCreating(ctx, outage, "exp-kafka-outage-during", func(i int) []byte { return doc(100 + i) },
		func(key string, status int, m map[string]any, err error) {
			id, _ := m["task_id"].(string)
			if err == nil && status == http.StatusAccepted && id != "" {
				accepted++
				x.keys, x.tasks = append(x.keys, key), append(x.tasks, id)
				during = append(during, id)
				return
			}
			other++
			if otherSample == "" {
				otherSample = fmt.Sprintf(" (first: %d %v %v)", status, m, err)
			}
		})
	if ok, err := x.stopped(); ok {
		x.check("the pipeline kept running during the outage", false, "it stopped: %v", err)
		return nil
	}
	x.check("the pipeline kept running during the outage", true, "no component stopped the process")
	x.check("the API kept accepting tasks (202) while Kafka was away", accepted > 0 && other == 0,
		"%d × 202, %d other answers or transport errors%s", accepted, other, otherSample)
	// The reconciler may have re-driven the oldest of them meanwhile
	// (TaskDeadline, 30 s here): TaskRedriveRequested rows, held too.
	held := x.scalar(ctx, `SELECT count(*) FROM outbox_event WHERE aggregate_id = ANY($1) AND event_type = 'TaskCreated' AND outbox_published_at(outbox_event) IS NULL`, during)
	unpublished := x.scalar(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_published_at(outbox_event) IS NULL`)
	queued := x.scalar(ctx, `SELECT count(*) FROM task WHERE task_id = ANY($1) AND status = 'queued'`, during)
	x.check("the outbox held their events: committed in PostgreSQL, not published", held == int64(len(during)) && queued == int64(len(during)),
		"%d tasks accepted during the outage: %d still queued, %d of their TaskCreated rows unpublished (%d unpublished outbox rows in all)",
		len(during), queued, held, unpublished)
	relayBefore, componentsBefore := x.restarts()
	if err := broker.Restart(); err != nil {
		return fmt.Errorf("restart the broker: %w", err)
	}
	down = false
	back := time.Now()
	x.step("Kafka back on the same address with its persisted log and committed offsets; %d tasks wait (relay session restarts during the outage %.0f, component restarts %.0f)",
		len(during), relayBefore, componentsBefore)
	for _, id := range x.tasks {
		if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
			return err
		}
	}
	took := time.Since(back).Round(100 * time.Millisecond)
	x.rep.Counts["seconds_to_converge_after_outage"] = took.Seconds()
	x.rep.Counts["redrive_events"] = x.scalar(ctx, `SELECT count(*) FROM outbox_event WHERE event_type = 'TaskRedriveRequested'`)
	if ok, err := x.stopped(); ok {
		x.check("the pipeline kept running after the outage", false, "it stopped: %v", err)
		return nil
	}
	relay, components := x.restarts()
	x.check("every task completed after the outage, and the components recovered by themselves", true,
		"%d tasks completed %s after Kafka came back; relay session restarts %.0f, component restarts %.0f", len(x.tasks), took, relay, components)
	return nil
}
