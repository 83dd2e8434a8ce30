-- +goose NO TRANSACTION
-- +goose Up
-- Issue 11: the retention of tasks at the rate they are created. Removing
-- a task makes PostgreSQL check idempotency_record's foreign key to it
-- (RI_FKey_noaction_del: the rows that still name the task), and
-- task.Holds asks whether a record still names each task of a batch: both
-- look idempotency_record up by task_id, which no index led, so each was a
-- sequential scan of the table, which holds every key of the last 24 hours
-- (86 million rows at 1,000 tasks/s). Measured before this index: 0.25 ms
-- of PostgreSQL per removed task on a table of 20,000 rows, growing with
-- the table (BENCHMARKS.md, "Retention"). The cost is one index entry per
-- create.
--
-- Built CONCURRENTLY (outside a transaction: goose's NO TRANSACTION), so
-- that creates are not blocked while it is built; dropped first, so that
-- applying the migration again after an interrupted build rebuilds it.
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_task_idx;
CREATE INDEX CONCURRENTLY idempotency_record_task_idx ON idempotency_record (task_id);

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_task_idx;
