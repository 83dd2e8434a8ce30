package ledger

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
)

// The retention of a whole task (issue 13, seed 3.3): its artifacts are
// removed from the store through the ledger — an artifact.delete effect per
// artifact.put, written before the file is removed, verified by observing
// the store hold nothing under the put's token — and only then the task's
// ledger rows go with the task (DeleteOfTask).

// Undeleted returns the task's artifact.put effects whose object may be in
// the store (readable or hidden) and whose deletion is not verified yet:
// every put but the failed ones (a failed put never reached the store: its
// token was invalid), without a verified artifact.delete effect of token
// DeleteToken(put). Oldest attempt first.
func Undeleted(ctx context.Context, q dbpool.Querier, taskID string) ([]Effect, error) {
	rows, err := q.Query(ctx, `
SELECT `+columns+` FROM effect_ledger p
WHERE p.task_id = $1 AND p.effect_kind = 'artifact.put' AND p.state <> 'failed'
  AND NOT EXISTS (SELECT 1 FROM effect_ledger d
                  WHERE d.effect_id = 'delete-for-' || p.effect_id AND d.effect_kind = 'artifact.delete'
                    AND d.state = 'verified')
ORDER BY p.attempt, p.effect_id`, taskID)
	if err != nil {
		return nil, fmt.Errorf("select undeleted artifacts of task %s: %w", taskID, err)
	}
	effects, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Effect, error) { return scanEffect(row) })
	if err != nil {
		return nil, fmt.Errorf("read undeleted artifacts of task %s: %w", taskID, err)
	}
	return effects, nil
}

// Deletion is how DeleteArtifact ended.
type Deletion struct {
	// DeleteID is the deletion's effect id (DeleteToken of the put).
	DeleteID string
	// Planned: this call wrote the deletion's ledger row.
	Planned bool
	// Verified: this call moved the deletion to verified (false: it was
	// verified already, or a concurrent call verified it).
	Verified bool
}

// DeleteArtifact removes the object of artifact.put effect put from the
// store for good (retention of its task): the ledger row of kind
// artifact.delete with token DeleteToken(put.EffectID) is written first
// (NewDelete, state started); unless it is verified already, the store
// removes put's token (artifact.Store.Delete: readable and hidden object;
// absent counts as done), the store is observed to hold nothing under it
// (artifact.Store.Gone), and the deletion moves started -> verified by
// compare-and-set. An error leaves the deletion started: the next call
// resumes it with the same token (removing an absent object again is
// harmless). Fault points (keys: task id): fault.RetentionAfterDeletePlanned
// after the ledger row, fault.RetentionAfterArtifactDelete after the
// removal.
func DeleteArtifact(ctx context.Context, q dbpool.Querier, store *artifact.Store, faults *fault.Set, put Effect) (Deletion, error) {
	var d Deletion
	del, planned, err := Plan(ctx, q, NewDelete(put))
	if err != nil {
		return d, err
	}
	d.DeleteID, d.Planned = del.EffectID, planned
	if del.State == Verified {
		return d, nil
	}
	if err := faults.ErrKey(fault.RetentionAfterDeletePlanned, put.TaskID); err != nil {
		return d, err
	}
	if err := store.Delete(put.Token); err != nil {
		return d, err
	}
	if err := faults.ErrKey(fault.RetentionAfterArtifactDelete, put.TaskID); err != nil {
		return d, err
	}
	gone, err := store.Gone(put.Token)
	if err != nil {
		return d, err
	}
	if !gone {
		return d, fmt.Errorf("artifact %s still in the store after its deletion", put.Token)
	}
	if d.Verified, err = MarkVerified(ctx, q, del.EffectID, del.State, nil); err != nil {
		return d, err
	}
	return d, nil
}

// ArtifactDeleted reports whether the object of the artifact.put of token
// putToken has a deletion recorded (an artifact.delete effect of token
// DeleteToken(put's effect id), in any state): the task is being removed
// by retention, and its artifact is gone or about to be (the API answers
// 410 ARTIFACT_EXPIRED). Two lookups of the primary key (an effect's id is
// its token: migration 00017).
func ArtifactDeleted(ctx context.Context, q dbpool.Querier, putToken string) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM effect_ledger p JOIN effect_ledger d
                 ON d.effect_id = 'delete-for-' || p.effect_id AND d.effect_kind = 'artifact.delete'
               WHERE p.effect_id = $1 AND p.effect_kind = 'artifact.put')`, putToken).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("read deletion of artifact %s: %w", putToken, err)
	}
	return ok, nil
}

// DeleteOfTask removes every effect of task taskID (its puts, hides and
// deletions) and returns how many: the task's removal, once Undeleted is
// empty and every effect settled (task.Hold), in the transaction that
// removes the task.
func DeleteOfTask(ctx context.Context, q dbpool.Querier, taskID string) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM effect_ledger WHERE task_id = $1`, taskID)
	if err != nil {
		return 0, fmt.Errorf("delete effects of task %s: %w", taskID, err)
	}
	return tag.RowsAffected(), nil
}
