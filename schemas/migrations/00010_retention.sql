-- +goose Up
-- Issue 13, seed 3.3: the reconciler's retention pass removes idempotency
-- records past expires_at (once their task is settled) and published
-- outbox rows past the outbox retention window. BRIN, not B-tree: rows are
-- appended in time order, so a block range summary finds the old ones, and
-- an insert costs almost nothing (the create path stays as it is).
CREATE INDEX idempotency_record_expires_brin ON idempotency_record USING brin (expires_at);

-- +goose Down
DROP INDEX idempotency_record_expires_brin;
