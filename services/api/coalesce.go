package api

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// Group commit of creates (issue 11). Concurrent POST /v1/tasks requests
// that reach the create transaction while CreateTransactions of them are
// already running queue up; the next transaction takes every queued request
// (at most CreateBatchMax) and runs seed 3.1's create transaction for all
// of them at once: one BEGIN, one COMMIT, each request's statements the
// same as alone (package idempotency, task, outbox, tenant), pipelined in
// two round trips. A lone request runs the single-request transaction
// (store.createOne), so a quiet API answers as it did before.
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
	build func(now time.Time) (*newTask, error)
	done  chan createResult // buffered (1): the answer
}

type createResult struct {
	n   *newTask
	err error
}

// coalescer queues creates and runs them in group transactions.
type coalescer struct {
	store    *store
	maxBatch int           // most requests per transaction
	maxTx    int           // most group transactions at once
	timeout  time.Duration // bound of a group transaction (the API's RequestTimeout)
	faults   *fault.Set
	sizes    prometheus.Observer // converge_api_create_batch_size

	mu       sync.Mutex
	queue    []*createReq
	inflight int // transactions running (draining goroutines)
}

// do runs r's create in the next transaction and returns its outcome. A
// request whose context ends while it is queued leaves the queue with its
// context's error (nothing written); once a transaction took it, it waits
// for that transaction to end (bounded by timeout), because the answer
// must say whether its task was committed.
func (c *coalescer) do(r *createReq) (*newTask, error) {
	c.mu.Lock()
	c.queue = append(c.queue, r)
	if c.inflight < c.maxTx {
		c.inflight++
		go c.drain()
	}
	c.mu.Unlock()
	select {
	case res := <-r.done:
		return res.n, res.err
	case <-r.ctx.Done():
	}
	c.mu.Lock()
	if i := slices.Index(c.queue, r); i >= 0 {
		c.queue = slices.Delete(c.queue, i, i+1)
		c.mu.Unlock()
		return nil, fmt.Errorf("create task: waiting for a create transaction: %w", r.ctx.Err())
	}
	c.mu.Unlock()
	res := <-r.done
	return res.n, res.err
}

// drain runs transactions until the queue is empty.
func (c *coalescer) drain() {
	for {
		c.mu.Lock()
		if len(c.queue) == 0 {
			c.inflight--
			c.mu.Unlock()
			return
		}
		n := min(len(c.queue), c.maxBatch)
		group := slices.Clone(c.queue[:n])
		c.queue = slices.Delete(c.queue, 0, n)
		c.mu.Unlock()
		c.run(group)
	}
}

// run answers every request of group.
func (c *coalescer) run(group []*createReq) {
	live := group[:0]
	for _, r := range group {
		if err := r.ctx.Err(); err != nil {
			r.done <- createResult{err: fmt.Errorf("create task: %w", err)}
			continue
		}
		live = append(live, r)
	}
	if len(live) == 0 {
		return
	}
	c.sizes.Observe(float64(len(live)))
	if len(live) == 1 {
		r := live[0]
		n, err := c.store.createOne(r.ctx, r.k, r.p, r.build)
		r.done <- createResult{n: n, err: err}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	results, err := c.store.createGroup(ctx, live, c.faults)
	if err != nil {
		// Nothing of the group was committed: each request alone.
		for _, r := range live {
			go func() {
				n, err := c.store.createOne(r.ctx, r.k, r.p, r.build)
				r.done <- createResult{n: n, err: err}
			}()
		}
		return
	}
	for i, r := range live {
		r.done <- results[i]
	}
}

// createGroup runs the create transaction of seed 3.1 for every request of
// group in one transaction and returns each request's outcome (in group's
// order): the new task, or errKeyTaken when its record insert conflicted.
// An error means the transaction was rolled back: nothing was written.
func (s *store) createGroup(ctx context.Context, group []*createReq, faults *fault.Set) ([]createResult, error) {
	order := make([]int, len(group))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		ka, kb := group[a].k, group[b].k
		return cmp.Or(cmp.Compare(ka.Scope, kb.Scope), cmp.Compare(ka.Key, kb.Key))
	})

	conn, err := s.acquireTx(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.end()

	var b pgx.Batch
	now := make([]time.Time, len(group))
	won := make([]bool, len(group))
	b.Queue("BEGIN")
	for _, i := range order {
		idempotency.QueueBeginOutcome(&b, group[i].k, &now[i], &won[i])
	}
	if err := conn.SendBatch(ctx, &b).Close(); err != nil {
		return nil, fmt.Errorf("insert %d idempotency records: %w", len(group), err)
	}

	results := make([]createResult, len(group))
	b = pgx.Batch{}
	winners := 0
	for _, i := range order {
		r := group[i]
		if !won[i] {
			results[i].err = errKeyTaken
			continue
		}
		n, err := r.build(now[i].UTC())
		if err != nil {
			return nil, err
		}
		results[i].n = n
		winners++
		queueCreateRows(&b, r.k, r.p, n)
	}
	if winners == 0 {
		return results, nil // nothing inserted; the deferred rollback ends the transaction
	}
	if faults.Hit(fault.APICreateGroupAbort) != fault.ActionNone {
		return nil, fmt.Errorf("create %d tasks: %w", winners, fault.ErrInjected)
	}
	queueCommit(&b)
	if err := conn.SendBatch(ctx, &b).Close(); err != nil {
		return nil, fmt.Errorf("create %d tasks: %w", winners, err)
	}
	conn.committed = true
	return results, nil
}
