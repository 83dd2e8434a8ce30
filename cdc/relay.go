package cdc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkalog"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
)

// Sentinel errors of Run. Each is wrapped with the details of the case.
var (
	// ErrPublicationMismatch: the publication does not publish inserts of
	// public.outbox_event (the table was dropped from it, or dropped and
	// recreated by a migration; publish without insert; the publication was
	// dropped). Not fatal: Relay.Health reports it, naming the fix, and the
	// relay does not stream until the publication is fixed (package doc,
	// "Publication checks").
	ErrPublicationMismatch = errors.New("publication does not cover outbox_event")
	// ErrRelationMismatch: a pgoutput Relation message of
	// public.outbox_event lacks a column the relay reads (a migration
	// renamed or dropped it). Not fatal: Relay.Health reports it, naming
	// the fix, and the relay does not stream past the row.
	ErrRelationMismatch = errors.New("outbox relation lacks a column the relay reads")
	// ErrSlotLost: the replication slot was invalidated (wal_status lost,
	// max_slot_wal_keep_size): WAL the relay never confirmed is gone.
	ErrSlotLost = errors.New("replication slot lost")
	// ErrSlotMismatch: a slot of that name exists but is not a logical
	// pgoutput slot of this database.
	ErrSlotMismatch = errors.New("replication slot mismatch")
	// ErrSlotActive: another process streams from the slot (PostgreSQL
	// allows one consumer per slot).
	ErrSlotActive = errors.New("replication slot is active in another process")
	// ErrInvalidRow: an outbox row cannot be relayed (undecodable column).
	// The relay stops rather than skip it.
	ErrInvalidRow = errors.New("invalid outbox row")
	// ErrAlreadyRunning: Run was called while a Run of the same Relay is
	// still going.
	ErrAlreadyRunning = errors.New("relay is already running")
)

// updateTimeout bounds each published_at UPDATE.
const updateTimeout = 30 * time.Second

// Relay tails outbox_event inserts from a logical replication slot into a
// Kafka topic. See the package documentation for its invariants.
type Relay struct {
	cfg       Config
	log       *slog.Logger
	m         *metrics
	confirmed atomic.Uint64
	running   atomic.Bool
	pub       pubState
}

// New validates cfg (after applying its defaults) and registers the relay's
// metrics on cfg.Registerer. It does not connect to anything.
func New(cfg Config) (*Relay, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, log: cfg.Logger.With(slog.String("slot", cfg.SlotName)), m: m}
	return r, nil
}

// ConfirmedLSN returns the LSN last reported to PostgreSQL as written,
// flushed and applied (the slot's confirmed position as far as this relay
// knows), or the slot's confirmed_flush_lsn read at start. Zero before Run
// has connected.
func (r *Relay) ConfirmedLSN() pglogrepl.LSN {
	return pglogrepl.LSN(r.confirmed.Load())
}

// Run sets up the publication, the replication slot and the topic, then
// streams outbox inserts to Kafka until ctx is cancelled or a fatal error
// occurs (issue 13: nothing else ends the relay).
//
// On cancellation it stops reading, waits up to ShutdownTimeout for in-flight
// records, marks the acknowledged rows published, sends a final standby
// status update with the confirmable LSN and returns nil (or the error of
// that last step).
//
// A session that fails for any other reason (PostgreSQL or the broker
// unreachable, a record's retryable produce failure — recorded on its row
// with outbox.RecordFailure —, another process holding the slot) is closed
// and a new one opened after RestartBackoffMin..Max, counted in
// converge_relay_restarts_total{reason}: the slot resumes after the last
// confirmed transaction and the records after it are produced again
// (at-least-once). A record the broker refuses for good (too large,
// invalid) and a row that cannot be decoded are parked (outbox.Park), not
// retried, and the stream goes on past them.
//
// A publication that does not deliver outbox inserts (ErrPublicationMismatch,
// at start or found by the periodic check) or an outbox Relation message
// without a column the relay reads (ErrRelationMismatch) does not end Run:
// the session ends without a further status update, Health reports the
// mismatch with its fix, and Run checks again every SlotSampleInterval,
// opening a session only once the publication delivers inserts again
// (package doc, "Publication checks").
//
// Run returns only the fatal errors, which need a person: ErrSlotLost,
// ErrSlotMismatch, ErrInvalidRow for a tuple without a readable outbox id,
// and an injected fault (wrapping fault.ErrInjected: a simulated crash; no
// further status update is sent).
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return ErrAlreadyRunning
	}
	defer r.running.Store(false)
	for attempt := 0; ; attempt++ {
		started := time.Now()
		err := r.runSession(ctx)
		if ctx.Err() != nil || err == nil {
			return err
		}
		if me := (*mismatchError)(nil); errors.As(err, &me) {
			// Not a restart: a publication mismatch is waited out by the
			// next session's open; only a session can meet a stream
			// finding again.
			attempt = 0
			if me.stream && !backoff.Wait(ctx, r.cfg.SlotSampleInterval) {
				return nil
			}
			continue
		}
		if fatal(err) {
			return err
		}
		if time.Since(started) >= healthySession {
			attempt = 0
		}
		reason := restartReason(err)
		r.m.restarts.WithLabelValues(reason).Inc()
		delay := backoff.Delay(r.cfg.RestartBackoffMin, r.cfg.RestartBackoffMax, attempt)
		r.log.WarnContext(ctx, "relay session failed; restarting from the slot", slog.String("reason", reason),
			slog.Duration("backoff", delay), slog.String("error", err.Error()))
		if !backoff.Wait(ctx, delay) {
			return nil
		}
	}
}

// healthySession is how long a session must have run for the next restart
// to wait only RestartBackoffMin again.
const healthySession = time.Minute

// fatal reports the errors that end Run: restarting cannot fix them.
func fatal(err error) bool {
	for _, e := range []error{ErrSlotLost, ErrSlotMismatch, ErrInvalidRow, fault.ErrInjected} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// kafkaError is a session's failure to talk to the broker before it
// streams (the topic check of open): restart reason "kafka".
type kafkaError struct{ err error }

func (e *kafkaError) Error() string { return "kafka: " + e.err.Error() }
func (e *kafkaError) Unwrap() error { return e.err }

// restartReason is the reason label of a session failure.
func restartReason(err error) string {
	var pe *produceError
	var ke *kafkaError
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pe):
		return reasonProduce
	case errors.As(err, &ke):
		return reasonKafka
	case errors.Is(err, ErrSlotActive):
		return reasonSlotActive
	case errors.As(err, &pgErr), pgconn.SafeToRetry(err), isDatabaseErr(err):
		return reasonDatabase
	}
	return reasonOther
}

// isDatabaseErr reports a failure to reach or talk to PostgreSQL (connect,
// a lost connection).
func isDatabaseErr(err error) bool {
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.Timeout(err) || errors.Is(err, io.ErrUnexpectedEOF)
}

// runSession runs one session: open, stream, close. A retryable produce
// failure is recorded on its row — on every row whose produce failed this
// session, not only the first (issue 13: attempts and last error per row,
// seed 4.1) — before the session's pool closes.
func (r *Relay) runSession(ctx context.Context) error {
	s, err := r.open(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer s.close()
	r.m.streaming.Set(1)
	defer r.m.streaming.Set(0)
	stopMonitor := s.startMonitor(ctx)
	defer stopMonitor()
	err = s.stream(ctx)
	var pe *produceError
	if errors.As(err, &pe) {
		s.recordProduceFailures(ctx, pe)
	}
	return err
}

// recordProduceFailures records the failed attempt on every row whose
// produce failed this session (first, the one that ended it), one UPDATE
// per error code, with that code's first message.
func (s *session) recordProduceFailures(ctx context.Context, first *produceError) {
	fails := s.tr.failedProduces()
	if len(fails) == 0 {
		fails = []*produceError{first}
	}
	var codes []string
	ids, msg := map[string][]string{}, map[string]string{}
	for _, f := range fails {
		if _, ok := ids[f.code]; !ok {
			codes = append(codes, f.code)
			msg[f.code] = f.err.Error()
		}
		ids[f.code] = append(ids[f.code], f.outboxID)
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	for _, code := range codes {
		if _, ferr := outbox.RecordFailure(rctx, s.pool, ids[code], code, msg[code]); ferr != nil {
			s.log.WarnContext(ctx, "could not record the failed publish attempts on their outbox rows", slog.Int("rows", len(ids[code])),
				slog.String("first", ids[code][0]), slog.String("error", ferr.Error()))
		}
	}
	if len(fails) > 1 {
		s.log.WarnContext(ctx, "produce failed for several outbox rows; attempts recorded on each", slog.Int("rows", len(fails)))
	}
}

// session is the state of one Run: its connections and the stream position.
type session struct {
	r     *Relay
	cfg   *Config
	log   *slog.Logger
	m     *metrics
	pool  *pgxpool.Pool
	store *store
	repl  *pgconn.PgConn
	kcl   *kgo.Client
	tr    *tracker
	// sem holds one token per record produced and not yet acknowledged
	// (or parked): the relay's own bound on Kafka's buffer, so waiting for
	// room never blocks status updates.
	sem chan struct{}
	// txnSem holds one token per transaction tracked (from its Begin until
	// the slot may pass it; the tracker takes the tokens back).
	txnSem chan struct{}
	// closing is set before the Kafka client is closed: failures after it
	// are abandoned records, not produce errors.
	closing atomic.Bool
	// produceFailed counts the session's failed produces (only the first
	// is logged).
	produceFailed atomic.Int64
	// produceCtx is the records' context: not cancelled with Run's ctx, so
	// a shutdown lets in-flight records finish.
	produceCtx context.Context

	relations map[uint32]*relation
	// skipBelow is the position the slot's relay last recorded in
	// relay_progress before this session: a transaction whose commit LSN
	// is below it was produced and recorded already, and its rows are not
	// produced again when the slot streams it again. txnBelowProgress is set
	// for the transaction being received when it is one of them.
	skipBelow        pglogrepl.LSN
	txnBelowProgress bool
	// progressAt and progressLSN are the marker's last write to
	// relay_progress (marker.go, recordProgress); systemID is the
	// cluster's system identifier (IDENTIFY_SYSTEM), which the rows are
	// written with and read by: "" when it could not be read, and then
	// the session neither reads nor writes progress.
	progressAt      time.Time
	progressLSN     pglogrepl.LSN
	progressBlocked bool // a write found the slot not held by this session's walsender (logged once)
	systemID        string
	walAtStart      pglogrepl.LSN // the server's WAL flush position from IDENTIFY_SYSTEM
	walsender       uint32        // the process id of the replication connection's walsender
	// checkNow asks the monitor for a publication check (an outbox
	// Relation message arrived).
	checkNow     chan struct{}
	inTxn        bool
	txnSeq       uint64
	txnCommitLSN pglogrepl.LSN // of the transaction being received (Begin's final LSN)
	serverWALEnd pglogrepl.LSN
	// keepaliveEnd is the highest WAL position of a primary keepalive: the
	// walsender's sent position (sentPtr), everything before which it has
	// decoded and sent.
	keepaliveEnd pglogrepl.LSN
	nextStatus   time.Time

	// The marker goroutine (marker.go).
	markGuard
}

// open connects to PostgreSQL and Kafka, sets up publication, slot and
// topic, and starts replication.
func (r *Relay) open(ctx context.Context) (_ *session, err error) {
	cfg := &r.cfg
	s := &session{r: r, cfg: cfg, log: r.log, m: r.m, relations: map[uint32]*relation{},
		sem: make(chan struct{}, cfg.MaxBufferedRecords), txnSem: make(chan struct{}, cfg.MaxBufferedRecords), checkNow: make(chan struct{}, 1)}
	defer func() {
		if err != nil {
			s.close()
		}
	}()

	poolCfg, err := dbpool.ParseConfig(cfg.DatabaseURL, "converge-relay")
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	poolCfg.MaxConns = 3 // the marker's writes, heartbeats, slot samples
	if s.pool, err = pgxpool.NewWithConfig(ctx, poolCfg); err != nil {
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	s.store = &store{pool: s.pool}

	if err := s.awaitPublication(ctx); err != nil {
		return nil, err
	}

	replCfg, err := pgconn.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	replCfg.RuntimeParams["replication"] = "database"
	dbpool.SetApplicationName(replCfg.RuntimeParams, "converge-relay")
	if s.repl, err = pgconn.ConnectConfig(ctx, replCfg); err != nil {
		return nil, fmt.Errorf("open replication connection: %w", err)
	}
	// The cluster's identity, for the relay's recorded progress (before
	// START_REPLICATION: the connection takes no command after it).
	if id, err := pglogrepl.IdentifySystem(ctx, s.repl); err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		s.log.WarnContext(ctx, "could not identify the cluster (IDENTIFY_SYSTEM); the relay's progress is neither read nor recorded this session",
			slog.String("error", err.Error()))
	} else {
		s.systemID, s.walAtStart, s.walsender = id.SystemID, id.XLogPos, s.repl.PID()
	}

	si, err := s.store.slot(ctx, cfg.SlotName)
	if err != nil {
		return nil, err
	}
	if !si.exists {
		// A new slot streams only what commits after it: a progress
		// recorded for an earlier slot of its name says nothing about it.
		// Forgotten before the slot exists, so that a failure here (or a
		// crash) repeats it at the next attempt.
		if err := s.store.forgetProgress(ctx, cfg.SlotName); err != nil {
			return nil, err
		}
		created, err := createSlot(ctx, s.repl, cfg.SlotName)
		if err != nil {
			return nil, err
		}
		if created {
			// After events were written, a new slot means the rows
			// committed before it are not streamed: an operator should
			// see that (the reconciler republishes them).
			hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			history, err := s.store.outboxHasHistory(hctx)
			cancel()
			switch {
			case err != nil && ctx.Err() == nil:
				s.log.WarnContext(ctx, "created replication slot; could not tell whether outbox rows were written before it", slog.String("error", err.Error()))
			case err != nil:
				// stopping: open fails on ctx below
			case history:
				s.log.WarnContext(ctx, "created replication slot after outbox rows were written: rows committed before it are not streamed; a reconciler with Kafka brokers republishes those not recorded published (was the slot dropped or lost?)")
			default:
				s.log.InfoContext(ctx, "created replication slot")
			}
		}
		if si, err = s.store.slot(ctx, cfg.SlotName); err != nil {
			return nil, err
		}
		if !si.exists {
			return nil, fmt.Errorf("replication slot %s vanished right after its creation", cfg.SlotName)
		}
	}
	s.m.setWALStatus(si.walStatus)
	if err := checkSlot(si, cfg.SlotName); err != nil {
		return nil, err
	}
	if si.walStatus == "unreserved" {
		s.log.WarnContext(ctx, "replication slot is about to lose WAL (wal_status unreserved): the relay is far behind",
			slog.String("confirmed_flush_lsn", si.confirmed.String()))
	}

	opts := append([]kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ClientID("converge-relay"),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(5 * time.Millisecond),
		kgo.MaxBufferedRecords(cfg.MaxBufferedRecords),
		kgo.RecordDeliveryTimeout(cfg.DeliveryTimeout),
		kgo.WithLogger(kafkalog.New(cfg.Logger)),
	}, cfg.KafkaOpts...)
	if s.kcl, err = kgo.NewClient(opts...); err != nil {
		return nil, fmt.Errorf("create kafka client: %w", err)
	}
	if err := kafkatopic.Ensure(ctx, s.kcl, cfg.Partitions, cfg.Topic); err != nil {
		return nil, &kafkaError{err}
	}

	pluginArgs := []string{
		"proto_version '1'",
		fmt.Sprintf("publication_names '%s'", cfg.PublicationName),
	}
	if cfg.HeartbeatInterval > 0 {
		pluginArgs = append(pluginArgs, "messages 'true'") // heartbeats (PostgreSQL 14+)
	}
	err = pglogrepl.StartReplication(ctx, s.repl, cfg.SlotName, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: pluginArgs,
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgObjectInUse {
			return nil, fmt.Errorf("start replication: %w: %s", ErrSlotActive, pgErr.Message)
		}
		return nil, fmt.Errorf("start replication from slot %s: %w", cfg.SlotName, err)
	}
	// We own the slot now: its confirmed_flush_lsn is where the server
	// resumes and can only be moved by us. Never report less (PostgreSQL
	// would move the slot back).
	if si, err = s.store.slot(ctx, cfg.SlotName); err != nil {
		return nil, err
	}
	r.clearStreamBefore(ctx, si.confirmed)
	s.loadProgress(ctx, si)
	s.tr = newTracker(si.confirmed, s.txnSem)
	r.confirmed.Store(uint64(si.confirmed))
	s.m.confirmedLSN.Set(float64(si.confirmed))
	s.m.lastAckedLSN.Set(float64(si.confirmed))
	s.log.InfoContext(ctx, "streaming", slog.String("publication", cfg.PublicationName),
		slog.String("topic", cfg.Topic), slog.String("confirmed_flush_lsn", si.confirmed.String()))
	return s, nil
}

// loadProgress reads the position this slot's relay last recorded in
// relay_progress into s.skipBelow. After a crash of PostgreSQL the slot
// resumes from the confirmed_flush_lsn last written to disk, which on
// PostgreSQL 15 may be minutes behind what the relay had confirmed
// (persistSlot); the rows of those minutes' transactions are in Kafka
// already, and without this they would all be produced again. A failed
// read costs only those duplicates: it is logged, and the session goes on.
func (s *session) loadProgress(ctx context.Context, si slotInfo) {
	s.progressAt = time.Now() // the marker's first write comes a StatusInterval after the start
	if s.systemID == "" {
		return
	}
	lsn, err := s.store.progress(ctx, s.cfg.SlotName, s.systemID)
	if err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "could not read the relay's recorded progress; transactions the slot streams again are produced again",
				slog.String("error", err.Error()))
		}
		return
	}
	if lsn > s.walAtStart {
		// Written by this cluster's system identifier but ahead of its
		// WAL: a copy of another cluster of the same lineage (built from
		// one base backup, then diverged). Not this WAL's position: drop
		// it, so that no later session trusts it either.
		s.log.WarnContext(ctx, "the relay's recorded progress lies ahead of this cluster's WAL (the database was copied from another cluster); removing it",
			slog.String("recorded_progress", lsn.String()), slog.String("wal_flush_lsn", s.walAtStart.String()))
		if err := s.store.forgetProgress(ctx, s.cfg.SlotName); err != nil {
			s.log.WarnContext(ctx, "could not remove the relay's recorded progress; this session neither reads nor records it", slog.String("error", err.Error()))
			s.systemID = ""
		}
		return
	}
	s.skipBelow = lsn
	s.progressLSN = max(lsn, si.confirmed)
	if lsn > si.confirmed {
		s.log.InfoContext(ctx, "the slot resumes before the relay's recorded progress; the transactions in between are not produced again",
			slog.String("confirmed_flush_lsn", si.confirmed.String()), slog.String("recorded_progress", lsn.String()))
	}
}

// close releases the session's connections. In-flight records are
// abandoned (they are produced again after a restart).
func (s *session) close() {
	s.closing.Store(true)
	if s.kcl != nil {
		s.kcl.Close()
	}
	if s.repl != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.repl.Close(ctx)
		cancel()
	}
	if s.pool != nil {
		s.pool.Close()
	}
}

// errStopping is returned inside the loop when ctx was cancelled.
var errStopping = errors.New("stopping")

// stream is the replication loop. It owns the replication connection: its
// receives are bounded by a read deadline (receiveDeadline), so status
// updates happen while the stream is idle (the PeerDB pattern). The record
// of published transactions is written by the marker goroutine (marker.go).
func (s *session) stream(ctx context.Context) error {
	s.produceCtx = context.WithoutCancel(ctx)
	markCtx, cancelMark := context.WithCancel(context.WithoutCancel(ctx))
	s.startMarker(markCtx)
	defer func() {
		// Error paths: stop the marker without a further UPDATE. A no-op
		// after a clean shutdown.
		cancelMark()
		s.stopMarker()
	}()
	s.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	rd := newReceiveDeadline(ctx, s.repl.Conn(), s.cfg.ReceiveTimeout)
	defer rd.release()
	shutdown := func() error {
		rd.release()
		return s.shutdown(ctx)
	}
	for {
		if ctx.Err() != nil {
			return shutdown()
		}
		now := time.Now()
		if err := s.housekeeping(now); err != nil {
			return err
		}
		if err := rd.before(now, s.nextStatus); err != nil {
			return fmt.Errorf("receive from replication slot %s: set read deadline: %w", s.cfg.SlotName, err)
		}
		if ctx.Err() != nil {
			return shutdown()
		}
		msg, err := s.repl.ReceiveMessage(context.Background())
		if err != nil {
			if pgconn.Timeout(err) || ctx.Err() != nil {
				rd.expired()
				continue
			}
			return fmt.Errorf("receive from replication slot %s: %w", s.cfg.SlotName, err)
		}
		if err := s.handle(ctx, msg); err != nil {
			if errors.Is(err, errStopping) {
				return shutdown()
			}
			return err
		}
	}
}

// housekeeping fails on a produce or marker failure and sends a status
// update when due.
func (s *session) housekeeping(now time.Time) error {
	if err := s.tr.failure(); err != nil {
		return err
	}
	if err := s.markFailure(); err != nil {
		return err
	}
	if !now.Before(s.nextStatus) {
		return s.sendStatus()
	}
	return nil
}

// sendStatus reports the confirmable LSN as written, flushed AND applied:
// pglogrepl copies the write position into zero flush/apply positions, which
// would advance the slot past unacknowledged events.
// It fails, sending nothing, once the marker failed (an injected fault
// after the UPDATE must not let the slot pass its rows).
func (s *session) sendStatus() error {
	s.markMu.Lock()
	markErr := s.markErr
	if !s.inTxn && s.keepaliveEnd > 0 {
		// Idle: every transaction the server sent before its keepalive is
		// done, so its sent position may be confirmed. Without this a fast
		// shutdown of PostgreSQL waits for good: its walsender waits for the
		// client to confirm everything sent, the shutdown checkpoint
		// included, and a heartbeat cannot connect then (issue 13 review).
		s.tr.advanceIdle(s.keepaliveEnd)
	}
	lsn := s.tr.confirmable()
	s.markMu.Unlock()
	if markErr != nil {
		return markErr
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.repl, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn,
		WALFlushPosition: lsn,
		WALApplyPosition: lsn,
		ClientTime:       time.Now(),
	})
	if err != nil {
		return fmt.Errorf("send standby status update %s: %w", lsn, err)
	}
	s.r.confirmed.Store(uint64(lsn))
	s.m.statusUpdatesOut.Inc()
	s.m.confirmedLSN.Set(float64(lsn))
	s.updateGauges()
	s.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	return nil
}

func (s *session) updateGauges() {
	txns, records := s.tr.stats()
	s.m.txnsInFlight.Set(float64(txns))
	s.m.recordsInFlight.Set(float64(records))
	s.m.lastAckedLSN.Set(float64(s.tr.confirmable()))
}

// handle processes one message of the replication stream.
func (s *session) handle(ctx context.Context, msg pgproto3.BackendMessage) error {
	switch msg := msg.(type) {
	case *pgproto3.CopyData:
		if len(msg.Data) == 0 {
			return nil
		}
		switch msg.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("parse keepalive: %w", err)
			}
			s.noteWALEnd(pkm.ServerWALEnd)
			if pkm.ServerWALEnd > s.keepaliveEnd {
				s.keepaliveEnd = pkm.ServerWALEnd
			}
			if pkm.ReplyRequested {
				return s.sendStatus()
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("parse xlog data: %w", err)
			}
			s.noteWALEnd(xld.ServerWALEnd)
			return s.handleWAL(ctx, xld.WALData)
		}
	case *pgproto3.ErrorResponse:
		pgErr := pgconn.ErrorResponseToPgError(msg)
		if isPublicationGone(pgErr) {
			return s.publicationGone(ctx, pgErr)
		}
		return fmt.Errorf("replication stream of slot %s: %w", s.cfg.SlotName, pgErr)
	case *pgproto3.CopyDone:
		return fmt.Errorf("replication stream of slot %s ended by the server", s.cfg.SlotName)
	}
	return nil
}

func (s *session) noteWALEnd(lsn pglogrepl.LSN) {
	if lsn > s.serverWALEnd {
		s.serverWALEnd = lsn
	}
}

// handleWAL decodes one pgoutput (protocol 1) message.
func (s *session) handleWAL(ctx context.Context, data []byte) error {
	lm, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("parse pgoutput message: %w", err)
	}
	switch m := lm.(type) {
	case *pglogrepl.RelationMessage:
		return s.handleRelation(ctx, m)
	case *pglogrepl.BeginMessage:
		if s.inTxn {
			return fmt.Errorf("pgoutput: Begin of xid %d inside a transaction", m.Xid)
		}
		if err := s.acquire(ctx, s.txnSem); err != nil {
			return err
		}
		s.txnSeq = s.tr.begin(m.CommitTime, m.Xid)
		s.txnCommitLSN = m.FinalLSN
		s.inTxn = true
		s.txnBelowProgress = m.FinalLSN < s.skipBelow
	case *pglogrepl.InsertMessage:
		if !s.inTxn {
			return errors.New("pgoutput: Insert outside a transaction")
		}
		return s.produce(ctx, m)
	case *pglogrepl.LogicalDecodingMessage:
		s.handleMessage(ctx, m)
	case *pglogrepl.CommitMessage:
		if !s.inTxn {
			return errors.New("pgoutput: Commit outside a transaction")
		}
		s.inTxn = false
		if a := s.tr.commit(s.txnSeq, m.TransactionEndLSN); a.ok {
			s.m.commitToAck.Observe(time.Since(a.commitTime).Seconds())
		}
	}
	return nil
}

// produce hands one inserted outbox row to the producer. It waits for room
// when MaxBufferedRecords rows are in flight (produced and not yet marked
// published), sending status updates meanwhile; it returns errStopping when
// ctx is cancelled while waiting.
func (s *session) produce(ctx context.Context, m *pglogrepl.InsertMessage) error {
	rel := s.relations[m.RelationID]
	if rel == nil {
		return fmt.Errorf("pgoutput: insert into relation %d before its Relation message", m.RelationID)
	}
	if !rel.outbox {
		return nil
	}
	if s.txnBelowProgress {
		// Below the recorded progress: an earlier session had every row
		// of the transaction acknowledged by Kafka (or parked) and
		// recorded. The transaction, left without rows, is done at its
		// Commit.
		s.m.rowsAlreadyPublished.Inc()
		return nil
	}
	row, err := rel.decode(m.Tuple)
	if err != nil {
		if row.outboxID == "" {
			return err // not even its id: nothing to park
		}
		// The row has an id but cannot be relayed: park it, and go on.
		if err := s.acquire(ctx, s.sem); err != nil {
			return err
		}
		s.log.ErrorContext(ctx, "outbox row cannot be decoded; parking it (converge outbox list)",
			slog.String("outbox_id", row.outboxID), slog.String("error", err.Error()))
		s.tr.add(s.txnSeq)
		s.tr.ackPark(s.txnSeq, row.outboxID, parkReason{code: "INVALID_ROW", message: err.Error()})
		return nil
	}
	rec, hashMatches := row.record(s.cfg.Topic)
	if !hashMatches {
		s.m.hashMismatches.Inc()
		s.log.WarnContext(ctx, "outbox payload_sha256 is not the SHA-256 of the stored payload; relaying it as it is (consumers refuse it)",
			slog.String("outbox_id", row.outboxID), slog.String("payload_sha256", row.payloadSHA256), slog.String("computed_sha256", canon.SHA256Hex(row.payload)))
	}
	if err := s.acquire(ctx, s.sem); err != nil {
		return err
	}
	s.tr.add(s.txnSeq)
	s.produceRecord(s.txnSeq, row.outboxID, row.eventType, rec)
	return nil
}

// acquire takes a token of sem (s.sem or s.txnSem), running housekeeping
// (status updates, produce and marker failures) while it waits, and asking
// the marker for a flush: waiting transactions free their tokens only once
// recorded.
func (s *session) acquire(ctx context.Context, sem chan struct{}) error {
	select {
	case sem <- struct{}{}:
		return nil
	default:
	}
	s.kickMarker()
	for {
		wait := min(time.Until(s.nextStatus), 10*time.Millisecond)
		t := time.NewTimer(max(wait, time.Millisecond))
		select {
		case sem <- struct{}{}:
			t.Stop()
			return nil
		case <-ctx.Done():
			t.Stop()
			return errStopping
		case <-t.C:
			if err := s.housekeeping(time.Now()); err != nil {
				return err
			}
		}
	}
}

// shutdown drains in-flight records (bounded by ShutdownTimeout), marks the
// acknowledged rows published and sends the final status update.
func (s *session) shutdown(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownTimeout)
	defer cancel()
	if err := s.kcl.Flush(ctx); err != nil {
		s.log.WarnContext(ctx, "in-flight records not acknowledged before the shutdown timeout; they will be produced again after a restart",
			slog.String("error", err.Error()))
	}
	s.stopMarker() // a last UPDATE of the acknowledged rows
	if err := s.markFailure(); err != nil {
		return err
	}
	if err := s.sendStatus(); err != nil {
		return fmt.Errorf("final status update: %w", err)
	}
	s.recordProgress(ctx)
	s.persistSlot(ctx)
	s.log.InfoContext(ctx, "stopped", slog.String("confirmed_lsn", s.tr.confirmable().String()))
	return nil
}

// persistSlot makes the final confirmed position survive a restart of
// PostgreSQL. PostgreSQL 15 writes a logical slot's confirmed_flush_lsn to
// disk only when the slot is dirty, which a standby status update alone does
// not make it (restart_lsn must move too; fixed in PostgreSQL 17), so after a
// restart the slot would resume from an older position and republish more
// than needed. The relay therefore ends its replication connection and
// advances the now inactive slot to the position it already confirmed with
// pg_replication_slot_advance, which marks the slot dirty; the next
// checkpoint (a clean shutdown makes one) persists it. Failure only costs
// duplicates, so it is logged, not returned.
func (s *session) persistSlot(ctx context.Context) {
	lsn := s.tr.confirmable()
	if lsn == 0 || s.repl == nil {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_ = s.repl.Close(cctx)
	cancel()
	s.repl = nil
	if err := s.store.advanceInactiveSlot(ctx, s.cfg.SlotName, lsn); err != nil {
		s.log.WarnContext(ctx, "could not mark the slot position for persistence; a restart may republish already acknowledged events",
			slog.String("lsn", lsn.String()), slog.String("error", err.Error()))
	}
}
