package api

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/dbpool"
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

// The read that settles a lost COMMIT answer ends with its requests: at
// the earliest of their deadlines, or settleGrace from now when that has
// passed or is nearer, at most settleTimeout from now, and at once when
// every request's client has left (context.Canceled, not a deadline).
func TestSettleContext(t *testing.T) {
	t.Parallel()
	within := func(t *testing.T, ctx context.Context, want time.Time) {
		t.Helper()
		got, ok := ctx.Deadline()
		if !ok || got.Sub(want).Abs() > 200*time.Millisecond {
			t.Fatalf("settle deadline %v (set %v), want about %v", got, ok, want)
		}
		if ctx.Err() != nil {
			t.Fatalf("settle context ended at once: %v", ctx.Err())
		}
	}
	deadline := func(d time.Duration) context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		t.Cleanup(cancel)
		return ctx
	}
	cancelled := func() (context.Context, context.CancelFunc) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		t.Cleanup(cancel)
		return ctx, cancel
	}
	passed := deadline(-time.Second)

	t.Run("deadline passed: the grace", func(t *testing.T) {
		ctx, stop := settleContext(passed)
		defer stop()
		within(t, ctx, time.Now().Add(settleGrace))
	})
	t.Run("deadline near: the grace", func(t *testing.T) {
		ctx, stop := settleContext(deadline(settleGrace / 4))
		defer stop()
		within(t, ctx, time.Now().Add(settleGrace))
	})
	t.Run("deadline between: the deadline", func(t *testing.T) {
		d := (settleGrace + settleTimeout) / 2
		ctx, stop := settleContext(deadline(d))
		defer stop()
		within(t, ctx, time.Now().Add(d))
	})
	t.Run("deadline far or none: settleTimeout", func(t *testing.T) {
		for _, req := range []context.Context{deadline(time.Hour), context.Background()} {
			ctx, stop := settleContext(req)
			within(t, ctx, time.Now().Add(settleTimeout))
			stop()
		}
	})
	t.Run("a group: its earliest deadline", func(t *testing.T) {
		d := (settleGrace + settleTimeout) / 2
		ctx, stop := settleContext(deadline(time.Hour), deadline(d), context.Background())
		defer stop()
		within(t, ctx, time.Now().Add(d))
	})
	t.Run("client gone: none", func(t *testing.T) {
		req, cancel := cancelled()
		cancel()
		ctx, stop := settleContext(req)
		defer stop()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
			t.Fatal("the settle context of a request whose client left did not end")
		}
	})
	t.Run("client leaves during the read: it ends", func(t *testing.T) {
		req, cancel := cancelled()
		ctx, stop := settleContext(req)
		defer stop()
		if ctx.Err() != nil {
			t.Fatalf("ended before the client left: %v", ctx.Err())
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
			t.Fatal("the settle context did not end when the client left")
		}
	})
	t.Run("a group: ends only when every client left", func(t *testing.T) {
		a, cancelA := cancelled()
		b, cancelB := cancelled()
		ctx, stop := settleContext(a, b, passed)
		cancelA()
		cancelB()
		time.Sleep(50 * time.Millisecond)
		if ctx.Err() != nil { // passed ended by its deadline: its client may be waiting
			t.Fatalf("ended while a member whose deadline passed may still read the answer: %v", ctx.Err())
		}
		stop()
		ctx, stop = settleContext(a, b)
		defer stop()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
			t.Fatal("the settle context of a group whose clients all left did not end")
		}
	})
}

// A create whose COMMIT's answer was lost while PostgreSQL cannot be read
// at all (here: the proxy stalls every connection from the message that
// holds the COMMIT on) answers 503 about settleGrace after its
// RequestTimeout, not settleTimeout after it: the handler, the tenant's
// in-flight slot and the key's flight are not held for the settle read.
func TestSettleReadEndsSoonAfterTheDeadline(t *testing.T) {
	t.Parallel()
	const requestTimeout = time.Second
	b, proxy := proxiedSetup(t, requestTimeout)
	if r := b.post(t, "settle-bound-warm-up", wrap(`{"warm":1}`)); r.status != http.StatusAccepted {
		t.Fatalf("warm-up create: %d %s", r.status, r.body)
	}
	const marker = "the-database-stalls-here"
	proxy.stallAtMarker.Store(true)
	proxy.loseFrom(marker)
	start := time.Now()
	r := b.post(t, "settle-bound", wrap(`{"note":"`+marker+`"}`))
	took := time.Since(start)
	t.Logf("answered %d after %s", r.status, took.Round(10*time.Millisecond))
	if r.status != http.StatusServiceUnavailable || r.json(t)["code"] != CodeDatabaseUnavailable {
		t.Fatalf("create whose COMMIT's answer was lost and cannot be settled: %d %s, want 503 %s", r.status, clip(string(r.body), 300), CodeDatabaseUnavailable)
	}
	if n := proxy.armed.Load(); n != 1 {
		t.Fatalf("%d connections sent the COMMIT's batch into the stall, want 1", n)
	}
	// settleTimeout (5 s) after the deadline was the bound before; the
	// margin (2 s) is for a slow machine.
	if limit := requestTimeout + settleGrace + 2*time.Second; took < requestTimeout || took > limit {
		t.Fatalf("answered after %s, want between the RequestTimeout (%s) and %s", took, requestTimeout, limit)
	}
}

// A create whose client leaves while its COMMIT is unanswered does not
// read its record at all: nobody is there to receive the answer.
func TestSettleReadIsSkippedWhenTheClientLeft(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy, pcfg := proxiedPoolConfig(t, b.db.URL)
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	t.Cleanup(proxy.close) // before pool.Close: a stalled proxy's connections do not answer
	s := &store{pool: pool}
	warm := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "settle-left-warm-up", "0")
	if _, err := s.createOne(context.Background(), warm.k, warm.p, warm.draft, maxAloneLockTimeout); err != nil {
		t.Fatal(err)
	}

	r := groupReq(tenant.Principal{TenantID: b.tenant.ID}, "settle-left", "1")
	ctx, leave := context.WithTimeout(context.Background(), time.Minute)
	defer leave()
	leftAt := make(chan time.Time, 1)
	build := r.draft.build
	r.draft.build = func(now time.Time) (*newTask, error) {
		proxy.stalled.Store(true) // the second batch, COMMIT included, is held
		time.AfterFunc(100*time.Millisecond, func() { leftAt <- time.Now(); leave() })
		return build(now)
	}
	_, err = s.createOne(ctx, r.k, r.p, r.draft, maxAloneLockTimeout)
	took := time.Since(<-leftAt)
	t.Logf("createOne returned %v, %s after the client left", err, took.Round(10*time.Millisecond))
	var unknown *dbpool.CommitUnknownError
	if !errors.As(err, &unknown) {
		t.Fatalf("createOne = %v, want its COMMIT unknown", err)
	}
	if took >= settleGrace {
		t.Fatalf("returned %s after the client left: the settle read ran for nobody", took)
	}
}

// The same for a group transaction, seen by its clients: two creates
// committed together while PostgreSQL's answers to the group's second round
// trip were lost are each answered 202 with their own task once the
// group's deadline ends the wait (the group is settled by one member's
// record, groupCommitted), not answered from the record as replays after
// running alone. The group forms because the API's only create
// transaction is busy: a third request waits for its key's record, held
// by a transaction of the test, until its lock_timeout.
func TestLostCommitAnswerOfAGroupIsSettledOverHTTP(t *testing.T) {
	t.Parallel()
	b, proxy := proxiedSetup(t, 4*time.Second, func(c *Config) { c.CreateTransactions = 1 })
	if r := b.post(t, "group-lost-warm-up", wrap(`{"warm":1}`)); r.status != http.StatusAccepted {
		t.Fatalf("warm-up create: %d %s", r.status, r.body)
	}
	ctx := context.Background()
	holder, err := b.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx) //nolint:errcheck // the key is only held, never committed
	var held pgx.Batch
	var at time.Time
	idempotency.QueueInsertSucceeded(&held, idempotency.Key{Scope: tenant.CreateScope(b.tenant.ID), Key: "group-lost-held",
		Fingerprint: Fingerprint(canon.SHA256Hex([]byte("held")), OutputFormatJCS), TTL: time.Hour}, "held-task", []byte(`{}`), &at)
	if err := holder.SendBatch(ctx, &held).Close(); err != nil {
		t.Fatal(err)
	}

	const marker = "the-answers-to-this-group-are-lost"
	proxy.loseFrom(marker) // in one member's document: the group's second round trip
	answers := make(chan *response, 3)
	post := func(key, doc string) {
		r, err := b.try(http.MethodPost, "/v1/tasks", http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {key}}, wrap(doc))
		if err != nil {
			r = &response{status: -1, body: []byte(err.Error())}
		}
		r.header.Set("X-Test-Key", key)
		answers <- r
	}
	go post("group-lost-held", `{"held":1}`) // takes the create transaction and waits for the lock
	deadline := time.Now().Add(10 * time.Second)
	for waiting := 0; waiting == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the held key's request never waited for its lock")
		}
		if err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	go post("group-lost-1", `{"note":"`+marker+`"}`)
	go post("group-lost-2", `{"n":2}`)

	tasks := map[string]string{}
	for range 3 {
		r := <-answers
		key := r.header.Get("X-Test-Key")
		if key == "group-lost-held" {
			if r.status != http.StatusConflict {
				t.Errorf("the held key's create: %d %s, want 409 while its record is held", r.status, clip(string(r.body), 300))
			}
			continue
		}
		t.Logf("%s answered %d after %s", key, r.status, time.Since(start).Round(10*time.Millisecond))
		if r.status != http.StatusAccepted || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("%s: %d %s (Idempotent-Replayed %q), want 202 with its new task: its group committed", key, r.status, clip(string(r.body), 300), r.header.Get("Idempotent-Replayed"))
		}
		tasks[key], _ = r.json(t)["task_id"].(string)
	}
	if n := proxy.armed.Load(); n != 1 {
		t.Fatalf("%d connections lost their answers, want 1 (the group's)", n)
	}
	if count, sum := batchSamples(t, b.reg); count != 2 || sum != 3 { // the warm-up's 1 and the group's 2
		t.Fatalf("converge_api_create_batch_size: %d transactions, %v requests; want the warm-up's and one group of 2", count, sum)
	}
	for key, id := range tasks {
		rec, err := idempotency.Get(ctx, b.db.Pool, tenant.CreateScope(b.tenant.ID), key)
		if err != nil || rec.TaskID == nil || *rec.TaskID != id {
			t.Fatalf("record of %s %+v, err %v; want it to name the answered task %q", key, rec, err, id)
		}
	}
	if len(tasks) != 2 || tasks["group-lost-1"] == tasks["group-lost-2"] {
		t.Fatalf("tasks %v, want two different ones", tasks)
	}
}
