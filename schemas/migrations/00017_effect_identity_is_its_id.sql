-- +goose NO TRANSACTION
-- +goose Up
-- Issue 11: an effect's identity is held by one unique index, not two.
--
-- The effect ledger had two unique indexes on what is, for every row the
-- code writes, the same value: the primary key effect_id, and
-- UNIQUE (effect_kind, idempotency_token). Every effect kind's constructor
-- (ledger.NewPut, NewCompensation, NewDelete) sets effect_id to its token, and the
-- tokens of different kinds cannot meet: a put's is "<task_id>.attempt-<n>"
-- with a server-generated UUIDv7 task id, a hide's "compensation-for-…", a
-- delete's "delete-for-…". So a unique effect_id is a unique token, which
-- makes (kind, token) unique.
--
-- Each unique index costs an entry per row version: the insert of the
-- worker's plan and its update to verified (never HOT: the partial indexes
-- reference state) each wrote one into both. The second index goes, and a
-- CHECK makes the equality that carries the identity a rule of the table
-- rather than a habit of the code. The ledger's reads and ON CONFLICT use
-- effect_id (the primary key) for the identity.
--
-- The CHECK is added NOT VALID, then validated: the validation reads the
-- table under a SHARE UPDATE EXCLUSIVE lock, which lets the worker and the
-- reconciler go on writing while an existing ledger is checked (outside a
-- transaction: goose's NO TRANSACTION, as migrations 00013 and 00014).
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_id_is_token;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_id_is_token CHECK (effect_id = idempotency_token) NOT VALID;
ALTER TABLE effect_ledger VALIDATE CONSTRAINT effect_ledger_id_is_token;
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_effect_kind_idempotency_token_key;

-- +goose Down
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_effect_kind_idempotency_token_key UNIQUE (effect_kind, idempotency_token);
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_id_is_token;
