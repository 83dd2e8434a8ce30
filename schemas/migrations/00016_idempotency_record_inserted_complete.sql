-- +goose Up
-- Issue 11: the create transaction inserts its idempotency record complete
-- (succeeded, with its task id and the replayable 202 response) instead of
-- inserting it in_progress and completing it with an UPDATE at the end of
-- the same transaction.
--
-- Nothing outside the transaction could ever see the in_progress record:
-- it is inserted and completed before COMMIT, and a concurrent request with
-- the same key waits on the primary key until the transaction ends, then
-- finds the record succeeded (or absent, after a rollback). The primary key
-- still decides between concurrent first uses (seed 3.1). What the UPDATE
-- cost was a second heap tuple, never HOT (the partial index
-- idempotency_record_in_progress_idx references state), with its index
-- entries: a statement, about 0.13 ms of PostgreSQL and 0.9 KB of WAL per
-- task in the peer benchmark (BENCHMARKS.md).
--
-- The record is inserted before its task (its insert decides whether the
-- request goes on at all), so its foreign key to the task is checked at
-- COMMIT, when the task is there: DEFERRABLE INITIALLY DEFERRED. A
-- transaction that would leave a record pointing at no task still fails,
-- at its COMMIT.
ALTER TABLE idempotency_record ALTER CONSTRAINT idempotency_record_task_id_fkey DEFERRABLE INITIALLY DEFERRED;

-- +goose Down
ALTER TABLE idempotency_record ALTER CONSTRAINT idempotency_record_task_id_fkey NOT DEFERRABLE;
