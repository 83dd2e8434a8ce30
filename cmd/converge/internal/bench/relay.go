package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/internal/freeport"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
)

// RelayResult compares the relay with a decode-only replication loop.
type RelayResult struct {
	Rows int `json:"rows"`
	// RelayRate is events/s of each run: from the relay's start until Kafka
	// acknowledged every row, every row is marked published and the slot is
	// confirmed past the last row's commit.
	RelayRate   []float64 `json:"relay_events_per_sec"`
	RelayMedian float64   `json:"relay_median"`
	// DecodeRate is rows/s of a pglogrepl loop that only receives and
	// decodes the same rows (pgoutput) from its own slot.
	DecodeRate   []float64 `json:"decode_rows_per_sec"`
	DecodeMedian float64   `json:"decode_median"`
	Ratio        float64   `json:"ratio"`
	// StatusInterval of the relay during the measurement (the slot
	// advances at most this often).
	StatusIntervalMS int `json:"status_interval_ms"`
	RelayCPU         CPU `json:"relay_cpu"`
	DecodeCPU        CPU `json:"decode_cpu"`
	// FillRowsPerSec is how fast the outbox was filled (not a result:
	// synchronous_commit was off for the filling session).
	FillRowsPerSec float64 `json:"fill_rows_per_sec"`
	// Parts of the relay's serial loop measured alone: the record of
	// published transactions (outbox.RecordTransactions, 1000 transactions
	// per statement, its flush batch, committed synchronously), as
	// transactions/s, and canonicalizing + hashing the payload of one row
	// (taskevent.Canonical) on one core, as rows/s. Runs before 2026-12-06
	// measured the per-row published_at UPDATE instead
	// (mark_published_rows_per_sec in their JSON).
	RecordTransactionsPerSec float64 `json:"record_transactions_per_sec"`
	CanonicalRowsPerSec      float64 `json:"canonical_rows_per_sec"`
}

// RSSResult is the relay subprocess relaying one big transaction.
type RSSResult struct {
	Rows int `json:"rows"`
	// PeakRSSMB is the largest VmHWM of the relay process.
	PeakRSSMB float64 `json:"peak_rss_mb"`
	// Seconds from the process start until the slot was confirmed past the
	// transaction, and the resulting events/s.
	Seconds      float64 `json:"seconds"`
	EventsPerSec float64 `json:"events_per_sec"`
	Completed    bool    `json:"completed"`
}

const (
	benchPublication  = "bench_outbox"
	relayStatusPeriod = 100 * time.Millisecond
)

// runRelay is stage 2 (throughput).
func runRelay(ctx context.Context, e *env, res *Results) error {
	dbURL, pool, err := e.newDB(ctx, "bench_relay")
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE PUBLICATION "+benchPublication+" FOR TABLE public.outbox_event WITH (publish = 'insert')"); err != nil {
		return fmt.Errorf("create publication: %w", err)
	}
	runs := e.cfg.Runs
	// Every run gets its own pair of slots, all created before the rows:
	// the rows are written once and relayed (and decoded) once per run.
	for i := range runs {
		for _, s := range []string{relaySlot(i), decodeSlot(i)} {
			if _, err := pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", s); err != nil {
				return fmt.Errorf("create slot %s: %w", s, err)
			}
		}
	}
	defer dropSlots(e, "bench_relay")
	fx := newFixtures(e.cfg.DocSize)
	fillStart := time.Now()
	target, err := fillOutbox(ctx, pool, fx, e.cfg.RelayRows, "r")
	if err != nil {
		return err
	}
	rr := &RelayResult{Rows: e.cfg.RelayRows, StatusIntervalMS: int(relayStatusPeriod / time.Millisecond)}
	rr.FillRowsPerSec = round2(float64(e.cfg.RelayRows) / time.Since(fillStart).Seconds())
	e.progress("relay   filled %d rows (one per transaction) at %.0f rows/s", e.cfg.RelayRows, rr.FillRowsPerSec)
	for i := range runs {
		if i > 0 {
			// The previous run recorded every transaction; a relay that
			// finds them recorded would write nothing.
			if _, err := pool.Exec(ctx, "TRUNCATE outbox_published_transaction"); err != nil {
				return err
			}
		}
		m := e.cpuStart()
		n, secs, err := decodeOnly(ctx, dbURL, decodeSlot(i), e.cfg.RelayRows)
		rr.DecodeCPU = m.stop(0)
		if err != nil {
			return err
		}
		decodeRate := float64(n) / secs
		rr.DecodeRate = append(rr.DecodeRate, round2(decodeRate))

		stop := func() {}
		if i == 0 {
			stop = e.profile("relay")
		}
		m = e.cpuStart()
		secs, err = relayOnce(ctx, e, dbURL, relaySlot(i), fmt.Sprintf("bench.relay.%d", i), target, e.cfg.RelayRows)
		rr.RelayCPU = m.stop(0)
		stop()
		if err != nil {
			return err
		}
		rate := float64(e.cfg.RelayRows) / secs
		rr.RelayRate = append(rr.RelayRate, round2(rate))
		e.progress("relay   run %d: relay %.0f events/s, decode-only %.0f rows/s; cpu relay %+v decode %+v",
			i+1, rate, decodeRate, rr.RelayCPU, rr.DecodeCPU)
	}
	if rr.RecordTransactionsPerSec, err = recordTransactionsRate(ctx, pool, e.cfg.RelayRows); err != nil {
		return err
	}
	rr.CanonicalRowsPerSec = canonicalRate(fx)
	e.progress("relay   alone: transaction record INSERT %.0f transactions/s, payload canonicalization %.0f rows/s",
		rr.RecordTransactionsPerSec, rr.CanonicalRowsPerSec)
	rr.RelayMedian, rr.DecodeMedian = round2(median(rr.RelayRate)), round2(median(rr.DecodeRate))
	rr.Ratio = round2(ratio(rr.RelayMedian, rr.DecodeMedian))
	res.Relay = rr
	return nil
}

func relaySlot(i int) string  { return fmt.Sprintf("bench_relay_%d", i) }
func decodeSlot(i int) string { return fmt.Sprintf("bench_decode_%d", i) }

// dropSlots drops every replication slot of database db (they pin WAL).
func dropSlots(e *env, db string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = e.admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, db)
	for range 50 {
		if _, err := e.admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, db); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// fillOutbox inserts n TaskCreated outbox rows, one per transaction as the
// API writes them, with synchronous_commit off for this session only (the
// WAL is the same; only the filling is faster). It returns an LSN read
// inside the last transaction before its commit: a slot confirmed at or
// past it has consumed every row.
func fillOutbox(ctx context.Context, pool *pgxpool.Pool, fx *fixtures, n int, prefix string) (pglogrepl.LSN, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	pc := conn.Conn().PgConn()
	if err := pc.Exec(ctx, "SET synchronous_commit = off").Close(); err != nil {
		return 0, err
	}
	const perRoundTrip = 500
	var sb strings.Builder
	for start := 0; start < n-1; start += perRoundTrip {
		sb.Reset()
		for i := start; i < min(start+perRoundTrip, n-1); i++ {
			sb.WriteString("BEGIN;")
			writeOutboxInsert(&sb, fx, prefix, i)
			sb.WriteString("COMMIT;")
		}
		if _, err := pc.Exec(ctx, sb.String()).ReadAll(); err != nil {
			return 0, fmt.Errorf("fill outbox: %w", err)
		}
	}
	// The last row, in a transaction that reports the LSN before it commits,
	// committed synchronously: that flushes the WAL of every row before it
	// (a WAL sender sends only flushed WAL).
	if _, err := conn.Exec(ctx, "SET synchronous_commit = on"); err != nil {
		return 0, err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	sb.Reset()
	writeOutboxInsert(&sb, fx, prefix, n-1)
	if _, err := tx.Exec(ctx, sb.String()); err != nil {
		return 0, err
	}
	var lsn string
	if err := tx.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	return pglogrepl.ParseLSN(lsn)
}

func writeOutboxInsert(sb *strings.Builder, fx *fixtures, prefix string, i int) {
	taskID := fmt.Sprintf("%s-task-%010d", prefix, i)
	outboxID := fmt.Sprintf("%s-evt-%010d", prefix, i)
	payload, sha := fx.event(taskID, outboxID)
	fmt.Fprintf(sb, "INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256) VALUES ('%s', '%s', 0, 'TaskCreated', '%s', '%s');",
		outboxID, taskID, payload, sha)
}

// decodeOnly is the relay's physical limit: a minimal pglogrepl loop that
// streams slot (pgoutput, protocol 1, the relay's publication) and decodes
// every message until it has seen rows inserts, answering keepalives. It
// returns the inserts seen and the seconds it took from the replication
// start.
func decodeOnly(ctx context.Context, dbURL, slot string, rows int) (int, float64, error) {
	cfg, err := pgconn.ParseConfig(dbURL)
	if err != nil {
		return 0, 0, err
	}
	cfg.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(context.Background())
	start := time.Now()
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + benchPublication + "'"},
	})
	if err != nil {
		return 0, 0, fmt.Errorf("start replication %s: %w", slot, err)
	}
	var inserts, bytes int
	var last pglogrepl.LSN
	var readUntil time.Time
	const receiveWait = 10 * time.Second
	wake := context.AfterFunc(ctx, func() { _ = conn.Conn().SetReadDeadline(time.Now()) })
	defer wake()
	deadline := time.Now().Add(30 * time.Minute)
	for inserts < rows {
		if time.Now().After(deadline) {
			return inserts, 0, fmt.Errorf("decode-only loop: %d of %d rows after 30 minutes", inserts, rows)
		}
		// A read deadline moved twice a second rather than a context per
		// message, as the relay does (cdc's receiveDeadline): the limit
		// must not pay a cost the relay does not. A receive may still wait
		// at least 9.5 s, and a cancelled ctx wakes it (wake, above; ctx is
		// checked after the deadline moves, which could undo the wake-up).
		if now := time.Now(); readUntil.Sub(now) < receiveWait-500*time.Millisecond {
			readUntil = now.Add(receiveWait)
			if err := conn.Conn().SetReadDeadline(readUntil); err != nil {
				return inserts, 0, err
			}
		}
		if ctx.Err() != nil {
			return inserts, 0, ctx.Err()
		}
		msg, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return inserts, 0, ctx.Err()
			}
			return inserts, 0, fmt.Errorf("decode-only loop: receive: %w (%d of %d rows)", err, inserts, rows)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 {
			if er, ok := msg.(*pgproto3.ErrorResponse); ok {
				return inserts, 0, pgconn.ErrorResponseToPgError(er)
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return inserts, 0, err
			}
			if pkm.ReplyRequested {
				if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{
					WALWritePosition: last, WALFlushPosition: last, WALApplyPosition: last}); err != nil {
					return inserts, 0, err
				}
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return inserts, 0, err
			}
			lm, err := pglogrepl.Parse(xld.WALData)
			if err != nil {
				return inserts, 0, err
			}
			switch m := lm.(type) {
			case *pglogrepl.InsertMessage:
				inserts++
				for _, c := range m.Tuple.Columns {
					bytes += len(c.Data)
				}
			case *pglogrepl.CommitMessage:
				last = m.TransactionEndLSN
			}
		}
	}
	secs := time.Since(start).Seconds()
	_ = bytes
	return inserts, secs, nil
}

// relayOnce runs the relay in process on slot until it confirmed target,
// and returns the seconds from its start.
func relayOnce(ctx context.Context, e *env, dbURL, slot, topic string, target pglogrepl.LSN, rows int) (float64, error) {
	r, err := cdc.New(cdc.Config{DatabaseURL: dbURL, Brokers: e.brokers, Topic: topic, SlotName: slot,
		PublicationName: benchPublication, StatusInterval: relayStatusPeriod,
		Logger: e.log.With("component", "relay", "slot", slot), Registerer: prometheus.NewRegistry()})
	if err != nil {
		return 0, err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	limit := time.Now().Add(30 * time.Minute)
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for r.ConfirmedLSN() < target {
		select {
		case err := <-done:
			return 0, fmt.Errorf("relay stopped before confirming %s (at %s): %v", target, r.ConfirmedLSN(), err)
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-t.C:
		}
		if time.Now().After(limit) {
			return 0, fmt.Errorf("relay did not confirm %d rows within 30 minutes", rows)
		}
	}
	secs := time.Since(start).Seconds()
	cancel()
	if err := <-done; err != nil {
		return secs, fmt.Errorf("relay shutdown: %w", err)
	}
	return secs, nil
}

// runRSS is the relay's memory bound: a `converge relay` subprocess relays
// ONE transaction of RSSRows outbox rows while its VmHWM is sampled.
func runRSS(ctx context.Context, e *env, res *Results) error {
	dbURL, pool, err := e.newDB(ctx, "bench_rss")
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE PUBLICATION "+benchPublication+" FOR TABLE public.outbox_event WITH (publish = 'insert')"); err != nil {
		return fmt.Errorf("create publication: %w", err)
	}
	const slot = "bench_rss"
	if _, err := pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot); err != nil {
		return err
	}
	defer dropSlots(e, "bench_rss")
	fx := newFixtures(e.cfg.DocSize)
	fillStart := time.Now()
	target, err := fillOneTxn(ctx, pool, fx, e.cfg.RSSRows)
	if err != nil {
		return err
	}
	e.progress("rss     filled one transaction of %d rows in %.1fs", e.cfg.RSSRows, time.Since(fillStart).Seconds())

	argv := e.cfg.RelayCommand
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		argv = []string{exe, "relay"}
	}
	mport, err := freeport.Pick()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(),
		"CONVERGE_DATABASE_URL="+dbURL,
		"CONVERGE_KAFKA_BROKERS="+strings.Join(e.brokers, ","),
		"CONVERGE_TOPIC=bench.rss",
		"CONVERGE_SLOT_NAME="+slot,
		"CONVERGE_PUBLICATION_NAME="+benchPublication,
		"CONVERGE_METRICS_ADDR=127.0.0.1:"+strconv.Itoa(mport),
		"CONVERGE_LOG_LEVEL=warn",
	)
	logf, err := os.Create(filepath.Join(e.dir, "relay-rss.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start relay process %v: %w", argv, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	rr := &RSSResult{Rows: e.cfg.RSSRows}
	pid := strconv.Itoa(cmd.Process.Pid)
	limit := time.Now().Add(30 * time.Minute)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var confirmErr error
loop:
	for {
		if hwm := vmHWM(pid); hwm > rr.PeakRSSMB {
			rr.PeakRSSMB = hwm
		}
		var lsn *string
		if err := pool.QueryRow(ctx, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&lsn); err != nil {
			confirmErr = err
			break
		}
		if lsn != nil {
			if l, err := pglogrepl.ParseLSN(*lsn); err == nil && l >= target {
				rr.Completed = true
				break
			}
		}
		select {
		case err := <-exited:
			confirmErr = fmt.Errorf("relay process exited before confirming the transaction: %v (see %s)", err, logf.Name())
			exited <- err
			break loop
		case <-ctx.Done():
			confirmErr = ctx.Err()
			break loop
		case <-tick.C:
		}
		if time.Now().After(limit) {
			confirmErr = errors.New("relay process did not confirm the transaction within 30 minutes")
			break
		}
	}
	rr.Seconds = round2(time.Since(start).Seconds())
	if hwm := vmHWM(pid); hwm > rr.PeakRSSMB {
		rr.PeakRSSMB = hwm
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
	}
	if rr.Completed {
		rr.EventsPerSec = round2(float64(rr.Rows) / rr.Seconds)
	}
	res.RSS = rr
	e.progress("rss     %d rows in one transaction: peak RSS %.1f MB, %.1fs, completed=%v", rr.Rows, rr.PeakRSSMB, rr.Seconds, rr.Completed)
	return confirmErr
}

// fillOneTxn writes n outbox rows in one transaction with COPY and returns
// an LSN read before its commit.
func fillOneTxn(ctx context.Context, pool *pgxpool.Pool, fx *fixtures, n int) (pglogrepl.LSN, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	i := 0
	_, err = tx.CopyFrom(ctx, pgx.Identifier{"outbox_event"},
		[]string{"outbox_id", "aggregate_id", "aggregate_version", "event_type", "payload", "payload_sha256"},
		pgx.CopyFromFunc(func() ([]any, error) {
			if i >= n {
				return nil, nil
			}
			taskID, outboxID := fmt.Sprintf("big-task-%010d", i), fmt.Sprintf("big-evt-%010d", i)
			payload, sha := fx.event(taskID, outboxID)
			i++
			return []any{outboxID, taskID, int64(0), "TaskCreated", string(payload), sha}, nil
		}))
	if err != nil {
		return 0, fmt.Errorf("copy outbox rows: %w", err)
	}
	var lsn string
	if err := tx.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	return pglogrepl.ParseLSN(lsn)
}

// vmHWM returns the peak resident set size of pid in MB (0 when unknown).
func vmHWM(pid string) float64 {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				kb, _ := strconv.ParseFloat(f[1], 64)
				return round2(kb / 1024)
			}
		}
	}
	return 0
}

// recordTransactionsRate runs the relay's record of published transactions
// (outbox.RecordTransactions) alone on batches of 1000 transaction ids, each
// committed synchronously as the relay's is, on an emptied
// outbox_published_transaction, and returns transactions/s.
func recordTransactionsRate(ctx context.Context, pool *pgxpool.Pool, rows int) (float64, error) {
	if _, err := pool.Exec(ctx, "TRUNCATE outbox_published_transaction"); err != nil {
		return 0, err
	}
	const batch = 1000
	n := min(rows, 50*batch)
	start := time.Now()
	for from := 0; from < n; from += batch {
		xids := make([]uint32, 0, batch)
		for i := from; i < min(from+batch, n); i++ {
			xids = append(xids, uint32(1000+i))
		}
		if _, err := outbox.RecordTransactions(ctx, pool, xids); err != nil {
			return 0, err
		}
	}
	return round2(float64(n) / time.Since(start).Seconds()), nil
}

// canonicalRate canonicalizes and hashes the jsonb text rendering of a
// TaskCreated payload for about half a second on one goroutine and returns
// rows/s. Since migration 00004 this is the relay's slow path only (rows
// written before it); a row stored canonical is only hashed (cdc
// BenchmarkRecord).
func canonicalRate(fx *fixtures) float64 {
	payload, _ := fx.event("r-task-0000000001", "r-evt-0000000001")
	// jsonb renders objects with ", " and ": " separators.
	text := strings.NewReplacer(`":`, `": `, `,"`, `, "`).Replace(string(payload))
	start := time.Now()
	n := 0
	for time.Since(start) < 500*time.Millisecond {
		for range 100 {
			if _, _, err := taskevent.Canonical([]byte(text)); err != nil {
				return 0
			}
		}
		n += 100
	}
	return round2(float64(n) / time.Since(start).Seconds())
}
