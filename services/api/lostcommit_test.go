package api

import (
	"context"
	"net/http"
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

// The same seen by a client: a create whose transaction committed while
// PostgreSQL's answers to its second round trip (the task, its document,
// the outbox row and COMMIT) were lost is answered 202 with the task that
// exists once its RequestTimeout has ended the wait, not 503; the key's
// replay names the same task, and the database holds one task.
func TestLostCommitAnswerIsSettledOverHTTP(t *testing.T) {
	t.Parallel()
	b, proxy := proxiedSetup(t, 2*time.Second)
	if r := b.post(t, "lost-http-warm-up", wrap(`{"warm":1}`)); r.status != http.StatusAccepted {
		t.Fatalf("warm-up create: %d %s", r.status, r.body)
	}

	const marker = "the-answers-to-this-are-lost"
	proxy.loseFrom(marker) // in the document: sent in the second round trip only
	body := wrap(`{"note":"` + marker + `"}`)
	start := time.Now()
	r := b.post(t, "lost-http", body)
	if r.status != http.StatusAccepted {
		t.Fatalf("create whose COMMIT ran: %d %s, want 202 with its task", r.status, clip(string(r.body), 300))
	}
	taskID, _ := r.json(t)["task_id"].(string)
	took := time.Since(start)
	t.Logf("answered after %s", took.Round(10*time.Millisecond))
	if n := proxy.armed.Load(); n != 1 || took < 2*time.Second {
		t.Fatalf("%d connections lost their answers and the request took %s; want 1, and the 2 s RequestTimeout waited out", n, took)
	}

	rec, err := idempotency.Get(context.Background(), b.db.Pool, tenant.CreateScope(b.tenant.ID), "lost-http")
	if err != nil || rec.TaskID == nil || *rec.TaskID != taskID {
		t.Fatalf("record %+v, err %v; want it to name the answered task %q", rec, err, taskID)
	}
	again := b.post(t, "lost-http", body)
	if id, _ := again.json(t)["task_id"].(string); id != taskID || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s (Idempotent-Replayed %q), want task %s replayed", again.status, again.body, again.header.Get("Idempotent-Replayed"), taskID)
	}
	var tasks int
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM task WHERE tenant_id = $1`, b.tenant.ID).Scan(&tasks); err != nil {
		t.Fatal(err)
	}
	if tasks != 2 { // the warm-up's and this one
		t.Fatalf("%d tasks of the tenant, want 2", tasks)
	}
}
