-- +goose Up
-- Issue 13, seed 4.1: the publisher records, per outbox row, its attempts
-- (publish_attempts), the last error's category and text and when it
-- happened, and a parked state after a failure that retrying cannot fix (a
-- record the broker refuses: too large, invalid). A parked row is settled
-- for the relay (the slot moves past it, every other event keeps flowing)
-- until an operator decides: republished (produced again with its own
-- message id, then published_at is set) or discarded (kept, never
-- published). decided_by and decision_reason say who and why.
ALTER TABLE outbox_event
  ADD COLUMN last_error        text,
  ADD COLUMN last_attempt_at   timestamptz,
  ADD COLUMN parked_at         timestamptz,
  ADD COLUMN decision          text CHECK (decision IN ('republished', 'discarded')),
  ADD COLUMN decided_at        timestamptz,
  ADD COLUMN decided_by        text,
  ADD COLUMN decision_reason   text,
  ADD CONSTRAINT outbox_event_decision_state_check
    CHECK ((decision IS NULL) = (decided_at IS NULL) AND (decision IS NULL OR parked_at IS NOT NULL));

-- The parked rows, for the reconciler's gauge and `converge outbox list`.
-- Partial on parked_at, which the relay's published_at mark never changes
-- (HOT updates stay HOT: only the rare park writes new index entries).
CREATE INDEX outbox_event_parked_idx ON outbox_event (parked_at) WHERE parked_at IS NOT NULL;

-- +goose Down
DROP INDEX outbox_event_parked_idx;
ALTER TABLE outbox_event
  DROP CONSTRAINT outbox_event_decision_state_check,
  DROP COLUMN decision_reason,
  DROP COLUMN decided_by,
  DROP COLUMN decided_at,
  DROP COLUMN decision,
  DROP COLUMN parked_at,
  DROP COLUMN last_attempt_at,
  DROP COLUMN last_error;
