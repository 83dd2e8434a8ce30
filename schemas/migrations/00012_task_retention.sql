-- +goose Up
-- Issue 13, seed 3.3: task retention. After the task window
-- (CONVERGE_TASK_RETENTION, 30 days by default) the reconciler removes a
-- settled terminal task with its input, effects, outbox and inbox rows and
-- dead letters, and first its artifact files through the ledger: an
-- artifact.delete effect with its own token (ledger.DeleteToken), written
-- before the file is removed and verified by observing it gone.
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_effect_kind_check;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_effect_kind_check
  CHECK (effect_kind IN ('artifact.put', 'artifact.hide', 'artifact.delete'));

-- The retention scan's walk over terminal tasks, oldest update first, with
-- a (updated_at, task_id) cursor past the tasks it keeps. Partial: queued
-- and running tasks are not in it, so the create path writes no entry; a
-- task gets its entry when it becomes terminal (that UPDATE changes status,
-- which task_nonterminal_idx's predicate reads, so it is not a HOT update
-- already: one more index entry, no new round trip).
CREATE INDEX task_terminal_updated_idx ON task (updated_at, task_id)
  WHERE status IN ('completed', 'failed', 'compensated', 'cancelled');

-- +goose Down
DROP INDEX task_terminal_updated_idx;
-- The deletions' ledger rows cannot stay under the old constraint; their
-- objects are gone either way.
DELETE FROM effect_ledger WHERE effect_kind = 'artifact.delete';
ALTER TABLE effect_ledger DROP CONSTRAINT effect_ledger_effect_kind_check;
ALTER TABLE effect_ledger ADD CONSTRAINT effect_ledger_effect_kind_check
  CHECK (effect_kind IN ('artifact.put', 'artifact.hide'));
