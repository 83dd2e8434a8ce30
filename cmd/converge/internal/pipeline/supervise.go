package pipeline

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/fault"
)

// Restart delays of a supervised component (issue 13): exponential with
// jitter (package backoff), back to the minimum after a run of
// healthyRun.
const (
	restartMin = 500 * time.Millisecond
	restartMax = 30 * time.Second
	healthyRun = time.Minute
)

// supervisor restarts the components of one process that fail, while the
// others keep running; converge_component_restarts_total{component} counts
// the restarts.
type supervisor struct {
	log      *slog.Logger
	restarts *prometheus.CounterVec
	// min and max are the restart delays (restartMin, restartMax; tests
	// shorten them).
	min, max time.Duration
}

func newSupervisor(log *slog.Logger, reg prometheus.Registerer, components ...string) (*supervisor, error) {
	restarts := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "converge_component_restarts_total",
		Help: "Times a component of this process failed and was restarted after a backoff (0.5s doubling to 30s, with jitter), by component.",
	}, []string{"component"})
	if err := reg.Register(restarts); err != nil {
		return nil, err
	}
	for _, c := range components {
		restarts.WithLabelValues(c) // 0 from the start
	}
	return &supervisor{log: log, restarts: restarts, min: restartMin, max: restartMax}, nil
}

// run runs fn until ctx ends (then it returns nil) or fn fails with an
// error fatal reports true, or that wraps fault.ErrInjected (a simulated
// crash: the experiments expect the process to stop), which it returns.
// Any other failure, and a return of nil before ctx ended, is logged and
// counted, and fn runs again after the backoff.
func (s *supervisor) run(ctx context.Context, name string, fatal func(error) bool, fn func(context.Context) error) error {
	for attempt := 0; ; attempt++ {
		started := time.Now()
		err := fn(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && (errors.Is(err, fault.ErrInjected) || (fatal != nil && fatal(err))):
			return err
		}
		if time.Since(started) >= healthyRun {
			attempt = 0
		}
		delay := backoff.Delay(s.min, s.max, attempt)
		s.restarts.WithLabelValues(name).Inc()
		msg := "component stopped unexpectedly; restarting it"
		if err != nil {
			msg = "component failed; restarting it"
		}
		s.log.ErrorContext(ctx, msg, slog.String("component", name), slog.Duration("backoff", delay), slog.Any("err", err))
		if !backoff.Wait(ctx, delay) {
			return nil
		}
	}
}
