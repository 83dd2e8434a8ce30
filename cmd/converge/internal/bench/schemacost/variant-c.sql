-- Variant C: every CHECK constraint of the five hot tables dropped (the
-- lower bound; not a proposal). Written against migration 21.
ALTER TABLE task DROP CONSTRAINT task_version_check;
ALTER TABLE task DROP CONSTRAINT task_attempt_check;
ALTER TABLE task DROP CONSTRAINT task_output_format_check;
ALTER TABLE task DROP CONSTRAINT task_input_sha256_check;
ALTER TABLE task DROP CONSTRAINT task_input_size_check;
ALTER TABLE task DROP CONSTRAINT task_artifact_sha256_check;
ALTER TABLE task DROP CONSTRAINT task_check;
ALTER TABLE task DROP CONSTRAINT task_check1;
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_request_fingerprint_check;
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_state_check;
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_check;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_payload_sha256_check;
ALTER TABLE inbox_message DROP CONSTRAINT inbox_message_state_check;
ALTER TABLE inbox_message DROP CONSTRAINT inbox_message_deliveries_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_attempt_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_state_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_request_sha256_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_request_size_check;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_payload_json_check;
ALTER TABLE task DROP CONSTRAINT task_status_check;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_event_type_check;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_decision_check;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_decision_state_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_effect_kind_check;
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_id_is_token;
