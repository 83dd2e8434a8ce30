package devbroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// leaveReason is sent in the LeaveGroup of an eviction (KIP-800).
const leaveReason = "converge devbroker: the member's process is gone (no open connection carries its client id)"

type memberKey struct{ group, member string }

// reaper evicts the classic-group members whose process is gone (see the
// package doc). Only run touches its fields.
type reaper struct {
	cfg   Config
	log   *slog.Logger
	conns *conns
	cl    *kgo.Client
	m     *metrics

	started  time.Time
	scanned  bool               // a scan succeeded
	failing  bool               // the last scan failed (logged once)
	restored map[memberKey]bool // members of the first successful scan
	suspects map[memberKey]int  // scans in a row that found the member dead
	evicted  *atomic.Int64      // the Broker's, over every start
}

func (r *reaper) run(ctx context.Context) {
	r.started = time.Now()
	t := time.NewTicker(r.cfg.ScanInterval)
	defer t.Stop()
	for {
		sctx, cancel := context.WithTimeout(ctx, max(r.cfg.ScanInterval, 5*time.Second))
		err := r.scan(sctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil:
			r.m.scanErrors.Inc()
			if !r.failing {
				r.log.WarnContext(ctx, "consumer-group scan failed; retrying every interval", slog.Duration("interval", r.cfg.ScanInterval), slog.Any("err", err))
			}
			r.failing = true
		case r.failing:
			r.log.InfoContext(ctx, "consumer-group scan recovered")
			r.failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// scan describes every classic group and evicts the members found dead on
// Confirmations scans in a row.
func (r *reaper) scan(ctx context.Context) error {
	described, err := kadm.NewClient(r.cl).DescribeGroups(ctx)
	if err != nil {
		return fmt.Errorf("describe groups: %w", err)
	}
	first := !r.scanned
	r.scanned = true
	if first {
		r.restored = map[memberKey]bool{}
	} else if r.restored != nil && time.Since(r.started) >= r.cfg.RestoredGrace {
		r.restored = nil
	}
	dead := map[memberKey]bool{}
	var errs []error
	for _, g := range described.Sorted() {
		if g.Err != nil {
			continue
		}
		var evict []kadm.DescribedGroupMember
		for _, m := range g.Members {
			k := memberKey{g.Group, m.MemberID}
			if first {
				r.restored[k] = true
			}
			if r.conns.alive(m.ClientHost, m.ClientID) {
				continue
			}
			dead[k] = true
			r.suspects[k]++
			if r.suspects[k] < r.cfg.Confirmations || r.restored[k] {
				continue
			}
			evict = append(evict, m)
		}
		if len(evict) > 0 {
			if err := r.evict(ctx, g, evict); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for k := range r.suspects {
		if !dead[k] {
			delete(r.suspects, k)
		}
	}
	return errors.Join(errs...)
}

// evict sends one LeaveGroup (v3+, explicit member ids) for ms on behalf of
// the dead members. Only the member id is sent, never the instance id: the
// broker would resolve an instance id to whichever member holds it now,
// which may be a live replacement.
func (r *reaper) evict(ctx context.Context, g kadm.DescribedGroup, ms []kadm.DescribedGroupMember) error {
	req := kmsg.NewPtrLeaveGroupRequest()
	req.Group = g.Group
	for _, m := range ms {
		rm := kmsg.NewLeaveGroupRequestMember()
		rm.MemberID = m.MemberID
		rm.Reason = kmsg.StringPtr(leaveReason)
		req.Members = append(req.Members, rm)
	}
	resp, err := req.RequestWith(ctx, r.cl)
	if err != nil {
		return fmt.Errorf("leave group %s for %d dead members: %w", g.Group, len(ms), err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return fmt.Errorf("leave group %s for %d dead members: %w", g.Group, len(ms), err)
	}
	byID := map[string]kadm.DescribedGroupMember{}
	for _, m := range ms {
		byID[m.MemberID] = m
	}
	for _, rm := range resp.Members {
		m := byID[rm.MemberID]
		delete(r.suspects, memberKey{g.Group, rm.MemberID})
		if err := kerr.ErrorForCode(rm.ErrorCode); err != nil {
			if !errors.Is(err, kerr.UnknownMemberID) { // already gone: nothing to do
				r.log.WarnContext(ctx, "evicting a dead group member failed", slog.String("group", g.Group),
					slog.String("member_id", rm.MemberID), slog.Any("err", err))
			}
			continue
		}
		r.evicted.Add(1)
		r.m.evicted.WithLabelValues(g.Group).Inc()
		var parts int
		if a, ok := m.Assigned.AsConsumer(); ok {
			for _, t := range a.Topics {
				parts += len(t.Partitions)
			}
		}
		r.log.InfoContext(ctx, "evicted consumer-group member whose process is gone",
			slog.String("group", g.Group), slog.String("group_state", g.State), slog.String("member_id", rm.MemberID),
			slog.String("client_id", m.ClientID), slog.String("client_host", m.ClientHost), slog.Int("assigned_partitions", parts))
	}
	return nil
}

// metrics are the converge_devbroker_* collectors (listed in doc.go).
type metrics struct {
	evicted    *prometheus.CounterVec
	scanErrors prometheus.Counter
	conns      prometheus.GaugeFunc
}

func newMetrics(reg prometheus.Registerer, cs *conns) (*metrics, error) {
	m := &metrics{
		evicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_devbroker_group_members_evicted_total",
			Help: "Consumer-group members the embedded broker's reaper removed (LeaveGroup on their behalf) because their process is gone, by group.",
		}, []string{"group"}),
		scanErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_devbroker_group_scan_errors_total",
			Help: "Scans of the embedded broker's consumer groups (DescribeGroups, LeaveGroup) that failed.",
		}),
		conns: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "converge_devbroker_connections",
			Help: "Open client connections of the embedded broker.",
		}, func() float64 { return float64(cs.count()) }),
	}
	for i, c := range m.collectors() {
		if err := reg.Register(c); err != nil {
			for _, done := range m.collectors()[:i] {
				reg.Unregister(done)
			}
			return nil, fmt.Errorf("devbroker: register metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.evicted, m.scanErrors, m.conns}
}

func (m *metrics) unregister(reg prometheus.Registerer) {
	for _, c := range m.collectors() {
		reg.Unregister(c)
	}
}
