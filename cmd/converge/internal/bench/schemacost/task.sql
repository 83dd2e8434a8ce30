-- One task's statements as converge sends them (statements and parameter
-- positions logged by `converge dev` at migration 21): the API's create
-- transaction in its two pipelines, the worker's intake and completion
-- transactions, each pipelined. One task per script run; ids from task_seq.
-- Values come from run.sh's -D variables (pgbench variables become
-- parameters under -M prepared, typed by the column they fill). :empty is
-- "x" because pgbench refuses an empty -D value: NULLIF(:empty, 'x') is the
-- NULL tenant that converge sends as NULLIF($n, '').
SELECT nextval('task_seq') AS n \gset
\set ttl 86400000
\set zero 0
\set one 1
\set two 2
\set size 1024
\set lock 30000
\startpipeline
BEGIN;
SELECT set_config('lock_timeout', :lockms, true);
INSERT INTO idempotency_record (scope, idempotency_key, request_fingerprint, state, task_id, response_status, response_body, created_at, expires_at) VALUES (:scope, 'doc-' || :n::text, :fp, 'succeeded', 'task-' || :n::text, 202, :body, now(), now() + :ttl * interval '1 millisecond') ON CONFLICT (scope, idempotency_key) DO NOTHING RETURNING created_at;
\endpipeline
\startpipeline
INSERT INTO task (task_id, tenant_id, request_fingerprint, status, version, attempt, output_format, input_sha256, input_size, created_at, updated_at) VALUES ('task-' || :n::text, NULLIF(:empty, 'x'), :fp, :queued, :zero, :zero, :jcs, :sha, :size, now(), now());
INSERT INTO task_input (task_id, document) VALUES ('task-' || :n::text, convert_to(repeat('{"a":1,"b":[1,2,3],"title":"hello"}', 30), 'UTF8'));
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, tenant_id) VALUES ('ev-c-' || :n::text, 'task-' || :n::text, :zero, :created, :p1, :sha, COALESCE(NULL, now()), NULLIF(:empty, 'x'));
COMMIT;
\endpipeline
\startpipeline
BEGIN;
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state, locked_by, locked_until) VALUES (:consumer, 'ev-c-' || :n::text, :sha, 'processing', :lockedby, now() + :lock::bigint * interval '1 millisecond') ON CONFLICT (consumer_name, message_id) DO NOTHING;
UPDATE task SET status = 'running', version = version + 1, attempt = attempt + 1, updated_at = now() WHERE task_id = 'task-' || :n::text AND status = 'queued' AND version >= :zero RETURNING task_id, COALESCE(tenant_id, ''), status, version, attempt, output_format, input_sha256, input_size, artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at, (SELECT document FROM task_input WHERE task_input.task_id = task.task_id);
SELECT effect_id, attempt, idempotency_token, state FROM effect_ledger WHERE task_id = 'task-' || :n::text AND effect_kind = 'artifact.put' AND state IN ('planned', 'started', 'unknown', 'completed', 'verified') ORDER BY state = 'verified' DESC, attempt DESC LIMIT 1;
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size) VALUES ('task-' || :n::text || '.attempt-1', 'task-' || :n::text, :one, :put, 'task-' || :n::text || '.attempt-1', 'artifact://task-' || :n::text || '.attempt-1', :started, :sha, :size) ON CONFLICT DO NOTHING;
SELECT effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size, observed_result_sha256, error_code, updated_at FROM effect_ledger WHERE effect_id = 'task-' || :n::text || '.attempt-1' AND effect_kind = :put;
COMMIT;
\endpipeline
\startpipeline
BEGIN;
UPDATE inbox_message SET state = :completed, result_json = :result::jsonb, completed_at = now(), last_seen_at = now() WHERE consumer_name = :consumer AND message_id = 'ev-c-' || :n::text AND state = 'processing';
UPDATE task SET status = 'completed', version = version + 1, artifact_sha256 = :sha, artifact_size = :size, completed_at = now(), updated_at = now() WHERE task_id = 'task-' || :n::text AND status = 'running' AND version = :one RETURNING task_id, COALESCE(tenant_id, ''), status, version, attempt, output_format, input_sha256, input_size, artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at;
UPDATE effect_ledger SET state = :verified, observed_result_sha256 = COALESCE(:sha, observed_result_sha256), error_code = COALESCE(NULL, error_code), updated_at = now() WHERE effect_id = 'task-' || :n::text || '.attempt-1' AND state = :started;
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256, created_at, tenant_id) VALUES ('ev-d-' || :n::text, 'task-' || :n::text, :two, :completedev, :p2, :sha, COALESCE(NULL, now()), NULLIF(:empty, 'x'));
COMMIT;
\endpipeline
