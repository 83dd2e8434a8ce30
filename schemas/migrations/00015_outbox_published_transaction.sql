-- +goose Up
-- Issue 11: the relay records what it published per transaction, not per
-- row.
--
-- Until now the relay set published_at on every outbox row Kafka
-- acknowledged: one UPDATE per row, and with wal_level=logical PostgreSQL
-- logs the whole new tuple of every update of a logically logged table (no
-- prefix/suffix compression), so each mark wrote the row's payload to the
-- WAL again: 2,087 WAL bytes and 0.105 ms of statement time per task in the
-- peer benchmark, and the relay's rate was bound by it (BENCHMARKS.md).
--
-- A transaction is the relay's unit anyway: pgoutput delivers all of its
-- rows or none, the slot restarts at transaction granularity, and every row
-- of it carries the transaction's 64-bit id in created_xid (migration
-- 00008). The relay now inserts one narrow row per transaction whose outbox
-- rows it streamed and Kafka acknowledged (or it parked), before the slot
-- may pass that transaction. A row is published when its own published_at
-- is set (a republication by the reconciler or an operator, row by row as
-- before) or when it is not parked and its transaction is here:
-- outbox_published_at(e) below is that rule, the one definition every
-- reader uses.
--
-- Only transactions the relay actually received are recorded: rows the slot
-- never delivered (committed before the slot existed, while the publication
-- did not cover the table, or after a lost slot) stay unpublished until the
-- reconciler republishes them, exactly as before.
--
-- Seed 4.1 per row is unchanged: the outbox id is the message id, failed
-- attempts, the last error and the parked state stay on the row
-- (outbox.RecordFailure, outbox.Park); the broker's confirmation of a
-- successful attempt is recorded here for all rows of the transaction.
--
-- The outbox is insert-only on the relay's path now: fillfactor back to the
-- default (migration 00008 left room on each page for the mark's second
-- tuple version).
CREATE TABLE outbox_published_transaction (
  xid          xid8 PRIMARY KEY,
  published_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE outbox_event RESET (fillfactor);

-- When the row was published, or NULL while it is not: its own published_at
-- (republished row by row), else, for a row not parked, when the relay
-- recorded its transaction.
CREATE FUNCTION outbox_published_at(e outbox_event) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT COALESCE(e.published_at,
    CASE WHEN e.parked_at IS NULL THEN
      (SELECT t.published_at FROM outbox_published_transaction t WHERE t.xid = e.created_xid)
    END)
$$;

-- The publish attempts of the row (seed 4.1): the failed ones and the
-- row-by-row republications counted on the row, plus the relay's successful
-- one when its transaction is recorded.
CREATE FUNCTION outbox_publish_attempts(e outbox_event) RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT e.publish_attempts + CASE WHEN e.published_at IS NULL AND outbox_published_at(e) IS NOT NULL THEN 1 ELSE 0 END
$$;

-- +goose Down
-- Rows published through their transaction get their own published_at
-- back, so that the per-row marks the older relay reads are complete.
UPDATE outbox_event e SET published_at = t.published_at, publish_attempts = e.publish_attempts + 1
FROM outbox_published_transaction t
WHERE t.xid = e.created_xid AND e.published_at IS NULL AND e.parked_at IS NULL;
DROP FUNCTION outbox_publish_attempts(outbox_event);
DROP FUNCTION outbox_published_at(outbox_event);
ALTER TABLE outbox_event SET (fillfactor = 50);
DROP TABLE outbox_published_transaction;
