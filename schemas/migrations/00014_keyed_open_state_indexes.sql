-- +goose NO TRANSACTION
-- +goose Up
-- Issue 11: the partial indexes of the open states lead with their table's
-- key, so that a compare-and-set by key reads one entry whichever index the
-- planner takes, whatever the statistics say.
--
-- Each of these indexes holds the rows of an open state (queued, running
-- and compensating tasks; in-progress idempotency records; inbox rows still
-- processing; unresolved effects) for a reconciler scan. The hot path's
-- transitions address one row by key with a guard on that state
-- (`WHERE task_id = $1 AND status = 'queued'`, `... AND state =
-- 'in_progress'`), and the guard proves the index's predicate, so the
-- planner may scan the partial index whole, filtering on the key, instead of
-- looking the key up: both cost about 8.2 when the statistics and the index
-- were taken while almost nothing was open (the first tasks of a deployment
-- finish in milliseconds; an in-progress record is never committed, so its
-- index is always empty after a vacuum). The plan is cached on the
-- connection (pgx prepares statements; the generic plan after five
-- executions) and stays when the open rows become thousands: each call then
-- reads the whole backlog. Measured in the peer benchmark: the worker's two
-- task CAS statements took 1.35 ms per call instead of 0.09 ms and
-- task_nonterminal_idx was read 153 million times for 20,000 tasks, halving
-- the run's throughput (BENCHMARKS.md). TestKeyedTransitionsReadOneEntry
-- (cmd/converge/internal/pipeline) reproduces it for every transition.
--
-- Keyed, each index serves `key = $1` as an index condition on its leading
-- column: a lookup of one entry, as on the primary key, whichever of the two
-- the planner takes.
-- The reconciler's scans (oldest first, past a deadline) now read the open
-- rows in key order with the deadline as an index condition on the second
-- column and sort what matches: their cost follows the open rows, not the
-- table, as before (TestPassReadsOnlyWhatItLooksFor), but no longer only
-- the rows past the deadline.
--
-- Built CONCURRENTLY as in 00013 (an interrupted build leaves an invalid
-- index of that name, dropped first when the migration runs again).
DROP INDEX CONCURRENTLY IF EXISTS task_nonterminal_idx;
CREATE INDEX CONCURRENTLY task_nonterminal_idx ON task (task_id, updated_at)
  WHERE status IN ('queued', 'running', 'compensating');
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_in_progress_idx;
CREATE INDEX CONCURRENTLY idempotency_record_in_progress_idx ON idempotency_record (scope, idempotency_key, locked_until)
  WHERE state = 'in_progress';
DROP INDEX CONCURRENTLY IF EXISTS inbox_message_processing_idx;
CREATE INDEX CONCURRENTLY inbox_message_processing_idx ON inbox_message (consumer_name, message_id, last_seen_at)
  WHERE state = 'processing';
DROP INDEX CONCURRENTLY IF EXISTS effect_ledger_unresolved_idx;
CREATE INDEX CONCURRENTLY effect_ledger_unresolved_idx ON effect_ledger (effect_id, updated_at)
  WHERE state IN ('planned', 'started', 'unknown', 'compensation_required');

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS effect_ledger_unresolved_idx;
CREATE INDEX CONCURRENTLY effect_ledger_unresolved_idx ON effect_ledger (updated_at)
  WHERE state IN ('planned', 'started', 'unknown', 'compensation_required');
DROP INDEX CONCURRENTLY IF EXISTS inbox_message_processing_idx;
CREATE INDEX CONCURRENTLY inbox_message_processing_idx ON inbox_message (last_seen_at) WHERE state = 'processing';
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_in_progress_idx;
CREATE INDEX CONCURRENTLY idempotency_record_in_progress_idx ON idempotency_record (locked_until) WHERE state = 'in_progress';
DROP INDEX CONCURRENTLY IF EXISTS task_nonterminal_idx;
CREATE INDEX CONCURRENTLY task_nonterminal_idx ON task (updated_at) WHERE status IN ('queued', 'running', 'compensating');
