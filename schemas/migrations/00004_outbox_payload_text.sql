-- +goose Up
-- outbox_event.payload holds the record value exactly as the relay publishes
-- it: the RFC 8785 canonical JSON the writer encoded and hashed into
-- payload_sha256 (taskevent.Encode). jsonb does not keep the bytes it was
-- given (it reorders keys and renders ", " and ": "), so with jsonb the relay
-- had to parse and re-canonicalize every payload; with text it hashes the
-- bytes and, when they match payload_sha256, publishes them as they are
-- (cdc: record). Rows written before this migration hold jsonb's rendering
-- (USING payload::text): their hash differs from payload_sha256 and the relay
-- re-canonicalizes them, as it did for every row before.
--
-- The CHECK keeps the guarantee of the jsonb column: a payload that jsonb
-- would refuse is refused (the cast raises invalid_text_representation, 22P02,
-- on PostgreSQL 15, which has no pg_input_is_valid), so the Down migration
-- can always convert back. One ALTER TABLE: one rewrite of the table under an
-- ACCESS EXCLUSIVE lock, which also validates the constraint. The table keeps
-- its oid, so the publication FOR TABLE public.outbox_event still covers it;
-- a rewrite is not decoded as inserts by pgoutput (nothing is republished).
ALTER TABLE outbox_event
  ALTER COLUMN payload TYPE text USING payload::text,
  ADD CONSTRAINT outbox_event_payload_json_check CHECK (payload::jsonb IS NOT NULL);

-- +goose Down
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_payload_json_check;
ALTER TABLE outbox_event ALTER COLUMN payload TYPE jsonb USING payload::jsonb;
