-- +goose Up
-- At most one verified artifact.put effect per task (seed 7, 17: one
-- verified artifact per task). The constraint, not a prior SELECT, decides:
-- an effect of another attempt found matching in the store after one is
-- verified (a replayed task, an effect resolved late by the reconciler)
-- cannot become verified too; the reconciler marks it
-- compensation_required (ARTIFACT_SUPERSEDED) and hides its object, and the
-- worker completes the task with the verified one.
CREATE UNIQUE INDEX effect_ledger_one_verified_put_idx ON effect_ledger (task_id)
  WHERE effect_kind = 'artifact.put' AND state = 'verified';

-- +goose Down
DROP INDEX effect_ledger_one_verified_put_idx;
