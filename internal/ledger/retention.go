package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
)

// The retention of a whole task (issue 13, seed 3.3): its artifacts are
// removed from the store through the ledger — an artifact.delete effect per
// artifact.put, written before the file is removed, verified by observing
// the store hold nothing under the put's token — and only then the task's
// ledger rows go with the task (DeleteOfTask).

// UndeletedOf returns the artifact.put effects of the tasks of taskIDs
// whose object may be in the store (readable or hidden) and whose deletion
// is not verified yet: every put but the failed ones (a failed put never
// reached the store: its token was invalid), without a verified
// artifact.delete effect of token DeleteToken(put). One statement, ordered
// by task, then oldest attempt first.
func UndeletedOf(ctx context.Context, q dbpool.Querier, taskIDs []string) ([]Effect, error) {
	if len(taskIDs) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `
SELECT `+columns+` FROM effect_ledger p
WHERE p.task_id = ANY($1) AND p.effect_kind = 'artifact.put' AND p.state <> 'failed'
  AND NOT EXISTS (SELECT 1 FROM effect_ledger d
                  WHERE d.effect_id = 'delete-for-' || p.effect_id AND d.effect_kind = 'artifact.delete'
                    AND d.state = 'verified')
ORDER BY p.task_id, p.attempt, p.effect_id`, taskIDs)
	if err != nil {
		return nil, fmt.Errorf("select undeleted artifacts of %d tasks: %w", len(taskIDs), err)
	}
	effects, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Effect, error) { return scanEffect(row) })
	if err != nil {
		return nil, fmt.Errorf("read undeleted artifacts of %d tasks: %w", len(taskIDs), err)
	}
	return effects, nil
}

// Deletion is how the deletion of one artifact ended (DeleteArtifacts).
type Deletion struct {
	// DeleteID is the deletion's effect id (DeleteToken of the put).
	DeleteID string
	// Planned: this call wrote the deletion's ledger row.
	Planned bool
	// Verified: this call moved the deletion to verified (false: it was
	// verified already, or a concurrent call verified it).
	Verified bool
}

// DeleteArtifacts removes the object of each artifact.put effect of puts
// from the store for good (retention of their tasks): for each, the ledger
// row of kind artifact.delete with token DeleteToken(put.EffectID) is
// written first (NewDelete, state started); unless it is verified already,
// the store removes put's token (readable and hidden object; absent counts
// as done), the store is observed to hold nothing under it
// (artifact.Store.Gone), and the deletion moves started -> verified by
// compare-and-set. An error leaves a deletion started: the next call
// resumes it with the same token (removing an absent object again is
// harmless). Fault points (keys: task id): fault.RetentionAfterDeletePlanned
// after the ledger row, fault.RetentionAfterArtifactDelete after the
// removal.
//
// The ledger's writes and the store's fsyncs of all of them go together:
// the deletions' rows in one batch of statements (one implicit transaction
// outside a transaction), then the objects removed together
// (artifact.Store.DeleteMany) and each observed gone, then the verified
// ones moved to verified in one batch. It returns, for each put in its
// order, how its deletion ended and its own error (a put whose removal
// failed, or a fault point that fired for its task, is left started, and
// the next call resumes it with the same token; the others go on). When a
// batch of statements fails, its statements run again one by one, so that
// a put whose row cannot be written (its task removed meanwhile by another
// reconciler) fails alone.
func DeleteArtifacts(ctx context.Context, q dbpool.Querier, store *artifact.Store, faults *fault.Set, puts []Effect) (ds []Deletion, errs []error) {
	ds, errs = make([]Deletion, len(puts)), make([]error, len(puts))
	if len(puts) == 0 {
		return ds, errs
	}
	dels := make([]Effect, len(puts))
	b := &pgx.Batch{}
	for i, put := range puts {
		QueuePlan(b, NewDelete(put), &dels[i], &ds[i].Planned)
	}
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		// One put's row may fail the batch (its task removed meanwhile by
		// another reconciler: the foreign key): each is planned alone, so
		// that it fails alone.
		each(indexes(len(puts)), errs, err, func(i int) error {
			var err error
			dels[i], ds[i].Planned, err = Plan(ctx, q, NewDelete(puts[i]))
			if isForeignKeyViolation(err) {
				return fmt.Errorf("plan the deletion of artifact %s: %w", puts[i].Token, ErrTaskGone)
			}
			return err
		})
	}
	var todo []int // puts whose objects are removed now
	for i, put := range puts {
		if errs[i] != nil {
			continue
		}
		ds[i].DeleteID = dels[i].EffectID
		if dels[i].State == Verified {
			continue
		}
		if errs[i] = faults.ErrKey(fault.RetentionAfterDeletePlanned, put.TaskID); errs[i] == nil {
			todo = append(todo, i)
		}
	}
	tokens := make([]string, len(todo))
	for k, i := range todo {
		tokens[k] = puts[i].Token
	}
	b = &pgx.Batch{}
	var verifying []int // puts whose objects are observed gone
	for k, err := range store.DeleteMany(tokens) {
		i := todo[k]
		if err == nil {
			err = observeGone(store, faults, puts[i])
		}
		if errs[i] = err; err == nil {
			QueueMarkVerified(b, dels[i].EffectID, dels[i].State, nil, &ds[i].Verified)
			verifying = append(verifying, i)
		}
	}
	if b.Len() == 0 {
		return ds, errs
	}
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		// As for the plans: each alone, so that one fails alone.
		each(verifying, errs, err, func(i int) error {
			var err error
			if ds[i].Verified, err = MarkVerified(ctx, q, dels[i].EffectID, dels[i].State, nil); err != nil {
				return fmt.Errorf("verify the deletion of artifact %s: %w", puts[i].Token, err)
			}
			return nil
		})
	}
	return ds, errs
}

// ErrTaskGone: the deletion's ledger row could not be written because its
// task no longer exists (removed meanwhile by another reconciler, with
// everything of it): nothing is left to do.
var ErrTaskGone = errors.New("the task is gone")

// ErrNotTried marks a put of a batch that failed before its turn came: the
// batch's statements failed, then, run one by one, one failed for a reason
// that is not its own row's (the connection, the context), and the rest
// were not tried. Each is resumed by the next call.
var ErrNotTried = errors.New("not tried: the batch failed")

// each runs one(i) for every index of idx, after batchErr failed the batch
// that held them all, and records its error in errs[i]. It stops at the
// first error that is not the item's own (not a statement's error from
// PostgreSQL: a broken connection, a cancelled context), and marks the
// items after it ErrNotTried, so that an outage costs one attempt, not one
// per item.
func each(idx []int, errs []error, batchErr error, one func(i int) error) {
	var stop error
	if !dbpool.IsStatementError(batchErr) {
		stop = batchErr
	}
	for _, i := range idx {
		if stop != nil {
			errs[i] = fmt.Errorf("%w: %w", ErrNotTried, stop)
			continue
		}
		if errs[i] = one(i); errs[i] != nil && !dbpool.IsStatementError(errs[i]) && !errors.Is(errs[i], ErrTaskGone) {
			stop = errs[i]
		}
	}
}

// indexes is 0, 1, ..., n-1.
func indexes(n int) []int {
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	return idx
}

// isForeignKeyViolation reports whether err is PostgreSQL's
// foreign_key_violation (23503).
func isForeignKeyViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23503"
}

// observeGone observes that the store holds nothing under put's token
// after its removal, with the fault point of a crash between the two (key:
// task id).
func observeGone(store *artifact.Store, faults *fault.Set, put Effect) error {
	if err := faults.ErrKey(fault.RetentionAfterArtifactDelete, put.TaskID); err != nil {
		return err
	}
	gone, err := store.Gone(put.Token)
	if err != nil {
		return err
	}
	if !gone {
		return fmt.Errorf("artifact %s still in the store after its deletion", put.Token)
	}
	return nil
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

// DeleteOfTasks removes every effect of the tasks of taskIDs (their
// puts, hides and deletions) and returns how many, in one statement: the
// tasks' removal, once UndeletedOf is empty and every effect settled
// (task.Holds), in the transaction that removes the tasks.
func DeleteOfTasks(ctx context.Context, q dbpool.Querier, taskIDs []string) (int64, error) {
	if len(taskIDs) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, `DELETE FROM effect_ledger WHERE task_id = ANY($1)`, taskIDs)
	if err != nil {
		return 0, fmt.Errorf("delete effects of %d tasks: %w", len(taskIDs), err)
	}
	return tag.RowsAffected(), nil
}
