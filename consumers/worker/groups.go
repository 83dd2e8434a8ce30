package worker

import "sync"

// Groups of runs (issue 11). A run is one partition's fresh records
// (batch.go); its records' size follows the partition's share of the poll,
// so with more partitions each run is smaller and every task pays a larger
// share of a run's two transactions, its round trips and its directory
// fsync (BENCHMARKS.md, session of 2026-12-07, twelfth: 4 partitions cost
// 13 % more CPU per task than 2, and 0.55 commits per task against 0.38).
// The runs that partitions submit while RunGroups groups are being
// processed wait and are then processed together, as one group (up to
// MaxBatchRecords records, whole runs, of distinct tasks): one intake
// transaction, the effects, one completion transaction — group commit, as
// the API's creates (services/api, coalescer).
//
// Nothing of a run's rules changes: each record's inbox row, task start and
// effect row are written in the group's intake transaction before its
// effect; each partition's goroutine waits for its run's outcomes and
// commits its offsets only after them; what a group leaves undone (its
// intake rolled back because one of its records is not fresh, a failed
// effect, a completion that did not apply) goes through the per-record
// path, each run's records in their partition's order, in the partition's
// own goroutine. A record off the batch path in one partition's run sends
// the other runs of its group through the per-record path too: a cost, not
// a change of outcome.

// runGroups joins the runs submitted while its groups are busy.
type runGroups struct {
	max     int // groups processed at once (RunGroups)
	maxJobs int // records of a group (MaxBatchRecords), unless its first run alone has more
	// process processes a group's jobs and returns their outcomes
	// (Worker.processGroup).
	process func(jobs []*job) []string

	mu      sync.Mutex
	waiting []*submittedRun
	active  int
}

// submittedRun is one partition's run waiting for its outcomes.
type submittedRun struct {
	run  []*job
	done []string // set before ready is closed
	// ready is closed when done is set.
	ready chan struct{}
}

// do processes run, in a group with the runs that wait with it, and returns
// its jobs' outcomes ("" for a job whose outcome is not durable).
func (g *runGroups) do(run []*job) []string {
	s := &submittedRun{run: run, ready: make(chan struct{})}
	g.mu.Lock()
	g.waiting = append(g.waiting, s)
	if g.active < g.max {
		g.active++
		go g.run()
	}
	g.mu.Unlock()
	<-s.ready
	return s.done
}

// run processes groups of the waiting runs until none waits.
func (g *runGroups) run() {
	for {
		g.mu.Lock()
		group := g.take()
		if len(group) == 0 {
			g.active--
			g.mu.Unlock()
			return
		}
		g.mu.Unlock()
		var jobs []*job
		for _, s := range group {
			jobs = append(jobs, s.run...)
		}
		done := g.process(jobs)
		for _, s := range group {
			s.done, done = done[:len(s.run):len(s.run)], done[len(s.run):]
			close(s.ready)
		}
	}
}

// take removes from g.waiting, in order, the runs of the next group: the
// first run, then each further one while the group stays within
// MaxBatchRecords records and its tasks stay distinct (a task's records
// share its partition, except across a change of the topic's partition
// count). g.mu is held.
func (g *runGroups) take() []*submittedRun {
	var group, rest []*submittedRun
	n := 0
	tasks := map[string]bool{}
	for _, s := range g.waiting {
		if len(group) > 0 && (n+len(s.run) > g.maxJobs || sharesTask(s.run, tasks)) {
			rest = append(rest, s)
			continue
		}
		group = append(group, s)
		n += len(s.run)
		for _, j := range s.run {
			tasks[j.ev.TaskID] = true
		}
	}
	g.waiting = rest
	return group
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
