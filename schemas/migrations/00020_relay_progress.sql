-- +goose Up
-- Issue 11: the relay's own durable record of the position it confirmed,
-- per replication slot. PostgreSQL 15 writes a logical slot's
-- confirmed_flush_lsn to disk only when the slot's restart_lsn moves, so
-- after a crash of PostgreSQL the slot resumes from a position that may be
-- minutes old and streams every transaction since then again. Every
-- transaction whose commit LSN is below confirmed_lsn had all its rows
-- acknowledged by Kafka (or parked) and recorded by this slot's relay: a new
-- session does not produce their rows again (cdc, "Transactions streamed
-- again"). The relay writes the row at most once per status interval and at
-- a clean stop. A slot dropped and created again under the same name starts
-- at the current WAL position, above any confirmed_lsn of the old one.
CREATE TABLE relay_progress (
  slot_name     text PRIMARY KEY,
  confirmed_lsn pg_lsn NOT NULL,
  updated_at    timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE relay_progress;
