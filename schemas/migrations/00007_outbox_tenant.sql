-- +goose Up
-- The tenant of the task an outbox event is about (issue 12), a copy of
-- task.tenant_id made by the writer: the relay sends it as the tenant-id
-- record header, so downstream consumers can route by tenant without
-- parsing the value. NULL for tasks created before tenants existed. No
-- foreign key: the row is a copy, and the outbox insert stays one index
-- write cheaper.
ALTER TABLE outbox_event ADD COLUMN tenant_id text;

-- +goose Down
ALTER TABLE outbox_event DROP COLUMN tenant_id;
