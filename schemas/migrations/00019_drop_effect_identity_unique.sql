-- +goose Up
-- Issue 11: drop UNIQUE (effect_kind, idempotency_token), which migration
-- 00017 made redundant (effect_id = idempotency_token is a CHECK there, and
-- effect_id is the primary key) and kept for the binaries built before it,
-- whose plan insert names it in ON CONFLICT (42P10 without it). Binaries
-- from 00017 on name no index and read effects by effect_id, so
-- oldest_binary becomes 17 (deploy/README.md, "Upgrades and rollbacks": a
-- release's schema serves the previous release's binaries, and 00017's
-- were those of the release before this one).
--
-- Saves the index's entry per row version: the worker's plan insert and its
-- update to verified (never HOT), 244–339 of about 9,850 WAL bytes per task
-- in the peer benchmark (BENCHMARKS.md, sessions of 2026-12-06, fifth and
-- sixth).
--
-- IF EXISTS: the first, unreleased version of 00017 dropped it already on
-- some databases. Dropping takes an ACCESS EXCLUSIVE lock on effect_ledger
-- for a moment (no rows are read).
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_effect_kind_idempotency_token_key;
UPDATE schema_compatibility SET oldest_binary = GREATEST(oldest_binary, 17);

-- +goose Down
-- Rebuilding the index reads the ledger under a SHARE lock (writers wait).
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_effect_kind_idempotency_token_key;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_effect_kind_idempotency_token_key UNIQUE (effect_kind, idempotency_token);
UPDATE schema_compatibility SET oldest_binary = 16;
