package reconciler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// All SQL of the reconciler. Every repair is a compare-and-set on the
// effect's state, so a repair computed from a stale read can never undo
// newer progress (DESIGN.md, River's rescuer bug).

// querier is what the store functions need from a pgx.Tx or *pgxpool.Pool.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ querier = pgx.Tx(nil)
	_ querier = (*pgxpool.Pool)(nil)
)

// Effect kinds and states (effect_ledger, seed 7).
const (
	kindArtifactPut = "artifact.put"

	statePlanned              = "planned"
	stateStarted              = "started"
	stateUnknown              = "unknown"
	stateVerified             = "verified"
	stateCompensationRequired = "compensation_required"
	stateCompensated          = "compensated"
)

// effect is an effect_ledger row as the reconciler reads it.
type effect struct {
	EffectID       string
	TaskID         string
	Attempt        int
	Kind           string
	Token          string
	TargetIdentity string
	State          string
	RequestSHA256  string
	RequestSize    int64
	ObservedSHA256 *string
	UpdatedAt      time.Time
}

const effectColumns = `effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state,
request_sha256, request_size, observed_result_sha256, updated_at`

func scanEffects(rows pgx.Rows) ([]effect, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (effect, error) {
		var e effect
		err := row.Scan(&e.EffectID, &e.TaskID, &e.Attempt, &e.Kind, &e.Token, &e.TargetIdentity, &e.State,
			&e.RequestSHA256, &e.RequestSize, &e.ObservedSHA256, &e.UpdatedAt)
		return e, err
	})
}

// staleEffects returns at most limit effects of kind kind in one of states
// whose updated_at is older than deadline, oldest first.
func staleEffects(ctx context.Context, q querier, kind string, states []string, deadline time.Duration, limit int) ([]effect, error) {
	rows, err := q.Query(ctx, `
SELECT `+effectColumns+`
FROM effect_ledger
WHERE effect_kind = $1 AND state = ANY($2) AND updated_at < now() - make_interval(secs => $3)
ORDER BY updated_at
LIMIT $4`, kind, states, deadline.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("select stale %s effects: %w", kind, err)
	}
	effects, err := scanEffects(rows)
	if err != nil {
		return nil, fmt.Errorf("read stale %s effects: %w", kind, err)
	}
	return effects, nil
}

// setState moves an effect from state from to state to (compare-and-set);
// observed and code are stored when non-nil. It returns false when the
// effect was no longer in state from.
func setState(ctx context.Context, q querier, effectID, from, to string, observed, code *string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE effect_ledger SET state = $3,
  observed_result_sha256 = COALESCE($4, observed_result_sha256),
  error_code = COALESCE($5, error_code),
  updated_at = now()
WHERE effect_id = $1 AND state = $2`, effectID, from, to, observed, code)
	if err != nil {
		return false, fmt.Errorf("effect %s %s -> %s: %w", effectID, from, to, err)
	}
	return tag.RowsAffected() == 1, nil
}

// planHide writes the ledger row of the compensation of effect e (kind
// artifact.hide, token "compensation-for-<effect_id>", seed 8) unless it
// exists, and returns its id and current state.
func planHide(ctx context.Context, q querier, e effect, requestSHA256 string) (id, state string, err error) {
	id = "compensation-for-" + e.EffectID
	_, err = q.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, 'artifact.hide', $1, $4, 'started', $5, $6)
ON CONFLICT (effect_kind, idempotency_token) DO NOTHING`, id, e.TaskID, e.Attempt, e.TargetIdentity, requestSHA256, e.RequestSize)
	if err != nil {
		return id, "", fmt.Errorf("plan compensation %s: %w", id, err)
	}
	err = q.QueryRow(ctx, `SELECT state FROM effect_ledger WHERE effect_kind = 'artifact.hide' AND idempotency_token = $1`, id).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return id, "", fmt.Errorf("compensation %s vanished", id)
	}
	if err != nil {
		return id, "", fmt.Errorf("read compensation %s: %w", id, err)
	}
	return id, state, nil
}
