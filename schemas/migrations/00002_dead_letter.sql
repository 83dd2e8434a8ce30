-- +goose Up
-- Dead letters (DESIGN.md "Kafka contract", seed 13.5): every record the
-- worker parked on the dead-letter topic <topic>.dlq, recorded by the
-- reconciler for inspection and controlled replay. The origin triple
-- (topic, partition, offset) is the identity: consuming the dead-letter
-- topic again never records a record twice.
CREATE TABLE dead_letter (
  dead_letter_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  origin_topic        text NOT NULL,
  origin_partition    integer NOT NULL CHECK (origin_partition >= 0),
  origin_offset       bigint NOT NULL CHECK (origin_offset >= 0),
  consumer_group      text NOT NULL,
  record_key          bytea,
  record_value        bytea,
  record_headers      jsonb NOT NULL DEFAULT '[]',
  message_id          text,
  task_id             text,
  error_class         text NOT NULL CHECK (error_class IN ('deterministic', 'retryable')),
  error_code          text NOT NULL,
  error_message       text NOT NULL DEFAULT '',
  attempts            integer NOT NULL CHECK (attempts >= 1),
  processor_version   text NOT NULL,
  first_failure_at    timestamptz NOT NULL,
  last_failure_at     timestamptz NOT NULL,
  dlq_partition       integer NOT NULL,
  dlq_offset          bigint NOT NULL,
  state               text NOT NULL DEFAULT 'parked' CHECK (state IN ('parked', 'replayed', 'resolved', 'refused')),
  replay_count        integer NOT NULL DEFAULT 0 CHECK (replay_count >= 0),
  last_replay_at      timestamptz,
  last_replay_by      text,
  last_replay_reason  text,
  last_replay_outcome text,
  recorded_at         timestamptz NOT NULL DEFAULT now(),
  updated_at          timestamptz NOT NULL DEFAULT now(),
  UNIQUE (origin_topic, origin_partition, origin_offset),
  CHECK (state = 'parked' OR last_replay_at IS NOT NULL)
);

CREATE INDEX dead_letter_code_idx ON dead_letter (error_code, dead_letter_id);
CREATE INDEX dead_letter_task_idx ON dead_letter (task_id);
CREATE INDEX dead_letter_unresolved_idx ON dead_letter (state) WHERE state IN ('parked', 'replayed');

-- TaskRedriveRequested: the reconciler re-drives a task left queued or
-- running without progress (a new event for the same task version; the
-- inbox and the effect ledger make a second delivery safe).
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_event_type_check
  CHECK (event_type IN ('TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested'));

-- +goose Down
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_event_type_check
  CHECK (event_type IN ('TaskCreated', 'TaskCompleted', 'TaskFailed'));
DROP TABLE dead_letter;
