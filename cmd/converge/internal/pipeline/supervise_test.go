package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/testenv"
)

// A failing component is restarted (and counted) until it runs; a fatal
// error and an injected crash are returned at once; a cancelled context
// ends the supervision with nil, also during a backoff.
func TestSupervisorRestarts(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	sup, err := newSupervisor(slog.New(slog.NewTextHandler(io.Discard, nil)), reg, "flaky", "idle")
	if err != nil {
		t.Fatal(err)
	}
	sup.min, sup.max = time.Millisecond, 5*time.Millisecond
	if got := testenv.MetricSum(t, reg, "converge_component_restarts_total", map[string]string{"component": "idle"}); got != 0 {
		t.Fatalf("idle component's restarts = %v, want 0 exported", got)
	}

	ctx, cancel := context.WithCancel(context.Background())
	calls := 0
	err = sup.run(ctx, "flaky", nil, func(ctx context.Context) error {
		calls++
		if calls < 3 {
			return errors.New("database unavailable")
		}
		if calls == 3 {
			return nil // returned without being asked to: restarted too
		}
		cancel()
		<-ctx.Done()
		return ctx.Err()
	})
	if err != nil || calls != 4 {
		t.Fatalf("run = %v after %d calls; want nil after 4", err, calls)
	}
	if got := testenv.MetricSum(t, reg, "converge_component_restarts_total", map[string]string{"component": "flaky"}); got != 3 {
		t.Fatalf("restarts = %v, want 3", got)
	}

	fatalErr := errors.New("slot lost")
	if err := sup.run(context.Background(), "flaky", func(err error) bool { return errors.Is(err, fatalErr) },
		func(context.Context) error { return fmt.Errorf("relay: %w", fatalErr) }); !errors.Is(err, fatalErr) {
		t.Fatalf("fatal error: run = %v", err)
	}
	if err := sup.run(context.Background(), "flaky", nil,
		func(context.Context) error { return fmt.Errorf("x: %w", fault.ErrInjected) }); !errors.Is(err, fault.ErrInjected) {
		t.Fatalf("injected crash: run = %v", err)
	}

	sup.min, sup.max = time.Hour, time.Hour
	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := sup.run(ctx, "flaky", nil, func(context.Context) error { return errors.New("down") }); err != nil {
		t.Fatalf("cancelled during the backoff: run = %v, want nil", err)
	}
}
