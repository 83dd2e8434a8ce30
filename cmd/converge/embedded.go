package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
)

// embedded is one of `converge dev`'s embedded servers (PostgreSQL,
// redis-server), supervised like the pipeline's components (issue 13):
// when its process exits while dev runs (a crash, kill -9, an OOM kill), it
// is started again with the same configuration — same data directory and
// port, so every client reconnects to the same URL; PostgreSQL recovers
// from its WAL, Redis starts empty and the reconciler and the reads
// refill it — after the supervisor's backoff, counted as
// converge_component_restarts_total{component=<name>}. Meanwhile the API
// answers 503 DATABASE_UNAVAILABLE (PostgreSQL) or serves from PostgreSQL
// (Redis); nothing else restarts.
type embedded struct {
	name  string
	start func(context.Context) (running, error)
	log   *slog.Logger

	mu      sync.Mutex
	cur     *running // nil while not running
	stopped bool
}

// running is a started server process.
type running struct {
	exited <-chan struct{} // closed when the process has exited
	exit   func() error    // its exit status, once exited
	stop   func()          // clean shutdown, waits for the exit
	pid    int
}

// startEmbedded starts the server (start); the caller Stops it.
func startEmbedded(ctx context.Context, name string, log *slog.Logger, start func(context.Context) (running, error)) (*embedded, error) {
	r, err := start(ctx)
	if err != nil {
		return nil, err
	}
	return &embedded{name: name, start: start, log: log, cur: &r}, nil
}

// embeddedPostgres is dev's PostgreSQL cluster of cfg.
func embeddedPostgres(ctx context.Context, cfg localpg.Config, log *slog.Logger) (*embedded, *localpg.Cluster, error) {
	var first *localpg.Cluster
	e, err := startEmbedded(ctx, "postgres", log, func(ctx context.Context) (running, error) {
		c, err := localpg.Start(ctx, cfg)
		if err != nil {
			return running{}, err
		}
		if first == nil {
			first = c
		}
		return running{exited: c.Exited(), exit: c.ExitErr, stop: func() { _ = c.Stop() }, pid: c.PID()}, nil
	})
	return e, first, err
}

// embeddedRedis is dev's redis-server of cfg.
func embeddedRedis(ctx context.Context, cfg localredis.Config, log *slog.Logger) (*embedded, *localredis.Server, error) {
	var first *localredis.Server
	e, err := startEmbedded(ctx, "redis", log, func(ctx context.Context) (running, error) {
		s, err := localredis.Start(ctx, cfg)
		if err != nil {
			return running{}, err
		}
		if first == nil {
			first = s
		}
		return running{exited: s.Exited(), exit: s.ExitErr, stop: s.Stop, pid: s.PID()}, nil
	})
	return e, first, err
}

// Component is the supervised watch of the process: it returns an error
// when the process exits, and on the next call starts a new one.
func (e *embedded) Component() pipeline.Component {
	return pipeline.Component{Name: e.name, Run: e.watch}
}

func (e *embedded) watch(ctx context.Context) error {
	e.mu.Lock()
	r, stopped := e.cur, e.stopped
	e.mu.Unlock()
	if stopped {
		<-ctx.Done()
		return nil
	}
	if r == nil {
		nr, err := e.start(ctx)
		if err != nil {
			return fmt.Errorf("start the embedded %s again: %w", e.name, err)
		}
		e.mu.Lock()
		if e.stopped {
			e.mu.Unlock()
			nr.stop()
			return nil
		}
		e.cur, r = &nr, &nr
		e.mu.Unlock()
		e.log.InfoContext(ctx, "embedded server started again", slog.String("component", e.name), slog.Int("pid", nr.pid))
	}
	select {
	case <-ctx.Done():
		return nil
	case <-r.exited:
	}
	e.mu.Lock()
	if e.cur == r {
		e.cur = nil
	}
	stopped = e.stopped
	e.mu.Unlock()
	if stopped || ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("the embedded %s (pid %d) exited: %v", e.name, r.pid, r.exit())
}

// Stop shuts the running server down cleanly and keeps it down.
func (e *embedded) Stop() {
	e.mu.Lock()
	e.stopped = true
	r := e.cur
	e.mu.Unlock()
	if r != nil {
		r.stop()
	}
}
