package worker

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/converge-run/converge/internal/groupcommit"
)

// Groups of runs (issue 11). A run is one partition's fresh records
// (batch.go); its size follows the partition's share of the poll,
// so with more partitions each run is smaller and every task pays a larger
// share of a run's two transactions, its round trips and its directory
// fsync (BENCHMARKS.md, session of 2026-12-07, twelfth: 4 partitions cost
// 13 % more CPU per task than 2, and 0.55 commits per task against 0.38).
// The runs that partitions submit while RunGroups groups are being
// processed wait and are then processed together, as one group (up to
// MaxBatchRecords records, whole runs, of distinct tasks, none of them a
// task of a group being processed): one intake transaction, the effects,
// one completion transaction — group commit, as the API's creates
// (services/api, coalescer), on the same queue (internal/groupcommit).
//
// Nothing of a run's rules changes: each record's inbox row, task start and
// effect row are written in the group's intake transaction before its
// effect; each partition's goroutine waits for its run's outcomes and
// commits its offsets only after them; what a group leaves undone (its
// intake rolled back because one of its records is not fresh, a failed
// effect, a completion that did not apply) goes through the per-record
// path, each run's records in their partition's order, in the partition's
// own goroutine. A record off the batch path (a redelivery, a task not
// visible yet) rolls back its group's intake; its run then goes through the
// per-record path and the group's other runs are processed again without
// it. A run whose partition's context ends while it waits (revoke, loss,
// shutdown) leaves the queue unprocessed (and is not processed again after
// its group's intake rolled back), and its partition gives up at once;
// once its group has taken it, its partition waits for its outcomes, as
// for a run before groups.

// runGroups joins the runs submitted while its groups are busy (a
// groupcommit.Queue whose groups are whole runs of distinct tasks).
type runGroups struct {
	maxJobs int // records of a group (MaxBatchRecords), unless its first run alone has more
	// process processes a group's jobs and returns their outcomes, and the
	// index of the job that made its intake roll back, or -1
	// (Worker.processGroup).
	process func(jobs []*job) (done []string, stale int)
	q       *groupcommit.Queue[*submittedRun]

	mu   sync.Mutex      // guards busy; taken inside the queue's lock (take, release)
	busy map[string]bool // the tasks of the groups taken and not yet ended
}

// newRunGroups returns the groups of runs: at most max processed at once,
// each of at most maxJobs records (unless its first run alone has more),
// processed by process.
func newRunGroups(max, maxJobs int, process func(jobs []*job) (done []string, stale int)) *runGroups {
	g := &runGroups{maxJobs: maxJobs, process: process}
	g.q = &groupcommit.Queue[*submittedRun]{Max: max, Take: g.take, Process: g.processRuns, Done: g.release}
	return g
}

// submittedRun is one partition's run waiting for its outcomes.
type submittedRun struct {
	ctx  context.Context // its partition's
	run  []*job
	done []string // set before ready is closed
	// ready is closed when done is set.
	ready chan struct{}
}

// do processes run, in a group with the runs that wait with it, and returns
// its jobs' outcomes ("" for a job whose outcome is not durable). It
// returns nil when nothing of run was written and ctx has ended: ctx ended
// before a group took run (run leaves the queue), or before its group's
// intake rolled back (run is not processed again).
func (g *runGroups) do(ctx context.Context, run []*job) []string {
	s := &submittedRun{ctx: ctx, run: run, ready: make(chan struct{})}
	g.q.Submit(s)
	select {
	case <-s.ready:
		return s.done
	case <-ctx.Done():
	}
	if g.q.Withdraw(s) {
		return nil
	}
	<-s.ready // taken: its intake may be under way
	return s.done
}

// processRuns processes the group of runs a group of the queue took and
// answers each run.
func (g *runGroups) processRuns(group []*submittedRun) {
	for len(group) > 0 {
		var jobs []*job
		for _, s := range group {
			jobs = append(jobs, s.run...)
		}
		done, stale := g.process(jobs)
		if stale >= len(jobs) {
			// Not an index of the group (processGroup never answers
			// one): no outcome is trusted, every job goes through the
			// per-record path, and the group is not processed again.
			stale, done = -1, make([]string, len(jobs))
		}
		if stale < 0 {
			for _, s := range group {
				s.done, done = done[:len(s.run):len(s.run)], done[len(s.run):]
				close(s.ready)
			}
			return
		}
		// Nothing of the group was written. A run whose partition's
		// context ended meanwhile leaves with nil (nothing written: its
		// partition gives up at once); the run of the record that is
		// not fresh goes through the per-record path (no outcome); the
		// others are processed again without them.
		var rest []*submittedRun
		for _, s := range group {
			switch {
			case s.ctx.Err() != nil:
				close(s.ready)
			case stale >= 0 && stale < len(s.run):
				s.done = make([]string, len(s.run))
				close(s.ready)
			default:
				rest = append(rest, s)
			}
			stale -= len(s.run)
		}
		group = rest
	}
}

// take returns the runs of the next group from waiting, in order, and the
// runs left waiting: each run while the group stays within maxJobs records
// (its first run excepted), and none of its tasks is in the group or in a
// group being processed (g.busy; a task's records share its partition,
// except across a change of the topic's partition count). The group's
// tasks become busy until release.
func (g *runGroups) take(waiting []*submittedRun) (group, rest []*submittedRun) {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, s := range waiting {
		if (len(group) > 0 && n+len(s.run) > g.maxJobs) || sharesTask(s.run, g.busy) {
			rest = append(rest, s)
			continue
		}
		group = append(group, s)
		n += len(s.run)
		if g.busy == nil {
			g.busy = map[string]bool{}
		}
		for _, j := range s.run {
			g.busy[j.ev.TaskID] = true
		}
	}
	return group, rest
}

// release ends the group take returned: its tasks are no longer busy.
func (g *runGroups) release(group []*submittedRun) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, s := range group {
		for _, j := range s.run {
			delete(g.busy, j.ev.TaskID)
		}
	}
}

// sharesTask reports whether a job of run is of a task in tasks.
func sharesTask(run []*job, tasks map[string]bool) bool {
	for _, j := range run {
		if tasks[j.ev.TaskID] {
			return true
		}
	}
	return false
}

// recordsAttr is the log attribute naming the records of jobs (a group's
// runs, which its warnings would otherwise not name: a group's context is
// not a partition's): "records" with their count and, per partition in
// the order met, "topic/partition:first-last offset" (one offset when the
// partition has one record), e.g. records.count=5
// records.offsets="converge.task-events.v1/0:120-122 converge.task-events.v1/3:77".
func recordsAttr(jobs []*job) slog.Attr {
	type span struct{ first, last int64 }
	type tp struct {
		topic     string
		partition int32
	}
	var order []tp
	spans := map[tp]*span{}
	for _, j := range jobs {
		k := tp{j.rec.Topic, j.rec.Partition}
		sp := spans[k]
		if sp == nil {
			sp = &span{j.rec.Offset, j.rec.Offset}
			spans[k] = sp
			order = append(order, k)
		}
		sp.first, sp.last = min(sp.first, j.rec.Offset), max(sp.last, j.rec.Offset)
	}
	var b strings.Builder
	for i, k := range order {
		if i > 0 {
			b.WriteByte(' ')
		}
		sp := spans[k]
		fmt.Fprintf(&b, "%s/%d:%d", k.topic, k.partition, sp.first)
		if sp.last != sp.first {
			fmt.Fprintf(&b, "-%d", sp.last)
		}
	}
	return slog.Group("records", slog.Int("count", len(jobs)), slog.String("offsets", b.String()))
}
