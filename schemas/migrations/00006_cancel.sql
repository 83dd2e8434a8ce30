-- +goose Up
-- Cancel by version guard (issue 12; the seed's opening scenario): a queued
-- task can be cancelled, decided in PostgreSQL by
-- `WHERE status = 'queued' AND version = $v`, and the change is announced by
-- a TaskCancelled event. cancelled is terminal.
ALTER TABLE task DROP CONSTRAINT task_status_check;
ALTER TABLE task ADD CONSTRAINT task_status_check
  CHECK (status IN ('queued', 'running', 'completed', 'failed', 'compensating', 'compensated', 'cancelled'));

ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_event_type_check
  CHECK (event_type IN ('TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested', 'TaskCancelled'));

-- +goose Down
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_event_type_check
  CHECK (event_type IN ('TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested'));
ALTER TABLE task DROP CONSTRAINT task_status_check;
ALTER TABLE task ADD CONSTRAINT task_status_check
  CHECK (status IN ('queued', 'running', 'completed', 'failed', 'compensating', 'compensated'));
