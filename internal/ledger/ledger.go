package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
)

// Kind is effect_ledger.effect_kind.
type Kind string

// The effect kinds.
const (
	// KindArtifactPut writes a task attempt's artifact to the store.
	KindArtifactPut Kind = "artifact.put"
	// KindArtifactHide hides an artifact that must not be served: the
	// compensation of an artifact.put (seed 8).
	KindArtifactHide Kind = "artifact.hide"
	// KindArtifactDelete removes an artifact.put's object (readable or
	// hidden) for good: the retention of a whole task (issue 13, seed 3.3;
	// DeleteArtifacts).
	KindArtifactDelete Kind = "artifact.delete"
)

// State is effect_ledger.state (seed 7).
type State string

// The effect states.
const (
	Planned              State = "planned"
	Started              State = "started"
	Unknown              State = "unknown"
	Completed            State = "completed"
	Verified             State = "verified"
	CompensationRequired State = "compensation_required"
	Compensated          State = "compensated"
	Failed               State = "failed"
)

// Settled reports whether the effect's outcome is known and final: verified,
// compensated or failed. planned, started, unknown and completed are not
// known to be done; compensation_required waits for its compensation.
func (s State) Settled() bool { return s == Verified || s == Compensated || s == Failed }

// Stable error codes recorded in effect_ledger.error_code.
const (
	// CodeVerificationFailed: the object read back does not match the
	// effect's request (task id, attempt, size, SHA-256; seed 7.1).
	CodeVerificationFailed = "ARTIFACT_VERIFICATION_FAILED"
	// CodeSuperseded: the object matched, but another artifact.put of the
	// task is verified (at most one may be): compensated.
	CodeSuperseded = "ARTIFACT_SUPERSEDED"
)

// Effect is an effect_ledger row.
type Effect struct {
	EffectID       string
	TaskID         string
	Attempt        int
	Kind           Kind
	Token          string // the idempotency token: the store key
	TargetIdentity string
	State          State
	RequestSHA256  string
	RequestSize    int64 // bytes
	ObservedSHA256 *string
	ErrorCode      *string
	UpdatedAt      time.Time
}

// PutToken is the token of the artifact.put of a task attempt (the artifact
// store key, artifact.Token): the same task and attempt always give the same
// token, so a retried write lands on the same object (seed 7).
func PutToken(taskID string, attempt int) string { return artifact.Token(taskID, attempt) }

// CompensationToken is the token (and effect id) of the compensation of
// effect effectID: "compensation-for-<effect_id>" (seed 8).
func CompensationToken(effectID string) string { return "compensation-for-" + effectID }

// DeleteToken is the token (and effect id) of the deletion of the object of
// artifact.put effect putEffectID: "delete-for-<effect_id>" (retention,
// DeleteArtifacts). One put, one deletion token, whoever computes it.
func DeleteToken(putEffectID string) string { return "delete-for-" + putEffectID }

// NewPut is the ledger row of the artifact.put of a task attempt whose
// artifact (the request) has the given SHA-256 and size, in state started:
// written before the store is called (seed 7).
func NewPut(taskID string, attempt int, requestSHA256 string, requestSize int64) Effect {
	token := PutToken(taskID, attempt)
	return Effect{EffectID: token, TaskID: taskID, Attempt: attempt, Kind: KindArtifactPut, Token: token,
		TargetIdentity: "artifact://" + token, State: Started, RequestSHA256: requestSHA256, RequestSize: requestSize}
}

// NewCompensation is the ledger row of the compensation of e: kind
// artifact.hide, token CompensationToken(e.EffectID), same target, the
// request being the object as observed (SHA-256 and size), state started.
func NewCompensation(e Effect, observedSHA256 string, observedSize int64) Effect {
	token := CompensationToken(e.EffectID)
	return Effect{EffectID: token, TaskID: e.TaskID, Attempt: e.Attempt, Kind: KindArtifactHide, Token: token,
		TargetIdentity: e.TargetIdentity, State: Started, RequestSHA256: observedSHA256, RequestSize: observedSize}
}

// NewDelete is the ledger row of the deletion of put's object: kind
// artifact.delete, token DeleteToken(put.EffectID), same task, attempt and
// target, the request being the object the put wrote (its request SHA-256
// and size), state started: written before the store is called (seed 7).
func NewDelete(put Effect) Effect {
	token := DeleteToken(put.EffectID)
	return Effect{EffectID: token, TaskID: put.TaskID, Attempt: put.Attempt, Kind: KindArtifactDelete, Token: token,
		TargetIdentity: put.TargetIdentity, State: Started, RequestSHA256: put.RequestSHA256, RequestSize: put.RequestSize}
}

// Columns are the effect columns scanEffect reads, in its order.
const columns = `effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state,
request_sha256, request_size, observed_result_sha256, error_code, updated_at`

func scanEffect(row pgx.Row) (Effect, error) {
	var e Effect
	err := row.Scan(&e.EffectID, &e.TaskID, &e.Attempt, &e.Kind, &e.Token, &e.TargetIdentity, &e.State,
		&e.RequestSHA256, &e.RequestSize, &e.ObservedSHA256, &e.ErrorCode, &e.UpdatedAt)
	return e, err
}

// Get reads the effect of identity (kind, token); found is false when it is
// not recorded.
func Get(ctx context.Context, q dbpool.Querier, kind Kind, token string) (e Effect, found bool, err error) {
	e, err = scanEffect(q.QueryRow(ctx, `SELECT `+columns+` FROM effect_ledger WHERE effect_id = $2 AND effect_kind = $1`, kind, token))
	if errors.Is(err, pgx.ErrNoRows) {
		return e, false, nil
	}
	if err != nil {
		return e, false, fmt.Errorf("read effect %s %s: %w", kind, token, err)
	}
	return e, true, nil
}

// Plan writes the ledger row of an effect before the effect is attempted
// (seed 7) unless its identity (kind, token) is recorded already, and
// returns the row as stored and whether this call inserted it. One round
// trip: the insert and the read go in one batch.
func Plan(ctx context.Context, q dbpool.Querier, e Effect) (stored Effect, planned bool, err error) {
	b := &pgx.Batch{}
	QueuePlan(b, e, &stored, &planned)
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		return e, false, fmt.Errorf("plan effect %s: %w", e.EffectID, err)
	}
	return stored, planned, nil
}

// sqlPlanInsert is Plan's insert of an effect's row ($1..$9: effect id,
// task id, attempt, kind, token, target, state, request SHA-256 and size).
// Its ON CONFLICT names no index: a concurrent insert of the same identity
// (two compensations racing) must find the row recorded whichever unique
// index reports it. Since migration 00019 that is the primary key alone
// (effect_id, which 00017's CHECK makes the token); before, UNIQUE
// (effect_kind, idempotency_token) could report it too, and with one index
// named the other raised 23505. Plans insert started rows only, so the
// partial OneVerifiedIndex never reports a conflict here.
const sqlPlanInsert = `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT DO NOTHING`

// QueuePlan queues Plan's insert and read on b; stored and planned are set
// when the batch's results are read.
func QueuePlan(b *pgx.Batch, e Effect, stored *Effect, planned *bool) {
	b.Queue(sqlPlanInsert,
		e.EffectID, e.TaskID, e.Attempt, e.Kind, e.Token, e.TargetIdentity, e.State, e.RequestSHA256, e.RequestSize).
		Exec(func(tag pgconn.CommandTag) error { *planned = tag.RowsAffected() == 1; return nil })
	b.Queue(`SELECT `+columns+` FROM effect_ledger WHERE effect_id = $2 AND effect_kind = $1`, e.Kind, e.Token).
		QueryRow(func(row pgx.Row) error {
			var err error
			if *stored, err = scanEffect(row); err != nil {
				return fmt.Errorf("read effect %s: %w", e.EffectID, err)
			}
			return nil
		})
}

// QueuePlanNew queues on b the insert of e's ledger row unless its
// identity (kind, token) is recorded: Plan's insert, returning the row
// (one statement where Plan takes two). planned is set when the batch's
// results are read: true when this call inserted the row, which stored then
// holds as written; false, stored untouched, when the identity was recorded
// (the caller reads it with Plan or Get). The worker's batch path plans the
// put of a task's first attempt with it: no other put effect of the task
// can exist then (see consumers/worker, batch.go).
func QueuePlanNew(b *pgx.Batch, e Effect, stored *Effect, planned *bool) {
	b.Queue(sqlPlanInsert+`
RETURNING `+columns,
		e.EffectID, e.TaskID, e.Attempt, e.Kind, e.Token, e.TargetIdentity, e.State, e.RequestSHA256, e.RequestSize).
		QueryRow(func(row pgx.Row) error {
			eff, err := scanEffect(row)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				*planned = false
				return nil
			case err != nil:
				return fmt.Errorf("plan effect %s: %w", e.EffectID, err)
			}
			*stored, *planned = eff, true
			return nil
		})
}

// Transitions. Each is a compare-and-set on the state the caller read
// (from): it reports false, changing nothing, when the effect moved since —
// a repair computed from a stale read never undoes newer progress (DESIGN.md,
// River's rescuer bug).

const sqlTransition = `
UPDATE effect_ledger SET state = $3,
  observed_result_sha256 = COALESCE($4, observed_result_sha256),
  error_code = COALESCE($5, error_code),
  updated_at = now()
WHERE effect_id = $1 AND state = $2`

func transition(ctx context.Context, q dbpool.Querier, id string, from, to State, observed, code *string) (bool, error) {
	tag, err := q.Exec(ctx, sqlTransition, id, from, to, observed, code)
	if err != nil {
		return false, fmt.Errorf("effect %s %s -> %s: %w", id, from, to, err)
	}
	return tag.RowsAffected() == 1, nil
}

// MarkUnknown records that the store did not confirm the write in time
// (from -> unknown): the outcome is resolved by observing the same token,
// never by a new one (seed 7).
func MarkUnknown(ctx context.Context, q dbpool.Querier, id string, from State) (bool, error) {
	return transition(ctx, q, id, from, Unknown, nil, nil)
}

// MarkPlanned records that an effect whose outcome was not known did not
// happen (the object is absent): from -> planned, safe to retry with the
// same token.
func MarkPlanned(ctx context.Context, q dbpool.Querier, id string, from State) (bool, error) {
	return transition(ctx, q, id, from, Planned, nil, nil)
}

// MarkVerified records the read-back of the effect's object as matching its
// request (Verify): from -> verified with the observed SHA-256. For an
// artifact.put it fails with an error OneVerifiedViolation reports when
// another artifact.put of the task is verified.
func MarkVerified(ctx context.Context, q dbpool.Querier, id string, from State, observedSHA256 *string) (bool, error) {
	return transition(ctx, q, id, from, Verified, observedSHA256, nil)
}

// QueueMarkVerified queues MarkVerified on b; applied is set when the
// batch's results are read.
func QueueMarkVerified(b *pgx.Batch, id string, from State, observedSHA256 *string, applied *bool) {
	b.Queue(sqlTransition, id, from, Verified, observedSHA256, (*string)(nil)).Exec(func(tag pgconn.CommandTag) error {
		*applied = tag.RowsAffected() == 1
		return nil
	})
}

// RequireCompensation records that the effect's object must be undone
// (from -> compensation_required) with the observed SHA-256 and a code
// (CodeVerificationFailed, CodeSuperseded).
func RequireCompensation(ctx context.Context, q dbpool.Querier, id string, from State, observedSHA256 *string, code string) (bool, error) {
	return transition(ctx, q, id, from, CompensationRequired, observedSHA256, &code)
}

// MarkFailed records that the effect cannot happen (from -> failed) with a
// code (an invalid token).
func MarkFailed(ctx context.Context, q dbpool.Querier, id string, from State, code string) (bool, error) {
	return transition(ctx, q, id, from, Failed, nil, &code)
}

// MarkCompensated records that the compensation of the effect is verified
// (compensation_required -> compensated).
func MarkCompensated(ctx context.Context, q dbpool.Querier, id string) (bool, error) {
	return transition(ctx, q, id, CompensationRequired, Compensated, nil, nil)
}

// OneVerifiedIndex is the partial unique index that allows at most one
// verified artifact.put effect per task (migration 00003).
const OneVerifiedIndex = "effect_ledger_one_verified_put_idx"

// OneVerifiedViolation reports whether err violates OneVerifiedIndex:
// another artifact.put effect of the task is verified.
func OneVerifiedViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == OneVerifiedIndex
}

const sqlLive = `
SELECT effect_id, attempt, idempotency_token, state FROM effect_ledger
WHERE task_id = $1 AND effect_kind = 'artifact.put' AND state IN ('planned', 'started', 'unknown', 'completed', 'verified')
ORDER BY state = 'verified' DESC, attempt DESC
LIMIT 1`

// Live returns the task's artifact.put effect that a new attempt must resume
// rather than replace: a verified one, else the one of the highest attempt
// whose outcome is not known (planned, started, unknown, completed). Only
// EffectID, Attempt, Token and State are set. found is false when there is
// none (no effect yet, or only failed or compensated ones).
func Live(ctx context.Context, q dbpool.Querier, taskID string) (e Effect, found bool, err error) {
	return scanLive(q.QueryRow(ctx, sqlLive, taskID), taskID)
}

// QueueLive queues Live on b; e and found are set when the batch's results
// are read.
func QueueLive(b *pgx.Batch, taskID string, e *Effect, found *bool) {
	b.Queue(sqlLive, taskID).QueryRow(func(row pgx.Row) error {
		var err error
		*e, *found, err = scanLive(row, taskID)
		return err
	})
}

func scanLive(row pgx.Row, taskID string) (Effect, bool, error) {
	var e Effect
	err := row.Scan(&e.EffectID, &e.Attempt, &e.Token, &e.State)
	if errors.Is(err, pgx.ErrNoRows) {
		return e, false, nil
	}
	if err != nil {
		return e, false, fmt.Errorf("read artifact effects of task %s: %w", taskID, err)
	}
	return e, true, nil
}

// Stale returns at most limit effects of kind in one of states whose
// updated_at is older than deadline, oldest first: those a worker no
// longer drives (the reconciler resolves them).
func Stale(ctx context.Context, q dbpool.Querier, kind Kind, states []State, deadline time.Duration, limit int) ([]Effect, error) {
	rows, err := q.Query(ctx, `
SELECT `+columns+`
FROM effect_ledger
WHERE effect_kind = $1 AND state = ANY($2) AND updated_at < now() - make_interval(secs => $3)
ORDER BY updated_at
LIMIT $4`, kind, states, deadline.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("select stale %s effects: %w", kind, err)
	}
	effects, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Effect, error) { return scanEffect(row) })
	if err != nil {
		return nil, fmt.Errorf("read stale %s effects: %w", kind, err)
	}
	return effects, nil
}

// ErrNoVerifiedArtifact: the task has no verified artifact.put effect.
var ErrNoVerifiedArtifact = errors.New("no verified artifact effect")

// VerifiedArtifactToken returns the store token of the task's verified
// artifact.put effect (the latest attempt's), or ErrNoVerifiedArtifact.
func VerifiedArtifactToken(ctx context.Context, q dbpool.Querier, taskID string) (string, error) {
	var token string
	err := q.QueryRow(ctx, `
SELECT idempotency_token FROM effect_ledger
WHERE task_id = $1 AND effect_kind = 'artifact.put' AND state = 'verified'
ORDER BY attempt DESC LIMIT 1`, taskID).Scan(&token)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNoVerifiedArtifact
	}
	if err != nil {
		return "", fmt.Errorf("read artifact effect of %s: %w", taskID, err)
	}
	return token, nil
}
