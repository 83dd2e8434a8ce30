-- Variant R: each table's CHECK constraints as one CHECK calling a PL/pgSQL
-- function that holds the same rules and keeps their names: its first IF
-- is every rule AND-ed (one expression per row); when that is false, the
-- rule that is false raises check_violation naming the constraint it
-- replaced, with PostgreSQL's message. Drafted as migration 00022 on
-- 2026-12-07 and not landed (BENCHMARKS.md, that day's item 2). Written
-- against migration 21.
CREATE OR REPLACE FUNCTION task_rules(
  status text,
  version bigint,
  attempt integer,
  output_format text,
  input_sha256 text,
  input_size bigint,
  artifact_sha256 text,
  terminal_error_code text,
  completed_at timestamptz
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  -- Every row: the rules below AND-ed, one expression (NULL passes, as
  -- in a CHECK). The draft's test that kept the two in step was removed with it.
  IF (
    (artifact_sha256 ~ '^[0-9a-f]{64}$')
    AND (attempt >= 0)
    AND ((status = 'completed') = ((artifact_sha256 IS NOT NULL) AND (completed_at IS NOT NULL)))
    AND ((status <> ALL (ARRAY['failed', 'compensated'])) OR (terminal_error_code IS NOT NULL))
    AND (input_sha256 ~ '^[0-9a-f]{64}$')
    AND (input_size >= 0)
    AND (output_format = 'jcs')
    AND (status = ANY (ARRAY['queued', 'running', 'completed', 'failed', 'compensating', 'compensated', 'cancelled']))
    AND ((version >= 0) AND (version < '9007199254740992'::bigint))
  ) IS NOT FALSE THEN
    RETURN true;
  END IF;
  -- A rule is false: raise as its CHECK constraint did.
  IF (artifact_sha256 ~ '^[0-9a-f]{64}$') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_artifact_sha256_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_artifact_sha256_check"';
  END IF;
  IF (attempt >= 0) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_attempt_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_attempt_check"';
  END IF;
  IF ((status = 'completed') = ((artifact_sha256 IS NOT NULL) AND (completed_at IS NOT NULL))) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_check"';
  END IF;
  IF ((status <> ALL (ARRAY['failed', 'compensated'])) OR (terminal_error_code IS NOT NULL)) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_check1',
      MESSAGE = 'new row for relation "task" violates check constraint "task_check1"';
  END IF;
  IF (input_sha256 ~ '^[0-9a-f]{64}$') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_input_sha256_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_input_sha256_check"';
  END IF;
  IF (input_size >= 0) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_input_size_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_input_size_check"';
  END IF;
  IF (output_format = 'jcs') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_output_format_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_output_format_check"';
  END IF;
  IF (status = ANY (ARRAY['queued', 'running', 'completed', 'failed', 'compensating', 'compensated', 'cancelled'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_status_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_status_check"';
  END IF;
  IF ((version >= 0) AND (version < '9007199254740992'::bigint)) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'task', CONSTRAINT = 'task_version_check',
      MESSAGE = 'new row for relation "task" violates check constraint "task_version_check"';
  END IF;
  RETURN false;
END
$$;
ALTER TABLE task DROP CONSTRAINT IF EXISTS task_rules_check;
ALTER TABLE task ADD CONSTRAINT task_rules_check CHECK (task_rules(status, version, attempt, output_format, input_sha256, input_size, artifact_sha256, terminal_error_code, completed_at)) NOT VALID;
ALTER TABLE task VALIDATE CONSTRAINT task_rules_check;
ALTER TABLE task
  DROP CONSTRAINT IF EXISTS task_artifact_sha256_check,
  DROP CONSTRAINT IF EXISTS task_attempt_check,
  DROP CONSTRAINT IF EXISTS task_check,
  DROP CONSTRAINT IF EXISTS task_check1,
  DROP CONSTRAINT IF EXISTS task_input_sha256_check,
  DROP CONSTRAINT IF EXISTS task_input_size_check,
  DROP CONSTRAINT IF EXISTS task_output_format_check,
  DROP CONSTRAINT IF EXISTS task_status_check,
  DROP CONSTRAINT IF EXISTS task_version_check;

CREATE OR REPLACE FUNCTION idempotency_record_rules(
  request_fingerprint text,
  state text,
  task_id text,
  response_status integer,
  response_body jsonb
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  -- Every row: the rules below AND-ed, one expression (NULL passes, as
  -- in a CHECK). The draft's test that kept the two in step was removed with it.
  IF (
    ((state <> 'succeeded') OR ((task_id IS NOT NULL) AND (response_status IS NOT NULL) AND (response_body IS NOT NULL)))
    AND (request_fingerprint ~ '^[0-9a-f]{64}$')
    AND (state = ANY (ARRAY['in_progress', 'succeeded', 'failed_retryable', 'failed_final']))
  ) IS NOT FALSE THEN
    RETURN true;
  END IF;
  -- A rule is false: raise as its CHECK constraint did.
  IF ((state <> 'succeeded') OR ((task_id IS NOT NULL) AND (response_status IS NOT NULL) AND (response_body IS NOT NULL))) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'idempotency_record', CONSTRAINT = 'idempotency_record_check',
      MESSAGE = 'new row for relation "idempotency_record" violates check constraint "idempotency_record_check"';
  END IF;
  IF (request_fingerprint ~ '^[0-9a-f]{64}$') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'idempotency_record', CONSTRAINT = 'idempotency_record_request_fingerprint_check',
      MESSAGE = 'new row for relation "idempotency_record" violates check constraint "idempotency_record_request_fingerprint_check"';
  END IF;
  IF (state = ANY (ARRAY['in_progress', 'succeeded', 'failed_retryable', 'failed_final'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'idempotency_record', CONSTRAINT = 'idempotency_record_state_check',
      MESSAGE = 'new row for relation "idempotency_record" violates check constraint "idempotency_record_state_check"';
  END IF;
  RETURN false;
END
$$;
ALTER TABLE idempotency_record DROP CONSTRAINT IF EXISTS idempotency_record_rules_check;
ALTER TABLE idempotency_record ADD CONSTRAINT idempotency_record_rules_check CHECK (idempotency_record_rules(request_fingerprint, state, task_id, response_status, response_body)) NOT VALID;
ALTER TABLE idempotency_record VALIDATE CONSTRAINT idempotency_record_rules_check;
ALTER TABLE idempotency_record
  DROP CONSTRAINT IF EXISTS idempotency_record_check,
  DROP CONSTRAINT IF EXISTS idempotency_record_request_fingerprint_check,
  DROP CONSTRAINT IF EXISTS idempotency_record_state_check;

CREATE OR REPLACE FUNCTION outbox_event_rules(
  event_type text,
  payload text,
  payload_sha256 text,
  parked_at timestamptz,
  decision text,
  decided_at timestamptz
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  -- Every row: the rules below AND-ed, one expression (NULL passes, as
  -- in a CHECK). The draft's test that kept the two in step was removed with it.
  IF (
    (decision = ANY (ARRAY['republished', 'discarded']))
    AND (((decision IS NULL) = (decided_at IS NULL)) AND ((decision IS NULL) OR (parked_at IS NOT NULL)))
    AND (event_type = ANY (ARRAY['TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested', 'TaskCancelled']))
    AND ((payload)::jsonb IS NOT NULL)
    AND (payload_sha256 ~ '^[0-9a-f]{64}$')
  ) IS NOT FALSE THEN
    RETURN true;
  END IF;
  -- A rule is false: raise as its CHECK constraint did.
  IF (decision = ANY (ARRAY['republished', 'discarded'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'outbox_event', CONSTRAINT = 'outbox_event_decision_check',
      MESSAGE = 'new row for relation "outbox_event" violates check constraint "outbox_event_decision_check"';
  END IF;
  IF (((decision IS NULL) = (decided_at IS NULL)) AND ((decision IS NULL) OR (parked_at IS NOT NULL))) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'outbox_event', CONSTRAINT = 'outbox_event_decision_state_check',
      MESSAGE = 'new row for relation "outbox_event" violates check constraint "outbox_event_decision_state_check"';
  END IF;
  IF (event_type = ANY (ARRAY['TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested', 'TaskCancelled'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'outbox_event', CONSTRAINT = 'outbox_event_event_type_check',
      MESSAGE = 'new row for relation "outbox_event" violates check constraint "outbox_event_event_type_check"';
  END IF;
  IF ((payload)::jsonb IS NOT NULL) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'outbox_event', CONSTRAINT = 'outbox_event_payload_json_check',
      MESSAGE = 'new row for relation "outbox_event" violates check constraint "outbox_event_payload_json_check"';
  END IF;
  IF (payload_sha256 ~ '^[0-9a-f]{64}$') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'outbox_event', CONSTRAINT = 'outbox_event_payload_sha256_check',
      MESSAGE = 'new row for relation "outbox_event" violates check constraint "outbox_event_payload_sha256_check"';
  END IF;
  RETURN false;
END
$$;
ALTER TABLE outbox_event DROP CONSTRAINT IF EXISTS outbox_event_rules_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_rules_check CHECK (outbox_event_rules(event_type, payload, payload_sha256, parked_at, decision, decided_at)) NOT VALID;
ALTER TABLE outbox_event VALIDATE CONSTRAINT outbox_event_rules_check;
ALTER TABLE outbox_event
  DROP CONSTRAINT IF EXISTS outbox_event_decision_check,
  DROP CONSTRAINT IF EXISTS outbox_event_decision_state_check,
  DROP CONSTRAINT IF EXISTS outbox_event_event_type_check,
  DROP CONSTRAINT IF EXISTS outbox_event_payload_json_check,
  DROP CONSTRAINT IF EXISTS outbox_event_payload_sha256_check;

CREATE OR REPLACE FUNCTION inbox_message_rules(
  state text,
  deliveries integer
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  -- Every row: the rules below AND-ed, one expression (NULL passes, as
  -- in a CHECK). The draft's test that kept the two in step was removed with it.
  IF (
    (deliveries >= 1)
    AND (state = ANY (ARRAY['processing', 'completed', 'failed']))
  ) IS NOT FALSE THEN
    RETURN true;
  END IF;
  -- A rule is false: raise as its CHECK constraint did.
  IF (deliveries >= 1) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'inbox_message', CONSTRAINT = 'inbox_message_deliveries_check',
      MESSAGE = 'new row for relation "inbox_message" violates check constraint "inbox_message_deliveries_check"';
  END IF;
  IF (state = ANY (ARRAY['processing', 'completed', 'failed'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'inbox_message', CONSTRAINT = 'inbox_message_state_check',
      MESSAGE = 'new row for relation "inbox_message" violates check constraint "inbox_message_state_check"';
  END IF;
  RETURN false;
END
$$;
ALTER TABLE inbox_message DROP CONSTRAINT IF EXISTS inbox_message_rules_check;
ALTER TABLE inbox_message ADD CONSTRAINT inbox_message_rules_check CHECK (inbox_message_rules(state, deliveries)) NOT VALID;
ALTER TABLE inbox_message VALIDATE CONSTRAINT inbox_message_rules_check;
ALTER TABLE inbox_message
  DROP CONSTRAINT IF EXISTS inbox_message_deliveries_check,
  DROP CONSTRAINT IF EXISTS inbox_message_state_check;

CREATE OR REPLACE FUNCTION effect_ledger_rules(
  effect_id text,
  attempt integer,
  effect_kind text,
  idempotency_token text,
  state text,
  request_sha256 text,
  request_size bigint
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  -- Every row: the rules below AND-ed, one expression (NULL passes, as
  -- in a CHECK). The draft's test that kept the two in step was removed with it.
  IF (
    (attempt >= 1)
    AND (effect_kind = ANY (ARRAY['artifact.put', 'artifact.hide', 'artifact.delete']))
    AND (effect_id = idempotency_token)
    AND (request_sha256 ~ '^[0-9a-f]{64}$')
    AND (request_size >= 0)
    AND (state = ANY (ARRAY['planned', 'started', 'unknown', 'completed', 'verified', 'compensation_required', 'compensated', 'failed']))
  ) IS NOT FALSE THEN
    RETURN true;
  END IF;
  -- A rule is false: raise as its CHECK constraint did.
  IF (attempt >= 1) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_attempt_check',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_attempt_check"';
  END IF;
  IF (effect_kind = ANY (ARRAY['artifact.put', 'artifact.hide', 'artifact.delete'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_effect_kind_check',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_effect_kind_check"';
  END IF;
  IF (effect_id = idempotency_token) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_id_is_token',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_id_is_token"';
  END IF;
  IF (request_sha256 ~ '^[0-9a-f]{64}$') IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_request_sha256_check',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_request_sha256_check"';
  END IF;
  IF (request_size >= 0) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_request_size_check',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_request_size_check"';
  END IF;
  IF (state = ANY (ARRAY['planned', 'started', 'unknown', 'completed', 'verified', 'compensation_required', 'compensated', 'failed'])) IS FALSE THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', TABLE = 'effect_ledger', CONSTRAINT = 'effect_ledger_state_check',
      MESSAGE = 'new row for relation "effect_ledger" violates check constraint "effect_ledger_state_check"';
  END IF;
  RETURN false;
END
$$;
ALTER TABLE effect_ledger DROP CONSTRAINT IF EXISTS effect_ledger_rules_check;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_rules_check CHECK (effect_ledger_rules(effect_id, attempt, effect_kind, idempotency_token, state, request_sha256, request_size)) NOT VALID;
ALTER TABLE effect_ledger VALIDATE CONSTRAINT effect_ledger_rules_check;
ALTER TABLE effect_ledger
  DROP CONSTRAINT IF EXISTS effect_ledger_attempt_check,
  DROP CONSTRAINT IF EXISTS effect_ledger_effect_kind_check,
  DROP CONSTRAINT IF EXISTS effect_ledger_id_is_token,
  DROP CONSTRAINT IF EXISTS effect_ledger_request_sha256_check,
  DROP CONSTRAINT IF EXISTS effect_ledger_request_size_check,
  DROP CONSTRAINT IF EXISTS effect_ledger_state_check;

