package api

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// A single-request create whose COMMIT ran but whose answer was lost (here:
// the network drops PostgreSQL's answers from the moment the second batch
// is built, and the request's deadline closes the connection) is settled
// by its idempotency record, as a group's is: the request gets its task,
// not an error for a task that exists.
func TestLostCommitAnswerOfOneRequestIsSettled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy, pcfg := proxiedPoolConfig(t, b.db.URL)
	pcfg.MaxConns = 2 // the warm-up's idle connection, its statements prepared, runs the create; the settle read opens the other
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := &store{pool: pool}
	warm := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "lost-commit-warm-up", "0")
	if _, err := s.createOne(context.Background(), warm.k, warm.p, warm.draft, maxAloneLockTimeout); err != nil {
		t.Fatal(err)
	}

	r := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "lost-commit-answer", "1")
	build := r.draft.build
	r.draft.build = func(now time.Time) (*newTask, error) {
		proxy.lose() // the first batch was answered; the second's answers are lost
		return build(now)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := s.createOne(ctx, r.k, r.p, r.draft, maxAloneLockTimeout)
	if err != nil {
		t.Fatalf("createOne = %v, want the task: its transaction committed", err)
	}
	rec, err := idempotency.Get(context.Background(), b.db.Pool, r.k.Scope, r.k.Key)
	if err != nil || rec.TaskID == nil || *rec.TaskID != n.Task.TaskID {
		t.Fatalf("record %+v, err %v; want it to name task %s", rec, err, n.Task.TaskID)
	}
}
