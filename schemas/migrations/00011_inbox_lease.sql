-- +goose Up
-- Issue 13, seed 6: "same id, same hash, state processing: check the lease;
-- while it has not expired, do not process concurrently". A delivery that
-- registers a message (or resumes one left processing) takes a lease:
-- locked_by names the worker instance, locked_until is when another
-- instance may take the message over (the worker's attempt bound: the
-- holder's attempt has ended by then). A message registered before this
-- migration has no lease (NULL): the next delivery takes it at once.
ALTER TABLE inbox_message
  ADD COLUMN locked_by    text,
  ADD COLUMN locked_until timestamptz;

-- +goose Down
ALTER TABLE inbox_message
  DROP COLUMN locked_until,
  DROP COLUMN locked_by;
