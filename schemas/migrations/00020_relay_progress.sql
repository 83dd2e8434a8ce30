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
-- a clean stop.
--
-- An LSN means something only in the WAL of the cluster that wrote it:
-- system_identifier is that cluster's (IDENTIFY_SYSTEM). A row written by
-- another cluster (the database restored there with pg_dump, or copied by
-- logical replication) is ignored and replaced: its LSN may lie ahead of
-- this cluster's WAL, and a slot created here would stream new
-- transactions below it. A row ahead of the server's WAL (a cluster of the
-- same lineage, same system identifier) is removed, and so is the row of a
-- slot name before the relay creates that slot.
CREATE TABLE relay_progress (
  slot_name         text PRIMARY KEY,
  system_identifier text NOT NULL,
  confirmed_lsn     pg_lsn NOT NULL,
  updated_at        timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE relay_progress;
