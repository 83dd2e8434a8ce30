-- +goose Up
-- Issue 11: the relay's published_at UPDATE becomes a HOT update.
--
-- PostgreSQL can update a row in place on its page (heap-only tuple, no new
-- index entries) only when no index references a changed column; the
-- partial index outbox_event_unpublished_idx (... WHERE published_at IS
-- NULL) referenced published_at in its predicate, so every mark wrote a new
-- heap tuple plus entries in the primary key and the unique index
-- (n_tup_hot_upd 0 of 1000; 963 of 1000 without it, BENCHMARKS.md).
--
-- The reconciler's backlog check now finds unpublished rows from a
-- watermark on created_xid, the inserting transaction's 64-bit id: every
-- row a snapshot cannot see yet has created_xid >= pg_snapshot_xmin of that
-- snapshot, so rows below the watermark the check keeps
-- (min(oldest unpublished row seen, snapshot xmin)) were all seen published
-- (outbox.Backlog). created_at could not serve: writers may set it from
-- their own clock, before their transaction began.
--
-- fillfactor 50 leaves each page room for the second version of every row
-- (the relay updates each row once, milliseconds after its insert), so the
-- update stays on its page without waiting for pruning.
--
-- Existing rows get the migration's own transaction id (ADD COLUMN with a
-- volatile default rewrites the table under an exclusive lock: run it in a
-- quiet window on a large outbox).
ALTER TABLE outbox_event ADD COLUMN created_xid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX outbox_event_created_xid_idx ON outbox_event (created_xid);
DROP INDEX outbox_event_unpublished_idx;
ALTER TABLE outbox_event SET (fillfactor = 50);

-- +goose Down
ALTER TABLE outbox_event RESET (fillfactor);
CREATE INDEX outbox_event_unpublished_idx ON outbox_event (created_at) WHERE published_at IS NULL;
DROP INDEX outbox_event_created_xid_idx;
ALTER TABLE outbox_event DROP COLUMN created_xid;
