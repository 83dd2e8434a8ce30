package cdc

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
)

// heartbeatContent is the content of a heartbeat message. The slot name
// tells a relay its own heartbeats from those of relays on other slots of
// the same database (logical messages reach every slot of the database).
type heartbeatContent struct {
	Slot      string    `json:"slot"`
	EmittedAt time.Time `json:"emitted_at"`
}

// monitorTimeout bounds each heartbeat write and slot sample.
const monitorTimeout = 5 * time.Second

// startMonitor runs the session's monitor beside the replication loop: it
// writes a heartbeat into the WAL every HeartbeatInterval (when enabled),
// samples the slot and checks the publication every SlotSampleInterval
// (heartbeat and sample at once at start; the publication was checked by
// open), and checks the publication when handleRelation asks. Neither
// failing stops the relay: they are counted and logged. The returned
// function stops the monitor and waits for it; call it before closing the
// session's pool.
func (s *session) startMonitor(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.monitor(ctx)
	}()
	return func() {
		cancel()
		wg.Wait()
	}
}

func (s *session) monitor(ctx context.Context) {
	sample := time.NewTicker(s.cfg.SlotSampleInterval)
	defer sample.Stop()
	var beat <-chan time.Time
	if s.cfg.HeartbeatInterval > 0 {
		t := time.NewTicker(s.cfg.HeartbeatInterval)
		defer t.Stop()
		beat = t.C
		s.heartbeat(ctx)
	}
	s.sampleSlot(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-beat:
			s.heartbeat(ctx)
		case <-sample.C:
			s.sampleSlot(ctx)
			s.verifyPublication(ctx)
		case <-s.checkNow:
			s.verifyPublication(ctx)
		}
	}
}

// heartbeat writes one heartbeat message into the WAL.
func (s *session) heartbeat(ctx context.Context) {
	content, err := json.Marshal(heartbeatContent{Slot: s.cfg.SlotName, EmittedAt: time.Now()})
	if err != nil {
		panic(err) // a struct of a string and a time always marshals
	}
	ctx, cancel := context.WithTimeout(ctx, monitorTimeout)
	defer cancel()
	if _, err := s.store.emitHeartbeat(ctx, content); err != nil {
		if context.Cause(ctx) == context.Canceled {
			return // stopping
		}
		s.m.heartbeatErrors.Inc()
		s.log.WarnContext(ctx, "heartbeat failed; the slot advances only with outbox traffic until it works again",
			slog.String("error", err.Error()))
		return
	}
	s.m.heartbeatsEmitted.Inc()
}

// verifyPublication checks the publication while streaming and records
// the result (Health, converge_relay_publication_mismatch). A mismatch ends
// the session through the marker's failure (no further status update: the
// slot stays where it was); Run then waits for the publication to be fixed
// before it opens the next session. A check that could not run is only
// logged.
func (s *session) verifyPublication(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, monitorTimeout)
	defer cancel()
	err := s.store.checkPublication(ctx, s.cfg.PublicationName)
	switch {
	case context.Cause(ctx) == context.Canceled:
	case err == nil:
		s.r.noteCatalog(ctx, nil)
	case errors.Is(err, ErrPublicationMismatch):
		s.r.noteCatalog(ctx, err)
		s.setMarkErr(err)
	default:
		s.log.WarnContext(ctx, "verify publication failed", slog.String("error", err.Error()))
	}
}

// sampleSlot reads the slot's lag, retained WAL and wal_status into the
// converge_relay_slot_* gauges.
func (s *session) sampleSlot(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, monitorTimeout)
	defer cancel()
	st, err := s.store.slotStats(ctx, s.cfg.SlotName)
	if err != nil {
		if context.Cause(ctx) == context.Canceled {
			return // stopping
		}
		s.m.slotSampleErrors.Inc()
		s.log.WarnContext(ctx, "sample replication slot failed", slog.String("error", err.Error()))
		return
	}
	if !st.exists {
		s.m.slotSampleErrors.Inc()
		s.log.ErrorContext(ctx, "replication slot vanished while streaming")
		return
	}
	s.setSlotStats(st)
	if st.walStatus == "unreserved" {
		s.log.WarnContext(ctx, "replication slot is about to lose WAL (wal_status unreserved): the relay is far behind",
			slog.Int64("lag_bytes", st.lagBytes), slog.Int64("retained_bytes", st.retainedBytes))
	}
}

// setSlotStats sets the converge_relay_slot_* gauges from st.
func (s *session) setSlotStats(st slotStats) {
	s.m.slotLag.Set(float64(st.lagBytes))
	s.m.slotRetained.Set(float64(st.retainedBytes))
	s.m.setWALStatus(st.walStatus)
}

// setWALStatus sets converge_relay_slot_wal_status: 1 for status, 0 for the
// others. An unknown status gets its own series.
func (m *metrics) setWALStatus(status string) {
	for _, st := range walStatuses {
		v := 0.0
		if st == status {
			v = 1
		}
		m.slotWALStatus.WithLabelValues(st).Set(v)
	}
	if status != "" && !slices.Contains(walStatuses, status) {
		m.slotWALStatus.WithLabelValues(status).Set(1)
	}
}

// handleMessage handles a logical decoding message of the stream. The
// relay's own heartbeats update the round-trip metrics; the transaction
// around a transactional message is tracked like any other (Begin/Commit),
// so the slot advances past it once every earlier transaction is done.
// Other messages are ignored.
func (s *session) handleMessage(ctx context.Context, m *pglogrepl.LogicalDecodingMessage) {
	if m.Prefix != HeartbeatPrefix {
		return
	}
	var hb heartbeatContent
	if err := json.Unmarshal(m.Content, &hb); err != nil {
		s.log.WarnContext(ctx, "undecodable heartbeat message ignored", slog.String("lsn", m.LSN.String()), slog.String("error", err.Error()))
		return
	}
	if hb.Slot != s.cfg.SlotName {
		return // another relay's heartbeat
	}
	now := time.Now()
	s.m.heartbeatRTT.Set(max(now.Sub(hb.EmittedAt), 0).Seconds())
	s.m.heartbeatLastSeen.Set(float64(now.UnixNano()) / 1e9)
}
