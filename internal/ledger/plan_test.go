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
// (effect_kind, idempotency_token) and read them by (kind, token). The
// schema served them until migration 00019 dropped that index and raised
// schema_compatibility.oldest_binary to 17: their insert, word for word,
// works against the schema of 00018 and fails (42P10) against the latest,
// whose floor says so.
func TestSchemaServesBinariesBefore00017(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	const oldPlanInsert = `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (effect_kind, idempotency_token) DO NOTHING`
	e := putOfStartedTask(t, db, `{"old":1}`, strings.Repeat("ab", 32), 1)
	args := []any{e.EffectID, e.TaskID, e.Attempt, e.Kind, e.Token, e.TargetIdentity, e.State, e.RequestSHA256, e.RequestSize}

	var floor int64
	if err := db.Pool.QueryRow(ctx, `SELECT oldest_binary FROM schema_compatibility`).Scan(&floor); err != nil || floor != 17 {
		t.Fatalf("oldest_binary %d (%v), want 17", floor, err)
	}
	var pgErr *pgconn.PgError
	if _, err := db.Pool.Exec(ctx, oldPlanInsert, args...); !errors.As(err, &pgErr) || pgErr.Code != "42P10" {
		t.Fatalf("pre-00017 plan insert against the latest schema: %v, want 42P10 (no such unique index)", err)
	}

	p := db.Migrations(t)
	if _, err := p.DownTo(ctx, 18); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT oldest_binary FROM schema_compatibility`).Scan(&floor); err != nil || floor != 16 {
		t.Fatalf("after Down of 00019: oldest_binary %d (%v), want 16", floor, err)
	}
	for i, want := range []int64{1, 0} {
		tag, err := db.Pool.Exec(ctx, oldPlanInsert, args...)
		if err != nil || tag.RowsAffected() != want {
			t.Fatalf("pre-00017 plan insert %d against 00018: %v rows, err %v; want %d rows", i+1, tag.RowsAffected(), err, want)
		}
	}
	if _, found, err := ledger.Get(ctx, db.Pool, e.Kind, e.Token); err != nil || !found {
		t.Fatalf("Get of the effect an old binary planned: found %v, err %v", found, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("00019 up again: %v", err)
	}
}

// Concurrent plans of one identity (two compensations racing) all succeed:
// exactly one inserts the row, the others find it. While the identity had
// two unique indexes (migrations 00017 and 00018), an ON CONFLICT naming
// only one of them let the other raise 23505 (the second review of
// 2026-12-06: about a third of 4-way races).
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
