package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/internal/localpg"
)

// embeddedPG is `converge dev`'s PostgreSQL, supervised like the pipeline's
// components (issue 13): when the postmaster exits while dev runs (a crash,
// kill -9, an OOM kill), it is started again on the same data directory
// and port — PostgreSQL recovers from its WAL — after the supervisor's
// backoff, counted as converge_component_restarts_total{component=
// "postgres"}. Meanwhile the API answers 503 DATABASE_UNAVAILABLE and the
// other components retry; nothing else restarts.
type embeddedPG struct {
	cfg localpg.Config
	log *slog.Logger

	mu      sync.Mutex
	cur     *localpg.Cluster // nil while not running
	stopped bool
}

// startEmbeddedPG starts the cluster of cfg; the caller Stops it.
func startEmbeddedPG(ctx context.Context, cfg localpg.Config, log *slog.Logger) (*embeddedPG, error) {
	c, err := localpg.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return &embeddedPG{cfg: cfg, log: log, cur: c}, nil
}

// URL of database db (the same across restarts).
func (e *embeddedPG) URL(db string) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cur.URL(db)
}

// Component is the supervised watch of the postmaster: it returns an error
// when the postmaster exits, and on the next call starts a new one.
func (e *embeddedPG) Component() pipeline.Component {
	return pipeline.Component{Name: "postgres", Run: e.watch}
}

func (e *embeddedPG) watch(ctx context.Context) error {
	e.mu.Lock()
	c, stopped := e.cur, e.stopped
	e.mu.Unlock()
	if stopped {
		<-ctx.Done()
		return nil
	}
	if c == nil {
		nc, err := localpg.Start(ctx, e.cfg)
		if err != nil {
			return fmt.Errorf("start the embedded PostgreSQL again: %w", err)
		}
		e.mu.Lock()
		if e.stopped {
			e.mu.Unlock()
			_ = nc.Stop()
			return nil
		}
		e.cur, c = nc, nc
		e.mu.Unlock()
		e.log.InfoContext(ctx, "embedded PostgreSQL started again; it recovered from its WAL", slog.Int("pid", nc.PID()))
	}
	select {
	case <-ctx.Done():
		return nil
	case <-c.Exited():
	}
	e.mu.Lock()
	if e.cur == c {
		e.cur = nil
	}
	stopped = e.stopped
	e.mu.Unlock()
	if stopped || ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("the embedded PostgreSQL (pid %d) exited: %v", c.PID(), c.ExitErr())
}

// Stop shuts the running cluster down (fast shutdown) and keeps it down.
func (e *embeddedPG) Stop() {
	e.mu.Lock()
	e.stopped = true
	c := e.cur
	e.mu.Unlock()
	if c != nil {
		_ = c.Stop()
	}
}
