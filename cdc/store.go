package cdc

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// All SQL of the relay. Names of the slot and publication are validated by
// Config.Validate ([a-z0-9_]) and quoted as identifiers where SQL needs them.

const (
	outboxSchema = "public"
	outboxTable  = "outbox_event"
	// pgDuplicateObject is SQLSTATE 42710, returned when a concurrent relay
	// created the publication or the slot first.
	pgDuplicateObject = "42710"
	// pgObjectInUse is SQLSTATE 55006: "replication slot ... is active for
	// PID n".
	pgObjectInUse = "55006"
	// pgUndefinedObject is SQLSTATE 42704: the walsender's "publication
	// ... does not exist".
	pgUndefinedObject = "42704"
)

// store runs the relay's statements on the normal (non-replication) pool.
type store struct {
	pool *pgxpool.Pool
}

// ensurePublication creates publication name on public.outbox_event for
// inserts only when it is missing, and otherwise verifies that it still
// publishes inserts of public.outbox_event (a migration that dropped and
// recreated the table leaves it covering nothing). It reports whether it
// created the publication. A mismatch is checkPublication's.
func (s *store) ensurePublication(ctx context.Context, name string) (created bool, err error) {
	exists, err := s.publicationExists(ctx, name)
	if err != nil {
		return false, err
	}
	if !exists {
		q := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert')",
			pgx.Identifier{name}.Sanitize(), pgx.Identifier{outboxSchema, outboxTable}.Sanitize())
		_, err := s.pool.Exec(ctx, q)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			return true, nil
		case errors.As(err, &pgErr) && pgErr.Code == pgDuplicateObject:
			// Created concurrently by another relay: verify it below.
		default:
			return false, fmt.Errorf("create publication %s: %w", name, err)
		}
	}
	return false, s.checkPublication(ctx, name)
}

// repairPublication makes publication name cover public.outbox_event and
// publish inserts again (RepairPublication, `converge dev` only).
func (s *store) repairPublication(ctx context.Context, name string) error {
	pub, table := pgx.Identifier{name}.Sanitize(), pgx.Identifier{outboxSchema, outboxTable}.Sanitize()
	var covers bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)`,
		name, outboxSchema, outboxTable).Scan(&covers); err != nil {
		return fmt.Errorf("repair publication %s: %w", name, err)
	}
	if !covers {
		if _, err := s.pool.Exec(ctx, "ALTER PUBLICATION "+pub+" ADD TABLE "+table); err != nil {
			return fmt.Errorf("repair publication %s: %w", name, err)
		}
	}
	if _, err := s.pool.Exec(ctx, "ALTER PUBLICATION "+pub+" SET (publish = 'insert')"); err != nil {
		return fmt.Errorf("repair publication %s: %w", name, err)
	}
	return s.checkPublication(ctx, name)
}

// checkPublication verifies that publication name covers
// public.outbox_event and publishes inserts. A mismatch is a
// *mismatchError wrapping ErrPublicationMismatch whose text names the fix
// (reason missing, not_covered or no_insert); any other error is a failed
// check. The relay checks at start, every SlotSampleInterval while it
// streams and after each Relation message of the outbox: a publication
// that stops covering the outbox sends nothing more, and nothing else would
// show it.
func (s *store) checkPublication(ctx context.Context, name string) error {
	var pubInsert, covers bool
	err := s.pool.QueryRow(ctx, `
SELECT p.pubinsert,
       EXISTS (SELECT 1 FROM pg_publication_tables t
               WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
FROM pg_publication p WHERE p.pubname = $1`, name, outboxSchema, outboxTable).Scan(&pubInsert, &covers)
	if errors.Is(err, pgx.ErrNoRows) {
		return &mismatchError{sentinel: ErrPublicationMismatch, reason: mismatchMissing,
			msg: fmt.Sprintf("publication %s does not exist (the relay creates it again when it opens its next session; the reconciler republishes the rows written meanwhile)", name)}
	}
	if err != nil {
		return fmt.Errorf("verify publication %s: %w", name, err)
	}
	if !covers {
		return &mismatchError{sentinel: ErrPublicationMismatch, reason: mismatchNotCovered,
			msg: fmt.Sprintf("publication %s does not cover %s.%s (was the table dropped from it, or dropped and recreated? run ALTER PUBLICATION %s ADD TABLE %s.%s; the reconciler republishes the rows written meanwhile)",
				name, outboxSchema, outboxTable, name, outboxSchema, outboxTable)}
	}
	if !pubInsert {
		return &mismatchError{sentinel: ErrPublicationMismatch, reason: mismatchNoInsert,
			msg: fmt.Sprintf("publication %s does not publish inserts (run ALTER PUBLICATION %s SET (publish = 'insert'); the reconciler republishes the rows written meanwhile)", name, name)}
	}
	return nil
}

func (s *store) publicationExists(ctx context.Context, name string) (bool, error) {
	var exists bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, name).Scan(&exists)
	if err != nil {
		return false, fmt.Errorf("look up publication %s: %w", name, err)
	}
	return exists, nil
}

// slotInfo is a row of pg_replication_slots.
type slotInfo struct {
	exists    bool
	plugin    string
	slotType  string
	database  string // the slot's database; current is the relay's
	current   string
	walStatus string
	confirmed pglogrepl.LSN
}

// outboxHasHistory reports whether the outbox holds rows, or the relay's
// record of published transactions does: whether a slot created now starts
// after events were already written (its first start on a database the API
// wrote to first, or a slot dropped or lost and created again). The slot
// delivers only transactions that commit after it exists; older rows not
// recorded published wait for the reconciler's republication.
func (s *store) outboxHasHistory(ctx context.Context) (bool, error) {
	var has bool
	err := s.pool.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM outbox_event) OR EXISTS (SELECT 1 FROM outbox_published_transaction)`).Scan(&has)
	if err != nil {
		return false, fmt.Errorf("look for earlier outbox rows: %w", err)
	}
	return has, nil
}

// slot reads replication slot name from pg_replication_slots.
func (s *store) slot(ctx context.Context, name string) (slotInfo, error) {
	var (
		si                              slotInfo
		plugin, slotType, db, walStatus *string
		confirmed                       *string
	)
	err := s.pool.QueryRow(ctx, `
SELECT s.plugin, s.slot_type, s.database, s.wal_status, s.confirmed_flush_lsn::text, current_database()
FROM (SELECT 1) one
LEFT JOIN pg_replication_slots s ON s.slot_name = $1`, name).Scan(&plugin, &slotType, &db, &walStatus, &confirmed, &si.current)
	if err != nil {
		return si, fmt.Errorf("look up replication slot %s: %w", name, err)
	}
	if slotType == nil {
		return si, nil
	}
	si.exists = true
	si.slotType = *slotType
	si.plugin = deref(plugin)
	si.database = deref(db)
	si.walStatus = deref(walStatus)
	if confirmed != nil {
		lsn, err := pglogrepl.ParseLSN(*confirmed)
		if err != nil {
			return si, fmt.Errorf("parse confirmed_flush_lsn %q of slot %s: %w", *confirmed, name, err)
		}
		si.confirmed = lsn
	}
	return si, nil
}

// progress reads the position the relay last recorded for slot in
// relay_progress (migration 00020) on the cluster whose system identifier
// is systemID; 0 when it recorded none there.
func (s *store) progress(ctx context.Context, slot, systemID string) (pglogrepl.LSN, error) {
	var lsn *string
	err := s.pool.QueryRow(ctx, `
SELECT (SELECT confirmed_lsn::text FROM relay_progress WHERE slot_name = $1 AND system_identifier = $2)`, slot, systemID).Scan(&lsn)
	if err != nil {
		return 0, fmt.Errorf("read the relay progress of slot %s: %w", slot, err)
	}
	if lsn == nil {
		return 0, nil
	}
	return pglogrepl.ParseLSN(*lsn)
}

// recordProgress records lsn as slot's confirmed position in
// relay_progress, on the cluster whose system identifier is systemID:
// every transaction whose commit LSN is below it was produced and recorded
// by this slot's relay. It writes only while the walsender of process
// walsender holds the slot on the server the pool reaches, so that a write
// through a pool that reconnected elsewhere (a promoted standby behind the
// same address, while the replication connection still hangs on the old
// primary) changes nothing, and written is false. The position never moves
// back, except over a row another cluster wrote, which it replaces.
//
// The write commits with synchronous_commit = local: a synchronous standby
// that does not confirm (which holds every other commit, the records of
// published transactions included) must not hold the marker here, and a
// position the standby has not received yet costs at most duplicates after
// a failover; the records it covers committed before it with the
// database's own setting.
func (s *store) recordProgress(ctx context.Context, slot, systemID string, walsender uint32, lsn pglogrepl.LSN) (written bool, err error) {
	var tag pgconn.CommandTag
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = local`); err != nil {
			return err
		}
		tag, err = tx.Exec(ctx, `
INSERT INTO relay_progress (slot_name, system_identifier, confirmed_lsn)
SELECT $1::text, $2, $3::pg_lsn
WHERE EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name::text = $1::text AND active_pid = $4)
ON CONFLICT (slot_name) DO UPDATE
SET confirmed_lsn = CASE WHEN relay_progress.system_identifier = EXCLUDED.system_identifier
                         THEN GREATEST(relay_progress.confirmed_lsn, EXCLUDED.confirmed_lsn)
                         ELSE EXCLUDED.confirmed_lsn END,
    system_identifier = EXCLUDED.system_identifier,
    updated_at = now()`, slot, systemID, lsn.String(), int64(walsender))
		return err
	})
	if err != nil {
		return false, fmt.Errorf("record the relay progress of slot %s at %s: %w", slot, lsn, err)
	}
	return tag.RowsAffected() == 1, nil
}

// forgetProgress removes slot's row of relay_progress.
func (s *store) forgetProgress(ctx context.Context, slot string) error {
	if _, err := s.pool.Exec(ctx, `DELETE FROM relay_progress WHERE slot_name = $1`, slot); err != nil {
		return fmt.Errorf("remove the relay progress of slot %s: %w", slot, err)
	}
	return nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// checkSlot verifies that an existing slot can be used by this relay: a
// logical pgoutput slot of the relay's database that was not invalidated.
// Errors wrap ErrSlotLost or ErrSlotMismatch.
func checkSlot(si slotInfo, name string) error {
	switch {
	case si.slotType != "logical" || si.plugin != "pgoutput":
		return fmt.Errorf("%w: slot %s is a %s slot with plugin %q, want logical/pgoutput", ErrSlotMismatch, name, si.slotType, si.plugin)
	case si.database != si.current:
		return fmt.Errorf("%w: slot %s belongs to database %q, not %q", ErrSlotMismatch, name, si.database, si.current)
	case si.walStatus == "lost":
		return fmt.Errorf("%w: slot %s has wal_status lost (invalidated by max_slot_wal_keep_size); events after its confirmed_flush_lsn %s may be missing from the WAL: drop the slot, recreate it and let the reconciler republish unpublished outbox rows",
			ErrSlotLost, name, si.confirmed)
	}
	return nil
}

// createSlot creates the permanent logical replication slot name with the
// pgoutput plugin on a replication connection. A slot created concurrently
// by another relay is not an error (created is then false).
func createSlot(ctx context.Context, repl *pgconn.PgConn, name string) (created bool, err error) {
	_, err = pglogrepl.CreateReplicationSlot(ctx, repl, name, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
		Mode:           pglogrepl.LogicalReplication,
		SnapshotAction: "NOEXPORT_SNAPSHOT",
	})
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &pgErr) && pgErr.Code == pgDuplicateObject:
		return false, nil
	default:
		return false, fmt.Errorf("create replication slot %s: %w", name, err)
	}
}

// slotStats is the slot's position relative to the server's current WAL
// insert position, from pg_replication_slots.
type slotStats struct {
	exists        bool
	lagBytes      int64 // pg_current_wal_lsn() - confirmed_flush_lsn
	retainedBytes int64 // pg_current_wal_lsn() - restart_lsn
	walStatus     string
}

// slotStats reads the lag and retained WAL of replication slot name. A slot
// without a confirmed_flush_lsn or restart_lsn (invalidated) reports 0 for
// the missing value.
func (s *store) slotStats(ctx context.Context, name string) (slotStats, error) {
	var (
		st            slotStats
		lag, retained *int64
		walStatus     *string
	)
	err := s.pool.QueryRow(ctx, `
SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
       (pg_current_wal_lsn() - restart_lsn)::bigint,
       wal_status
FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&lag, &retained, &walStatus)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("read replication slot %s statistics: %w", name, err)
	}
	st.exists = true
	if lag != nil {
		st.lagBytes = *lag
	}
	if retained != nil {
		st.retainedBytes = *retained
	}
	st.walStatus = deref(walStatus)
	return st, nil
}

// emitHeartbeat writes a transactional logical decoding message with prefix
// HeartbeatPrefix and the given content into the WAL: it reaches every
// logical slot of the database (pgoutput sends it when the messages option
// is on) as a transaction of its own. It returns the message's LSN.
func (s *store) emitHeartbeat(ctx context.Context, content []byte) (pglogrepl.LSN, error) {
	var lsn string
	err := s.pool.QueryRow(ctx, `SELECT pg_logical_emit_message(true, $1, $2::bytea)::text`, HeartbeatPrefix, content).Scan(&lsn)
	if err != nil {
		return 0, fmt.Errorf("emit heartbeat: %w", err)
	}
	return pglogrepl.ParseLSN(lsn)
}

// advanceInactiveSlot waits (up to ctx) until no walsender holds slot, then
// calls pg_replication_slot_advance(slot, lsn) — a no-op move when lsn is the
// slot's confirmed position, which still marks the slot dirty so the next
// checkpoint writes it to disk (see session.persistSlot). A position below the
// slot's current one is left alone.
func (s *store) advanceInactiveSlot(ctx context.Context, slot string, lsn pglogrepl.LSN) error {
	for {
		var active bool
		var confirmed *string
		err := s.pool.QueryRow(ctx, `SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active, &confirmed)
		if err != nil {
			return fmt.Errorf("read slot %s: %w", slot, err)
		}
		if !active {
			if confirmed != nil {
				cur, err := pglogrepl.ParseLSN(*confirmed)
				if err == nil && cur > lsn {
					return nil
				}
			}
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("slot %s still active: %w", slot, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if _, err := s.pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, $2::pg_lsn)`, slot, lsn.String()); err != nil {
		return fmt.Errorf("advance slot %s to %s: %w", slot, lsn, err)
	}
	return nil
}
