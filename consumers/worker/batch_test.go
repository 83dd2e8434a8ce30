package worker

import (
	"fmt"
	"testing"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// Fresh records of a poll go through runs (one intake and one completion
// transaction each); an effect that fails inside a run — here the artifact
// store times out after it committed one write — sends its record through
// the per-record path, which resolves it by observation (effect unknown,
// then verified): every task completes with one verified artifact.
func TestRunsOfFreshRecords(t *testing.T) {
	t.Parallel()
	storeFaults := &fault.Set{}
	if err := storeFaults.Arm(fault.ArtifactPutTimeoutAfterCommit, fault.ActionError, 3); err != nil {
		t.Fatal(err)
	}
	b := setup(t, storeFaults)
	const n = 40
	var tasks []created
	for i := range n {
		c := createTask(t, b.db.Pool, []byte(fmt.Sprintf(`{"run":%d}`, i)))
		tasks = append(tasks, c)
		b.produce(t, c.record())
	}
	rw := b.start(t, nil)
	b.waitCompleted(t, tasks)
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := counterValue(rw.w.m.batched); got < n/2 {
		t.Errorf("%v records through runs, want most of %d", got, n)
	}
	if got := counterValue(rw.w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Unknown))); got != 1 {
		t.Errorf("effects unknown = %v, want 1 (the timed-out write)", got)
	}
	if rw.count(OutcomeProcessed) != n || rw.count(OutcomeDeadLettered) != 0 {
		t.Errorf("processed=%v dead_lettered=%v, want %d 0", rw.count(OutcomeProcessed), rw.count(OutcomeDeadLettered), n)
	}
	for _, c := range tasks {
		if got := b.scalar(t, `SELECT count(*) FROM effect_ledger WHERE task_id = $1 AND effect_kind = 'artifact.put' AND state = 'verified'`, c.taskID); got != int64(1) {
			t.Errorf("task %s: %v verified artifacts, want 1", c.taskID, got)
		}
	}
}

// A run in which one record is not fresh (its task is running already: an
// earlier delivery stopped mid-way) rolls its intake back and every record
// goes its own way: all complete.
func TestRunWithARecordNotFreshFallsBack(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n = 12
	var tasks []created
	for i := range n {
		tasks = append(tasks, createTask(t, b.db.Pool, []byte(fmt.Sprintf(`{"fallback":%d}`, i))))
	}
	testenv.MustStartTask(t, b.db.Pool, tasks[5].taskID) // running, no inbox row: resumed
	for _, c := range tasks {
		b.produce(t, c.record())
	}
	rw := b.start(t, nil)
	b.waitCompleted(t, tasks)
	if rw.count(OutcomeProcessed) != n {
		t.Errorf("processed=%v, want %d", rw.count(OutcomeProcessed), n)
	}
}

// Events the worker ignores (here TaskCompleted, which shares the topic)
// between fresh records do not end a run: the fresh records still go
// through runs, and the ignored ones are counted and committed with them.
func TestRunsSpanIgnoredEvents(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n = 24
	var tasks []created
	for i := range n {
		c := createTask(t, b.db.Pool, []byte(fmt.Sprintf(`{"span":%d}`, i)))
		tasks = append(tasks, c)
		b.produce(t, c.record())
		ignored := c.record()
		for k, h := range ignored.Headers {
			if h.Key == taskevent.HeaderEventType {
				ignored.Headers[k].Value = []byte(taskevent.TypeTaskCompleted)
			}
		}
		b.produce(t, ignored)
	}
	rw := b.start(t, nil)
	b.waitCompleted(t, tasks)
	testenv.Eventually(t, waitFor, "offsets committed", func() bool { return b.allCommitted(t) })
	if got := counterValue(rw.w.m.batched); got < n/2 {
		t.Errorf("%v records through runs, want most of %d", got, n)
	}
	if rw.count(OutcomeProcessed) != n || rw.count(OutcomeIgnored) != n {
		t.Errorf("processed=%v ignored=%v, want %d each", rw.count(OutcomeProcessed), rw.count(OutcomeIgnored), n)
	}
}

// waitCompleted waits until every task of tasks is completed.
func (b *testBundle) waitCompleted(t *testing.T, tasks []created) {
	t.Helper()
	testenv.Eventually(t, waitFor, "every task completed", func() bool {
		for _, c := range tasks {
			if b.status(c.taskID) != taskevent.StatusCompleted {
				return false
			}
		}
		return true
	})
}
