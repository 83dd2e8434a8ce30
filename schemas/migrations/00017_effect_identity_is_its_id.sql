-- +goose NO TRANSACTION
-- +goose Up
-- Issue 11: an effect's id is its idempotency token, as a rule of the table.
--
-- Every effect kind's constructor (ledger.NewPut, NewCompensation,
-- NewDelete) sets effect_id to the effect's token, and the tokens of
-- different kinds cannot meet: a put's is "<task_id>.attempt-<n>" with a
-- server-generated UUIDv7 task id, a hide's "compensation-for-…", a
-- delete's "delete-for-…". So the primary key on effect_id already makes
-- the identity (effect_kind, idempotency_token) unique, and the ledger's
-- reads use effect_id. This CHECK makes the equality that carries the
-- identity a rule of the table rather than a habit of the code.
--
-- It also makes UNIQUE (effect_kind, idempotency_token) redundant. That
-- index costs an entry per row version (the worker's plan insert and its
-- update to verified, never HOT): measured in the peer benchmark, dropping
-- it saves 244–339 of about 9,850 WAL bytes per task (BENCHMARKS.md,
-- session of 2026-12-06, fifth). It is NOT dropped here: workers and
-- reconcilers built before this migration name it in their ON CONFLICT,
-- and deploy/README's upgrade runs `converge migrate` while they still run;
-- without the index their effect plans would fail (42P10) until they are
-- replaced, and their records would be retried and then dead-lettered. A
-- later migration drops it (DROP CONSTRAINT IF EXISTS), once binaries of
-- this version are the oldest an upgrade can meet. Meanwhile the plan's
-- ON CONFLICT DO NOTHING names no index, so that a race of two plans of one
-- identity is absorbed whichever index reports it.
--
-- The CHECK is added NOT VALID, then validated. Adding it (and the DROP
-- CONSTRAINT IF EXISTS before it, which makes the migration safe to apply
-- again) takes an ACCESS EXCLUSIVE lock on effect_ledger for a moment (no
-- rows are read), which waits for the transactions using the ledger and
-- holds up new ones while it waits; the validation then reads the table
-- under a SHARE UPDATE EXCLUSIVE lock, which lets the worker and the
-- reconciler go on writing while an existing ledger is checked (outside a
-- transaction: goose's NO TRANSACTION, as migrations 00013 and 00014). A
-- validation that fails (a row whose id is not its token, which no version
-- of converge writes) leaves the constraint NOT VALID and the migration
-- unapplied; applying it again starts over.
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_id_is_token;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_id_is_token CHECK (effect_id = idempotency_token) NOT VALID;
ALTER TABLE effect_ledger VALIDATE CONSTRAINT effect_ledger_id_is_token;

-- +goose Down
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_id_is_token;
