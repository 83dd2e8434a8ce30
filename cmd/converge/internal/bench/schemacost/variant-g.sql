-- Variant G: the single-column CHECK constraints as domains (the same
-- predicates on the columns' types); the five checks that name two columns
-- or more stay on their tables. Written against migration 21. The ALTERs
-- rewrite the tables (a domain with constraints), fine on the empty tables
-- of this measurement.
CREATE DOMAIN sha256_hex AS text CHECK (VALUE ~ '^[0-9a-f]{64}$');
CREATE DOMAIN task_status AS text CHECK (VALUE IN ('queued', 'running', 'completed', 'failed', 'compensating', 'compensated', 'cancelled'));
CREATE DOMAIN output_format AS text CHECK (VALUE = 'jcs');
CREATE DOMAIN nonnegative_bigint AS bigint CHECK (VALUE >= 0);
CREATE DOMAIN nonnegative_integer AS integer CHECK (VALUE >= 0);
CREATE DOMAIN positive_integer AS integer CHECK (VALUE >= 1);
CREATE DOMAIN task_version AS bigint CHECK (VALUE >= 0 AND VALUE < 9007199254740992);
CREATE DOMAIN idempotency_state AS text CHECK (VALUE IN ('in_progress', 'succeeded', 'failed_retryable', 'failed_final'));
CREATE DOMAIN outbox_event_type AS text CHECK (VALUE IN ('TaskCreated', 'TaskCompleted', 'TaskFailed', 'TaskRedriveRequested', 'TaskCancelled'));
CREATE DOMAIN outbox_decision AS text CHECK (VALUE IN ('republished', 'discarded'));
CREATE DOMAIN json_text AS text CHECK (VALUE::jsonb IS NOT NULL);
CREATE DOMAIN inbox_state AS text CHECK (VALUE IN ('processing', 'completed', 'failed'));
CREATE DOMAIN effect_kind AS text CHECK (VALUE IN ('artifact.put', 'artifact.hide', 'artifact.delete'));
CREATE DOMAIN effect_state AS text CHECK (VALUE IN ('planned', 'started', 'unknown', 'completed', 'verified', 'compensation_required', 'compensated', 'failed'));
ALTER TABLE task DROP CONSTRAINT task_artifact_sha256_check, DROP CONSTRAINT task_attempt_check, DROP CONSTRAINT task_input_sha256_check, DROP CONSTRAINT task_input_size_check, DROP CONSTRAINT task_output_format_check, DROP CONSTRAINT task_status_check, DROP CONSTRAINT task_version_check,
  ALTER COLUMN artifact_sha256 TYPE sha256_hex, ALTER COLUMN input_sha256 TYPE sha256_hex, ALTER COLUMN attempt TYPE nonnegative_integer, ALTER COLUMN input_size TYPE nonnegative_bigint, ALTER COLUMN output_format TYPE output_format, ALTER COLUMN status TYPE task_status, ALTER COLUMN version TYPE task_version;
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_request_fingerprint_check, DROP CONSTRAINT idempotency_record_state_check,
  ALTER COLUMN request_fingerprint TYPE sha256_hex, ALTER COLUMN state TYPE idempotency_state;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_decision_check, DROP CONSTRAINT outbox_event_event_type_check, DROP CONSTRAINT outbox_event_payload_json_check, DROP CONSTRAINT outbox_event_payload_sha256_check,
  ALTER COLUMN decision TYPE outbox_decision, ALTER COLUMN event_type TYPE outbox_event_type, ALTER COLUMN payload TYPE json_text, ALTER COLUMN payload_sha256 TYPE sha256_hex;
ALTER TABLE inbox_message DROP CONSTRAINT inbox_message_deliveries_check, DROP CONSTRAINT inbox_message_state_check,
  ALTER COLUMN deliveries TYPE positive_integer, ALTER COLUMN state TYPE inbox_state;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_attempt_check, DROP CONSTRAINT effect_ledger_effect_kind_check, DROP CONSTRAINT effect_ledger_request_sha256_check, DROP CONSTRAINT effect_ledger_request_size_check, DROP CONSTRAINT effect_ledger_state_check,
  ALTER COLUMN attempt TYPE positive_integer, ALTER COLUMN effect_kind TYPE effect_kind, ALTER COLUMN request_sha256 TYPE sha256_hex, ALTER COLUMN request_size TYPE nonnegative_bigint, ALTER COLUMN state TYPE effect_state;
