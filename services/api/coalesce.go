package api

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/groupcommit"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// Group commit of creates (issue 11). Concurrent POST /v1/tasks requests
// that reach the create transaction while CreateTransactions of them are
// already running queue up; the next transaction takes every queued request
// (at most CreateBatchMax) and runs seed 3.1's create transaction for all
// of them at once: one BEGIN, one COMMIT, each request's statements the
// same as alone (package idempotency, task, tenant) but the TaskCreated
// outbox rows, inserted by one statement for the group
// (outbox.QueueInsertMany), pipelined in two round trips. A lone request runs the single-request transaction
// (store.createOne), so a quiet API answers as it did before. The queue
// is internal/groupcommit's, which the worker's groups of runs share.
//
// Each request's outcome is exactly the one it would have had alone:
//   - a request whose record insert conflicted (its key was recorded by a
//     committed transaction, or by an earlier request of the same group)
//     is errKeyTaken after the group's transaction ended, so its read of
//     the record sees the winner's commit;
//   - when anything else in the group fails (a quota with nothing left, a
//     broken connection, a guard of sqlComplete, a deadlock with another
//     transaction), the group's transaction is rolled back, nothing of it
//     is committed, and every request of the group runs alone (createOne)
//     with its own context: one request's failure never becomes another's
//     answer.
//
// Records are inserted in (scope, key) order, so that two groups that share
// keys lock them in the same order.

// createReq is one request waiting for a create transaction.
type createReq struct {
	ctx   context.Context
	k     idempotency.Key
	p     tenant.Principal
	draft *taskDraft
	done  chan createResult // buffered (1): the answer
	// afterGroup: the request runs alone because its group transaction
	// failed (its lock wait is then afterGroupLockTimeout).
	afterGroup bool
}

type createResult struct {
	n   *newTask
	err error
}

// answer gives r its outcome; only the first answer counts (a panic
// recovered after some members were answered answers the rest).
func (r *createReq) answer(n *newTask, err error) {
	select {
	case r.done <- createResult{n: n, err: err}:
	default:
	}
}

const (
	// groupLockTimeout is the lock_timeout of a group transaction: a group
	// that waits this long for a lock held by another transaction (an
	// uncommitted record of one member's key, a tenant's quota row) fails,
	// and its members run alone, so that no member waits for a lock only
	// another member needs. Alone, a request waits for a lock at most
	// afterGroupLockTimeout (after a failed group) or maxAloneLockTimeout
	// (store.go).
	groupLockTimeout = 500 * time.Millisecond
	// quotaMemo is how long the requests of a tenant whose quota was found
	// exhausted run alone: such a request would fail every group it is in.
	quotaMemo = time.Second
	// minGroupTime is the least time a request must have left to join a
	// group: groupContext gives a group half the time of its most hurried
	// member, so one member close to its deadline would make the group fail
	// and every member run again alone. Such a request runs alone at once.
	minGroupTime = 4 * groupLockTimeout
)

// coalescer queues creates and runs them in group transactions.
type coalescer struct {
	store    *store
	maxBatch int           // most requests per transaction
	timeout  time.Duration // most time of a group transaction (the API's RequestTimeout)
	faults   *fault.Set
	log      *slog.Logger
	sizes    prometheus.Observer // converge_api_create_batch_size
	aborts   prometheus.Counter  // converge_api_create_group_aborts_total

	q *groupcommit.Queue[*createReq] // Max: the most group transactions at once; a group: the first maxBatch requests waiting

	mu        sync.Mutex
	exhausted map[string]time.Time // tenant ID → until when its requests run alone (quotaMemo)
}

// newCoalescer returns the group commit of s with at most maxBatch requests
// per transaction and maxTx transactions at once, each bounded by timeout.
func newCoalescer(s *store, maxBatch, maxTx int, timeout time.Duration, faults *fault.Set, log *slog.Logger, m *metrics) *coalescer {
	c := &coalescer{store: s, maxBatch: maxBatch, timeout: timeout, faults: faults, log: log,
		sizes: m.createBatch, aborts: m.createGroupAborts, exhausted: map[string]time.Time{}}
	c.q = &groupcommit.Queue[*createReq]{Max: maxTx, Process: c.run, Take: func(waiting []*createReq) (group, rest []*createReq) {
		n := min(len(waiting), c.maxBatch)
		return slices.Clone(waiting[:n]), slices.Delete(waiting, 0, n)
	}}
	return c
}

// do runs r's create in the next transaction and returns its outcome. A
// request whose context ends while it is queued leaves the queue with its
// context's error (nothing written); once a transaction took it, it waits
// for that transaction to end (bounded by the group's deadline, groupContext,
// and groupLockTimeout), because the answer must say whether its task was
// committed.
func (c *coalescer) do(r *createReq) (*newTask, error) {
	c.q.Submit(r)
	select {
	case res := <-r.done:
		return res.n, res.err
	case <-r.ctx.Done():
	}
	if c.q.Withdraw(r) {
		return nil, fmt.Errorf("create task: waiting for a create transaction: %w", r.ctx.Err())
	}
	res := <-r.done
	return res.n, res.err
}

// run answers every request of group. Requests whose context already
// ended get its error; those of a tenant whose quota was just found
// exhausted, and those with less than minGroupTime left, run alone; the
// rest share one group transaction, and run alone when it fails (a group
// whose COMMIT was sent but not answered is settled first: committed). Requests running alone after a group are not bounded by
// the queue's Max (they take pool connections as without group commit).
func (c *coalescer) run(group []*createReq) {
	now := time.Now()
	live := make([]*createReq, 0, len(group))
	c.mu.Lock()
	for _, r := range group {
		switch {
		case r.ctx.Err() != nil:
			r.answer(nil, fmt.Errorf("create task: %w", r.ctx.Err()))
		case r.p.HasQuota && now.Before(c.exhausted[r.p.TenantID]), hurried(r.ctx, now):
			go c.runAlone(r)
		default:
			live = append(live, r)
		}
	}
	c.mu.Unlock()
	switch len(live) {
	case 0:
		return
	case 1:
		c.runAlone(live[0])
		return
	}
	ctx, cancel := c.groupContext(live)
	defer cancel()
	results, err := c.createGroup(ctx, live)
	if err != nil {
		// Nothing of the group was committed: each request alone.
		c.aborts.Inc()
		c.log.Debug("create group transaction failed; its requests run alone", slog.Int("requests", len(live)), slog.Any("error", err))
		for _, r := range live {
			r.afterGroup = true
			go c.runAlone(r)
		}
		return
	}
	if n := winners(results); n > 0 {
		c.sizes.Observe(float64(n))
	}
	for i, r := range live {
		r.answer(results[i].n, results[i].err)
	}
}

// hurried reports whether ctx has less than minGroupTime left at now.
func hurried(ctx context.Context, now time.Time) bool {
	d, ok := ctx.Deadline()
	return ok && d.Sub(now) < minGroupTime
}

// winners counts the requests of a group transaction that inserted a task.
func winners(results []createResult) int {
	n := 0
	for _, r := range results {
		if r.n != nil {
			n++
		}
	}
	return n
}

// groupCommitted settles a group transaction whose COMMIT was sent but
// whose answer was lost (the group's deadline, a broken connection) by the
// record of one request that inserted a task (recordNames, its read bounded
// by the members' contexts, settleContext): all of a transaction or
// nothing. Not known is false: the members then run alone, and each finds
// its key recorded and answers from the record, as a retry of the request
// would.
func (s *store) groupCommitted(group []*createReq, results []createResult) bool {
	i := slices.IndexFunc(results, func(r createResult) bool { return r.n != nil })
	if i < 0 {
		return false
	}
	reqs := make([]context.Context, len(group))
	for j, r := range group {
		reqs[j] = r.ctx
	}
	return s.recordNames(reqs, group[i].k, results[i].n.Task.TaskID)
}

// groupContext bounds a group transaction: by timeout, and by half the time
// left to the member whose deadline comes first, so that when the group
// fails late every member still has time to run alone.
func (c *coalescer) groupContext(group []*createReq) (context.Context, context.CancelFunc) {
	budget := c.timeout
	now := time.Now()
	for _, r := range group {
		if d, ok := r.ctx.Deadline(); ok {
			budget = min(budget, d.Sub(now)/2)
		}
	}
	return context.WithTimeout(context.Background(), budget)
}

// createGroup runs store.createGroup; a panic (of a request's build) is
// its error, so that every request then runs alone and only the one that
// panics fails.
func (c *coalescer) createGroup(ctx context.Context, group []*createReq) (results []createResult, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("create group transaction: panic: %v", v)
		}
	}()
	return c.store.createGroup(ctx, group, c.faults)
}

// runAlone answers r with the single-request create transaction
// (store.createOne) under r's own context. A quota found exhausted makes
// its tenant's requests run alone for quotaMemo; a panic is logged with its
// stack and answered as an error (net/http's handler recovery would not
// see it: it happens on the group's goroutine).
func (c *coalescer) runAlone(r *createReq) {
	defer func() {
		if v := recover(); v != nil {
			c.log.ErrorContext(r.ctx, "create transaction panicked", slog.Any("panic", v), slog.String("stack", string(debug.Stack())))
			r.answer(nil, fmt.Errorf("create task: panic: %v", v))
		}
	}()
	maxWait := maxAloneLockTimeout
	if r.afterGroup {
		maxWait = afterGroupLockTimeout
	}
	n, err := c.store.createOne(r.ctx, r.k, r.p, r.draft, maxWait)
	if n != nil {
		c.sizes.Observe(1) // a transaction that inserted a task
	}
	if errors.Is(err, tenant.ErrQuotaExhausted) {
		c.mu.Lock()
		c.exhausted[r.p.TenantID] = time.Now().Add(quotaMemo)
		for id, until := range c.exhausted {
			if time.Now().After(until) {
				delete(c.exhausted, id)
			}
		}
		c.mu.Unlock()
	}
	r.answer(n, err)
}

// errNoWinner ends a group transaction in which no request won its key:
// nothing was inserted, and it is rolled back.
var errNoWinner = errors.New("no request of the group won its key")

// createGroup runs the create transaction of seed 3.1 for every request of
// group in one transaction and returns each request's outcome (in group's
// order): the new task, or errKeyTaken when its record insert conflicted.
// An error means nothing was written. A COMMIT whose answer was lost is
// settled by groupCommitted: committed, the outcomes are returned; else the
// error.
func (s *store) createGroup(ctx context.Context, group []*createReq, faults *fault.Set) ([]createResult, error) {
	order := make([]int, len(group))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		ka, kb := group[a].k, group[b].k
		return cmp.Or(cmp.Compare(ka.Scope, kb.Scope), cmp.Compare(ka.Key, kb.Key))
	})

	var results []createResult
	err := dbpool.InPipelinedTx(ctx, s.pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		now := make([]time.Time, len(group))
		won := make([]bool, len(group))
		queueLockTimeout(&b, groupLockTimeout)
		for _, i := range order {
			idempotency.QueueInsertSucceededOutcome(&b, group[i].k, group[i].draft.TaskID, group[i].draft.Response, &now[i], &won[i])
		}
		if err := tx.SendBatch(ctx, &b); err != nil {
			return fmt.Errorf("insert %d idempotency records: %w", len(group), err)
		}

		results = make([]createResult, len(group))
		b = pgx.Batch{}
		events := make([]outbox.Row, 0, len(group))
		winners := 0
		for _, i := range order {
			r := group[i]
			if !won[i] {
				results[i].err = errKeyTaken
				continue
			}
			n, err := r.draft.build(now[i].UTC())
			if err != nil {
				return err
			}
			results[i].n = n
			winners++
			queueCreateRows(&b, r.k, r.p, n, &events)
		}
		if winners == 0 {
			return errNoWinner // nothing inserted: rolled back
		}
		if faults.Hit(fault.APICreateGroupAbort) != fault.ActionNone {
			return fmt.Errorf("create %d tasks: %w", winners, fault.ErrInjected)
		}
		outbox.QueueInsertMany(&b, events)
		if err := tx.SendBatchAndCommit(ctx, &b); err != nil {
			return fmt.Errorf("create %d tasks: %w", winners, err)
		}
		return nil
	})
	var unknown *dbpool.CommitUnknownError
	switch {
	case errors.Is(err, errNoWinner):
		return results, nil // every request answers errKeyTaken
	case errors.As(err, &unknown) && s.groupCommitted(group, results):
		return results, nil // committed although its answer was lost
	}
	if err != nil {
		return nil, err
	}
	return results, nil
}
