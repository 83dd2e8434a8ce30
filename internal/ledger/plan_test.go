package ledger_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/testenv"
)

// planNew runs ledger.QueuePlanNew alone.
func planNew(t *testing.T, q dbpool.Querier, e ledger.Effect) (ledger.Effect, bool) {
	t.Helper()
	stored, planned := ledger.Effect{EffectID: "untouched"}, true
	b := &pgx.Batch{}
	ledger.QueuePlanNew(b, e, &stored, &planned)
	if err := q.SendBatch(context.Background(), b).Close(); err != nil {
		t.Fatalf("plan %s: %v", e.EffectID, err)
	}
	return stored, planned
}

// putOfStartedTask creates a task with document doc, starts it, and returns
// the artifact.put effect of its attempt with the given request (not
// planned yet).
func putOfStartedTask(t *testing.T, db *testenv.DB, doc, requestSHA256 string, requestSize int64) ledger.Effect {
	t.Helper()
	tk := testenv.MustStartTask(t, db.Pool, testenv.MustCreateTask(t, db.Pool, []byte(doc)).Task.TaskID)
	return ledger.NewPut(tk.TaskID, tk.Attempt, requestSHA256, requestSize)
}

// QueuePlanNew inserts an effect's row once and returns it as written; the
// same identity again is refused and leaves stored untouched, and the row
// keeps what the first plan wrote (seed 7: the ledger row is written before
// the effect, once per identity).
func TestPlanNewInsertsOnceAndReturnsTheRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	sha := strings.Repeat("ab", 32)
	want := putOfStartedTask(t, db, `{"first":1}`, sha, 42)
	stored, planned := planNew(t, db.Pool, want)
	if !planned {
		t.Fatal("plan of a new identity refused")
	}
	if stored.EffectID != want.EffectID || stored.TaskID != want.TaskID || stored.Attempt != want.Attempt || stored.Kind != want.Kind ||
		stored.Token != want.Token || stored.TargetIdentity != want.TargetIdentity || stored.State != ledger.Started ||
		stored.RequestSHA256 != sha || stored.RequestSize != 42 || stored.ObservedSHA256 != nil || stored.ErrorCode != nil || stored.UpdatedAt.IsZero() {
		t.Fatalf("stored %+v, want %+v as written", stored, want)
	}

	again := ledger.NewPut(want.TaskID, want.Attempt, strings.Repeat("cd", 32), 7)
	if stored, planned = planNew(t, db.Pool, again); planned || stored.EffectID != "untouched" {
		t.Fatalf("the same identity planned twice (planned %v, stored %+v)", planned, stored)
	}
	row, found, err := ledger.Get(ctx, db.Pool, want.Kind, want.Token)
	if err != nil || !found || row.RequestSHA256 != sha || row.RequestSize != 42 {
		t.Fatalf("row %+v found %v err %v, want the first plan's request", row, found, err)
	}
}

// An effect's id is its token (migration 00017): the primary key carries
// the identity (kind, token), so a row whose id differs from its token is
// refused, and a plan of a recorded identity finds the row by its id.
func TestEffectIDIsItsToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	put := putOfStartedTask(t, db, `{"id":1}`, strings.Repeat("ab", 32), 1)
	if put.EffectID != put.Token {
		t.Fatalf("NewPut: effect id %q, token %q", put.EffectID, put.Token)
	}
	for _, e := range []ledger.Effect{ledger.NewCompensation(put, put.RequestSHA256, 1), ledger.NewDelete(put)} {
		if e.EffectID != e.Token {
			t.Errorf("%s: effect id %q, token %q", e.Kind, e.EffectID, e.Token)
		}
	}
	_, err := db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ('other-id', $1, 1, 'artifact.put', $2, $2, 'started', $3, 1)`, put.TaskID, put.Token, put.RequestSHA256)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "23514" || pe.ConstraintName != "effect_ledger_id_is_token" {
		t.Fatalf("insert of an id other than the token: err = %v, want check violation effect_ledger_id_is_token", err)
	}
	if _, planned, err := ledger.Plan(ctx, db.Pool, put); err != nil || !planned {
		t.Fatalf("Plan: planned %v, err %v", planned, err)
	}
	stored, planned, err := ledger.Plan(ctx, db.Pool, put)
	if err != nil || planned || stored.EffectID != put.EffectID {
		t.Fatalf("Plan again: stored %+v, planned %v, err %v; want the recorded row", stored, planned, err)
	}
}

// Binaries built before migration 00017 plan effects with ON CONFLICT
// (effect_kind, idempotency_token) and read them by (kind, token); an
// upgrade runs the migration while they still run (deploy/README), so the
// schema keeps the unique index their statements need: this is their
// insert, word for word, against the migrated schema.
func TestSchemaServesBinariesBefore00017(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	e := putOfStartedTask(t, db, `{"old":1}`, strings.Repeat("ab", 32), 1)
	const oldPlanInsert = `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (effect_kind, idempotency_token) DO NOTHING`
	for i, want := range []int64{1, 0} {
		tag, err := db.Pool.Exec(ctx, oldPlanInsert, e.EffectID, e.TaskID, e.Attempt, e.Kind, e.Token, e.TargetIdentity, e.State, e.RequestSHA256, e.RequestSize)
		if err != nil || tag.RowsAffected() != want {
			t.Fatalf("pre-00017 plan insert %d: %v rows, err %v; want %d rows", i+1, tag.RowsAffected(), err, want)
		}
	}
	if _, found, err := ledger.Get(ctx, db.Pool, e.Kind, e.Token); err != nil || !found {
		t.Fatalf("Get of the effect an old binary planned: found %v, err %v", found, err)
	}
}

// Concurrent plans of one identity (two compensations racing) all succeed:
// exactly one inserts the row, the others find it. The identity has two
// unique indexes while migration 00017 keeps the old one, and an
// ON CONFLICT naming only one of them let the other raise 23505 (the
// second review of 2026-12-06: about a third of 4-way races).
func TestConcurrentPlansOfOneIdentity(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	for round := range 30 {
		e := putOfStartedTask(t, db, `{"race":`+testenv.Itoa(round)+`}`, strings.Repeat("ab", 32), 1)
		const n = 4
		planned := make([]bool, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				_, planned[i], errs[i] = ledger.Plan(ctx, db.Pool, e)
			})
		}
		close(start)
		wg.Wait()
		inserted := 0
		for i := range n {
			if errs[i] != nil {
				t.Fatalf("round %d: Plan %d: %v", round, i, errs[i])
			}
			if planned[i] {
				inserted++
			}
		}
		if inserted != 1 {
			t.Fatalf("round %d: %d plans inserted the row, want 1", round, inserted)
		}
	}
}
