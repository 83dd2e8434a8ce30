// Package groupcommit is the queue of group commit: work submitted while
// enough groups are being processed waits, and the waiting work is then
// processed together, as one group (one transaction for all of it). The
// API's create transactions (services/api, coalesce.go) and the worker's
// runs (consumers/worker, groups.go) are its two users (issue 11); each
// decides what a group may hold (Take) and how it is processed and
// answered (Process), and the queue decides when a group starts and how
// waiting work leaves.
//
// The shape is the one PostgreSQL's own group commit and River's batched
// completer have: no timer and no waiting for a batch to fill. A submission
// that finds fewer than Max groups running starts one at once (so a quiet
// system processes each submission alone, without added latency); under
// load the submissions that arrive while Max groups run gather in the
// queue, and each group's end takes the next group from it.
package groupcommit

import (
	"slices"
	"sync"
)

// Queue is the group-commit queue of items of type T (a pointer to a
// submission, whose identity Withdraw compares). The zero value is not
// usable: Max, Take and Process are required; Done is optional. A Queue
// must not be copied after first use.
type Queue[T comparable] struct {
	// Max is the most groups processed at once (at least 1).
	Max int
	// Take removes the next group from waiting (never empty) and returns
	// it and the items left waiting, in their order. A group may be empty
	// only when nothing waiting may be taken now (it then waits for a
	// group's end: Done must make something takeable then). Called with
	// the queue's lock held: it must not block or call the Queue.
	Take func(waiting []T) (group, rest []T)
	// Process processes group and answers each of its items (outside the
	// queue's lock, on the goroutine of its group).
	Process func(group []T)
	// Done, when set, is called with the queue's lock held after Process
	// returned, with the group Take returned: the place to release what
	// Take reserved (the worker's busy tasks). It must not block or call
	// the Queue.
	Done func(group []T)

	mu      sync.Mutex
	waiting []T
	active  int // groups running (goroutines of run)
}

// Submit queues x and, when fewer than Max groups are running, starts one
// (which takes x, alone or with whatever else waits). The caller waits for
// Process's answer by its own means (a channel in x).
func (q *Queue[T]) Submit(x T) {
	q.mu.Lock()
	q.waiting = append(q.waiting, x)
	if q.active < q.Max {
		q.active++
		go q.run()
	}
	q.mu.Unlock()
}

// Withdraw removes x from the queue if no group has taken it yet, and
// reports whether it did: true means x will never be processed or
// answered; false means a group took it and will answer it (the caller
// whose context ended waits for that answer, or knows how to ignore it).
func (q *Queue[T]) Withdraw(x T) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	i := slices.Index(q.waiting, x)
	if i < 0 {
		return false
	}
	q.waiting = slices.Delete(q.waiting, i, i+1)
	return true
}

// run processes groups until none can be taken.
func (q *Queue[T]) run() {
	var group []T
	for {
		q.mu.Lock()
		if group != nil && q.Done != nil {
			q.Done(group)
		}
		group = nil
		if len(q.waiting) > 0 {
			group, q.waiting = q.Take(q.waiting)
		}
		if len(group) == 0 {
			q.active--
			q.mu.Unlock()
			return
		}
		q.mu.Unlock()
		q.Process(group)
	}
}

// Idle reports whether no group is running and nothing waits.
func (q *Queue[T]) Idle() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.active == 0 && len(q.waiting) == 0
}

// Waiting returns a copy of the items waiting, in their order.
func (q *Queue[T]) Waiting() []T {
	q.mu.Lock()
	defer q.mu.Unlock()
	return slices.Clone(q.waiting)
}
