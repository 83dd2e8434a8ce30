-- +goose NO TRANSACTION
-- +goose Up
-- Issue 11: the reconciler's periodic scans (every 5 s) read the rows they
-- look for, not whole tables. Before, three of them were sequential scans
-- of tables that grow with traffic and retention: the leases of messages
-- still processing (inbox.Stales), idempotency records left in progress
-- (idempotency.Expired; the create transaction never commits one, so this
-- scan finds a record only after a defect), and the count of open dead
-- letters (the only partial index on dead_letter.state covered 'parked'
-- and 'replayed', the count asks for 'parked' and 'refused'). Each index
-- holds only the rows its scan returns (processing inbox rows, in-progress
-- records, open dead letters), so it stays small; the cost is that the
-- updates leaving those states are not HOT (the state is in the index's
-- predicate). TestPassReadsOnlyWhatItLooksFor measures the pass.
--
-- Retention's candidates were found by walking an index from the oldest
-- row: outbox.Backlog.Purgeable walked outbox_event_created_xid_idx and
-- read every row below the watermark (all published rows) whenever none
-- was old enough yet, the usual case between two purges; the dead-letter
-- orphan purge read every resolved dead letter. A BRIN index on
-- outbox_event.created_at (a few pages; created_at is never updated, so
-- HOT updates are unaffected) bounds the first to the block ranges that
-- hold old rows (32 pages each), a partial index the second.
--
-- A BRIN index returns every block range not summarized yet as a match:
-- with autosummarize, autovacuum summarizes a range once it is full,
-- instead of at the next vacuum of the table (this also bounds
-- idempotency.Purge, on idempotency_record_expires_brin).
--
-- The indexes are built CONCURRENTLY (outside a transaction: goose's NO
-- TRANSACTION), so that upgrading a live deployment does not block the
-- writes of the API, the worker and the relay to these tables while they
-- are built. A build interrupted halfway leaves an invalid index of that
-- name: each is dropped first, so applying the migration again rebuilds it.
DROP INDEX CONCURRENTLY IF EXISTS inbox_message_processing_idx;
CREATE INDEX CONCURRENTLY inbox_message_processing_idx ON inbox_message (last_seen_at) WHERE state = 'processing';
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_in_progress_idx;
CREATE INDEX CONCURRENTLY idempotency_record_in_progress_idx ON idempotency_record (locked_until) WHERE state = 'in_progress';
DROP INDEX CONCURRENTLY IF EXISTS dead_letter_open_idx;
CREATE INDEX CONCURRENTLY dead_letter_open_idx ON dead_letter (state) WHERE state IN ('parked', 'refused');
DROP INDEX CONCURRENTLY IF EXISTS dead_letter_settled_idx;
CREATE INDEX CONCURRENTLY dead_letter_settled_idx ON dead_letter (updated_at) WHERE state IN ('resolved', 'replayed');
DROP INDEX CONCURRENTLY IF EXISTS outbox_event_created_brin;
CREATE INDEX CONCURRENTLY outbox_event_created_brin ON outbox_event USING brin (created_at) WITH (pages_per_range = 32, autosummarize = on);
ALTER INDEX idempotency_record_expires_brin SET (autosummarize = on);

-- +goose Down
ALTER INDEX idempotency_record_expires_brin RESET (autosummarize);
DROP INDEX CONCURRENTLY IF EXISTS outbox_event_created_brin;
DROP INDEX CONCURRENTLY IF EXISTS dead_letter_settled_idx;
DROP INDEX CONCURRENTLY IF EXISTS dead_letter_open_idx;
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_in_progress_idx;
DROP INDEX CONCURRENTLY IF EXISTS inbox_message_processing_idx;
