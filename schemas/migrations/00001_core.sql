-- +goose Up
-- Core tables of converge. Seed section 2.1 is the starting point; DESIGN.md
-- "Data model" adds task_input, inbox_conflict, dead_letter and timestamps.
-- Every state column has a CHECK constraint and every identity that must be
-- unique has a PRIMARY KEY or UNIQUE constraint: the constraint, never a prior
-- SELECT, is the last line of defence.

CREATE TABLE task (
  task_id             text PRIMARY KEY,
  request_fingerprint text NOT NULL,
  status              text NOT NULL CHECK (status IN ('queued', 'running', 'completed', 'failed', 'compensating', 'compensated')),
  version             bigint NOT NULL DEFAULT 0 CHECK (version >= 0 AND version < 9007199254740992),
  attempt             integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
  output_format       text NOT NULL CHECK (output_format IN ('jcs')),
  input_sha256        text NOT NULL CHECK (input_sha256 ~ '^[0-9a-f]{64}$'),
  input_size          bigint NOT NULL CHECK (input_size >= 0),
  artifact_sha256     text CHECK (artifact_sha256 ~ '^[0-9a-f]{64}$'),
  artifact_size       bigint,
  terminal_error_code text,
  created_at          timestamptz NOT NULL DEFAULT now(),
  updated_at          timestamptz NOT NULL DEFAULT now(),
  completed_at        timestamptz,
  CHECK ((status = 'completed') = (artifact_sha256 IS NOT NULL AND completed_at IS NOT NULL)),
  CHECK (status NOT IN ('failed', 'compensated') OR terminal_error_code IS NOT NULL)
);

CREATE INDEX task_nonterminal_idx ON task (updated_at) WHERE status IN ('queued', 'running', 'compensating');

-- The submitted document, exactly as received (the JSON text of the
-- "document" member). Kept apart from task so that task updates stay small.
CREATE TABLE task_input (
  task_id  text PRIMARY KEY REFERENCES task (task_id),
  document bytea NOT NULL
);

-- Seed section 3. One row per (scope, key). The row is inserted in the same
-- transaction as the task and the outbox row, so the primary key decides
-- between concurrent first uses.
CREATE TABLE idempotency_record (
  scope               text NOT NULL,
  idempotency_key     text NOT NULL,
  request_fingerprint text NOT NULL CHECK (request_fingerprint ~ '^[0-9a-f]{64}$'),
  state               text NOT NULL CHECK (state IN ('in_progress', 'succeeded', 'failed_retryable', 'failed_final')),
  task_id             text REFERENCES task (task_id),
  response_status     integer,
  response_body       jsonb,
  locked_until        timestamptz,
  created_at          timestamptz NOT NULL DEFAULT now(),
  expires_at          timestamptz NOT NULL,
  PRIMARY KEY (scope, idempotency_key),
  CHECK (state <> 'succeeded' OR (task_id IS NOT NULL AND response_status IS NOT NULL AND response_body IS NOT NULL))
);

-- Seed section 4. The CDC relay tails INSERTs into this table through a
-- publication (inserts only) and a logical replication slot; published_at is
-- set only after Kafka acknowledged the record.
CREATE TABLE outbox_event (
  outbox_id         text PRIMARY KEY,
  aggregate_id      text NOT NULL,
  aggregate_version bigint NOT NULL,
  event_type        text NOT NULL CHECK (event_type IN ('TaskCreated', 'TaskCompleted', 'TaskFailed')),
  payload           jsonb NOT NULL,
  payload_sha256    text NOT NULL CHECK (payload_sha256 ~ '^[0-9a-f]{64}$'),
  created_at        timestamptz NOT NULL DEFAULT now(),
  published_at      timestamptz,
  publish_attempts  integer NOT NULL DEFAULT 0,
  last_error_code   text,
  UNIQUE (aggregate_id, aggregate_version, event_type)
);

CREATE INDEX outbox_event_unpublished_idx ON outbox_event (created_at) WHERE published_at IS NULL;

-- Seed section 6. (consumer_name, message_id) is the message identity; the
-- payload hash tells a duplicate from a protocol conflict.
CREATE TABLE inbox_message (
  consumer_name  text NOT NULL,
  message_id     text NOT NULL,
  payload_sha256 text NOT NULL,
  state          text NOT NULL CHECK (state IN ('processing', 'completed', 'failed')),
  result_json    jsonb,
  deliveries     integer NOT NULL DEFAULT 1 CHECK (deliveries >= 1),
  first_seen_at  timestamptz NOT NULL DEFAULT now(),
  last_seen_at   timestamptz NOT NULL DEFAULT now(),
  completed_at   timestamptz,
  PRIMARY KEY (consumer_name, message_id)
);

-- Same message identity, different payload hash (seed 6 and 13.4): never
-- processed, kept here for a person to inspect.
CREATE TABLE inbox_conflict (
  consumer_name   text NOT NULL,
  message_id      text NOT NULL,
  payload_sha256  text NOT NULL,
  stored_sha256   text NOT NULL,
  topic           text NOT NULL,
  kafka_partition integer NOT NULL,
  kafka_offset    bigint NOT NULL,
  seen_at         timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer_name, message_id, payload_sha256)
);

-- Seed section 7. One row per external effect, written before the effect is
-- attempted; (effect_kind, idempotency_token) is the effect's identity.
CREATE TABLE effect_ledger (
  effect_id              text PRIMARY KEY,
  task_id                text NOT NULL REFERENCES task (task_id),
  attempt                integer NOT NULL CHECK (attempt >= 1),
  effect_kind            text NOT NULL CHECK (effect_kind IN ('artifact.put', 'artifact.hide')),
  idempotency_token      text NOT NULL,
  target_identity        text NOT NULL,
  state                  text NOT NULL CHECK (state IN ('planned', 'started', 'unknown', 'completed', 'verified', 'compensation_required', 'compensated', 'failed')),
  request_sha256         text NOT NULL CHECK (request_sha256 ~ '^[0-9a-f]{64}$'),
  request_size           bigint NOT NULL CHECK (request_size >= 0),
  observed_result_sha256 text,
  error_code             text,
  created_at             timestamptz NOT NULL DEFAULT now(),
  updated_at             timestamptz NOT NULL DEFAULT now(),
  UNIQUE (effect_kind, idempotency_token)
);

CREATE INDEX effect_ledger_unresolved_idx ON effect_ledger (updated_at) WHERE state IN ('planned', 'started', 'unknown', 'compensation_required');
CREATE INDEX effect_ledger_task_idx ON effect_ledger (task_id);

-- +goose Down
DROP TABLE effect_ledger;
DROP TABLE inbox_conflict;
DROP TABLE inbox_message;
DROP TABLE outbox_event;
DROP TABLE idempotency_record;
DROP TABLE task_input;
DROP TABLE task;
