package worker

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

// testRun is a run of n jobs of the tasks prefix-0 … prefix-(n-1).
func testRun(prefix string, n int) []*job {
	run := make([]*job, n)
	for i := range run {
		run[i] = &job{ev: &taskevent.Event{TaskID: fmt.Sprintf("%s-%d", prefix, i)}}
	}
	return run
}

// groupRecorder is a runGroups' process function for tests: it records each
// group's task ids, answers "ok:<task id>" for every job, or stale for the
// first job whose task id starts with "stale", and holds the groups whose
// first task is in hold until that task's channel is closed.
type groupRecorder struct {
	mu     sync.Mutex
	groups [][]string
	hold   map[string]chan struct{}
}

func (r *groupRecorder) process(jobs []*job) ([]string, int) {
	var ids []string
	done := make([]string, len(jobs))
	stale := -1
	for i, j := range jobs {
		ids = append(ids, j.ev.TaskID)
		if stale < 0 && strings.HasPrefix(j.ev.TaskID, "stale") {
			stale = i
		}
	}
	r.mu.Lock()
	r.groups = append(r.groups, ids)
	r.mu.Unlock()
	if ch := r.hold[ids[0]]; ch != nil {
		<-ch
	}
	for i, id := range ids {
		done[i] = "ok:" + id
	}
	if stale >= 0 {
		// processGroup answers no outcome then; the combiner must not
		// hand out any of these.
		return done, stale
	}
	return done, -1
}

func (r *groupRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.groups)
}

// recordedGroups returns groups of at most max at once and maxJobs records
// whose process function is a groupRecorder holding the groups whose first
// task is in hold until its channel is closed.
func recordedGroups(max, maxJobs int, hold map[string]chan struct{}) (*runGroups, *groupRecorder) {
	r := &groupRecorder{hold: hold}
	return newRunGroups(max, maxJobs, r.process), r
}

// submitCancellable submits run with a context of its own, waits until it
// waits in g's queue, and returns the context's cancel and where do's
// answer arrives.
func submitCancellable(t *testing.T, g *runGroups, run []*job) (context.CancelFunc, <-chan []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan []string, 1)
	go func() { got <- g.do(ctx, run) }()
	testenv.Eventually(t, waitFor, "the run waiting", func() bool {
		return slices.ContainsFunc(g.q.Waiting(), func(s *submittedRun) bool { return s.run[0] == run[0] })
	})
	return cancel, got
}

// submitAll submits each named run of runs, in order, each once the one
// before it waits in g's queue (a busy group holds the others back), and
// returns a function that waits for their outcomes.
func submitAll(t *testing.T, g *runGroups, runs map[string][]*job, names ...string) func() map[string][]string {
	t.Helper()
	var mu sync.Mutex
	outcomes := map[string][]string{}
	var wg sync.WaitGroup
	for _, name := range names {
		wg.Go(func() {
			done := g.do(context.Background(), runs[name])
			mu.Lock()
			outcomes[name] = done
			mu.Unlock()
		})
		testenv.Eventually(t, waitFor, "run "+name+" waiting", func() bool {
			return slices.ContainsFunc(g.q.Waiting(), func(s *submittedRun) bool { return s.run[0] == runs[name][0] })
		})
	}
	return func() map[string][]string { wg.Wait(); return outcomes }
}

// submitFirst submits run and waits until a group processes it (r records
// its first group), and returns a function that waits for its outcomes.
func submitFirst(t *testing.T, g *runGroups, r *groupRecorder, run []*job) func() {
	t.Helper()
	var wg sync.WaitGroup
	wg.Go(func() { g.do(context.Background(), run) })
	testenv.Eventually(t, waitFor, "the first group busy", func() bool { return r.count() == 1 })
	return wg.Wait
}

// wantIdle checks that g ends with no group active, no run waiting and no
// task busy.
func wantIdle(t *testing.T, g *runGroups) {
	t.Helper()
	testenv.Eventually(t, waitFor, "no group active, no run waiting, no task busy", func() bool {
		if !g.q.Idle() {
			return false
		}
		g.mu.Lock() // not inside Idle: take and release lock it inside the queue's lock
		defer g.mu.Unlock()
		return len(g.busy) == 0
	})
}

// The runs submitted while the groups are busy wait, and are processed
// together: one group for all of them, in submission order, within
// MaxBatchRecords records, of distinct tasks (a run sharing a task with
// the group waits for the next one); each run gets its own jobs' outcomes.
func TestRunsSubmittedWhileBusyShareAGroup(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	g, r := recordedGroups(1, 6, map[string]chan struct{}{"first-0": release})
	runs := map[string][]*job{
		"first": testRun("first", 1),
		"a":     testRun("a", 2),
		"b":     testRun("b", 3),
		"c":     testRun("c", 2),      // does not fit with a and b (6 records): the next group
		"d":     {testRun("a", 1)[0]}, // shares task a-0 with a: the next group
	}
	wait := submitFirst(t, g, r, runs["first"])
	waitRest := submitAll(t, g, runs, "a", "b", "c", "d")
	close(release)
	wait()
	outcomes := waitRest()

	want := [][]string{{"first-0"}, {"a-0", "a-1", "b-0", "b-1", "b-2"}, {"c-0", "c-1", "a-0"}}
	if !slices.EqualFunc(r.groups, want, slices.Equal) {
		t.Errorf("groups %v, want %v", r.groups, want)
	}
	for _, name := range []string{"a", "b", "c", "d"} {
		run := runs[name]
		for i, j := range run {
			if got := outcomes[name]; len(got) != len(run) || got[i] != "ok:"+j.ev.TaskID {
				t.Errorf("run %s: outcomes %v, want one per job in order", name, got)
			}
		}
	}
	wantIdle(t, g)
}

// A run submitted while fewer than RunGroups groups are busy is processed
// at once: groups never wait for each other.
func TestRunGroupsRunAtOnce(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	g, r := recordedGroups(2, 64, map[string]chan struct{}{"x-0": release, "y-0": release})
	runs := map[string][]*job{"x": testRun("x", 2), "y": testRun("y", 2)}
	var wg sync.WaitGroup
	for i, name := range []string{"x", "y"} {
		wg.Go(func() { g.do(context.Background(), runs[name]) })
		testenv.Eventually(t, waitFor, "run "+name+" processed while the other group is busy", func() bool { return r.count() == i+1 })
	}
	close(release)
	wg.Wait()
	wantIdle(t, g)
}

// A task is never in two groups at once: a run of a task that a group
// being processed holds waits until that group has ended, even while the
// other group could take it (two runs of one task come from two
// partitions only across a change of the topic's partition count).
func TestATaskIsInOneGroupAtATime(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	g, r := recordedGroups(2, 64, map[string]chan struct{}{"same-0": release})
	runs := map[string][]*job{"first": testRun("same", 1), "second": testRun("same", 1)}
	waitFirst := submitFirst(t, g, r, runs["first"])
	wait := submitAll(t, g, runs, "second")
	time.Sleep(50 * time.Millisecond) // the second group goroutine, free, must not take it
	if n := r.count(); n != 1 {
		t.Fatalf("%d groups processed while the first holds task same-0, want 1", n)
	}
	close(release)
	waitFirst()
	if got := wait()["second"]; len(got) != 1 || got[0] != "ok:same-0" {
		t.Errorf("second run's outcomes %v, want it processed after the first group", got)
	}
	wantIdle(t, g)
}

// A record that is not fresh rolls its group's intake back: its run gets
// no outcome (the per-record path takes it), and the group's other runs
// are processed again without it.
func TestAStaleRunLeavesItsGroup(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	g, r := recordedGroups(1, 64, map[string]chan struct{}{"first-0": release})
	runs := map[string][]*job{
		"first": testRun("first", 1),
		"a":     testRun("a", 2),
		"s":     append(testRun("s", 1), testRun("stale", 1)...),
		"b":     testRun("b", 1),
	}
	wait := submitFirst(t, g, r, runs["first"])
	waitRest := submitAll(t, g, runs, "a", "s", "b")
	close(release)
	wait()
	outcomes := waitRest()
	want := [][]string{{"first-0"}, {"a-0", "a-1", "s-0", "stale-0", "b-0"}, {"a-0", "a-1", "b-0"}}
	if !slices.EqualFunc(r.groups, want, slices.Equal) {
		t.Errorf("groups %v, want %v", r.groups, want)
	}
	if got := outcomes["s"]; !slices.Equal(got, []string{"", ""}) {
		t.Errorf("stale run's outcomes %q, want none (the per-record path)", got)
	}
	for _, name := range []string{"a", "b"} {
		for i, j := range runs[name] {
			if got := outcomes[name]; got[i] != "ok:"+j.ev.TaskID {
				t.Errorf("run %s: outcomes %v, want each processed", name, got)
			}
		}
	}
	wantIdle(t, g)
}

// A run whose partition's context ends while it waits leaves the queue
// unprocessed, and do says so (nil): nothing of it was written; the groups
// go on.
func TestARunLeavesTheQueueWhenItsPartitionEnds(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	g, r := recordedGroups(1, 64, map[string]chan struct{}{"first-0": release})
	runs := map[string][]*job{"first": testRun("first", 1), "revoked": testRun("revoked", 2)}
	wait := submitFirst(t, g, r, runs["first"])
	cancel, got := submitCancellable(t, g, runs["revoked"])
	cancel()
	select {
	case done := <-got:
		if done != nil {
			t.Errorf("outcomes %q, want nil (the run was never taken)", done)
		}
	case <-time.After(waitFor):
		t.Fatal("a run whose context ended still waits for a busy group")
	}
	close(release)
	wait()
	wantIdle(t, g)
	if n := r.count(); n != 1 {
		t.Errorf("%d groups processed, want 1 (the revoked run never)", n)
	}
}

// A run whose partition's context ends while its group is processed is not
// processed again when the group's intake rolls back: it leaves with nil
// (nothing of it written: its partition gives up at once) instead of
// waiting for the retry.
func TestARevokedRunIsNotProcessedAgain(t *testing.T) {
	t.Parallel()
	releaseFirst, releaseSecond := make(chan struct{}), make(chan struct{})
	g, r := recordedGroups(1, 64, map[string]chan struct{}{"first-0": releaseFirst, "a-0": releaseSecond})
	runs := map[string][]*job{"first": testRun("first", 1), "a": testRun("a", 1), "s": testRun("stale", 1), "b": testRun("b", 1)}
	wait := submitFirst(t, g, r, runs["first"])
	cancel, got := submitCancellable(t, g, runs["a"])
	waitRest := submitAll(t, g, runs, "s", "b")
	close(releaseFirst)
	testenv.Eventually(t, waitFor, "the group of a, s and b busy", func() bool { return r.count() == 2 })
	cancel() // a is taken: it waits for its group
	close(releaseSecond)
	wait()
	outcomes := waitRest()
	if done := <-got; done != nil {
		t.Errorf("revoked run's outcomes %q, want nil (nothing of it written)", done)
	}
	want := [][]string{{"first-0"}, {"a-0", "stale-0", "b-0"}, {"b-0"}}
	if !slices.EqualFunc(r.groups, want, slices.Equal) {
		t.Errorf("groups %v, want %v", r.groups, want)
	}
	if !slices.Equal(outcomes["s"], []string{""}) || !slices.Equal(outcomes["b"], []string{"ok:b-0"}) {
		t.Errorf("outcomes %q, want none for the stale run and b processed", outcomes)
	}
	wantIdle(t, g)
}

// A group of one run whose intake rolled back answers no outcome either,
// whatever the process function returned.
func TestAStaleRunAloneGetsNoOutcome(t *testing.T) {
	t.Parallel()
	g, _ := recordedGroups(1, 64, nil)
	if done := g.do(context.Background(), testRun("stale", 2)); !slices.Equal(done, []string{"", ""}) {
		t.Errorf("outcomes %q, want none (the per-record path)", done)
	}
	wantIdle(t, g)
}

// A process function answering a stale index outside its group does not
// make the group loop: every run gets no outcome (the per-record path).
func TestAStaleIndexOutsideTheGroupEndsIt(t *testing.T) {
	t.Parallel()
	calls := 0
	g := newRunGroups(1, 64, func(jobs []*job) ([]string, int) {
		calls++
		done := make([]string, len(jobs))
		for i := range done {
			done[i] = "ok"
		}
		return done, len(jobs)
	})
	if done := g.do(context.Background(), testRun("x", 2)); !slices.Equal(done, []string{"", ""}) || calls != 1 {
		t.Errorf("outcomes %q after %d calls, want none after one", done, calls)
	}
	wantIdle(t, g)
}

// A group's warnings name its records by partition and offsets, since the
// group's context is not a partition's.
func TestRecordsAttrNamesPartitionsAndOffsets(t *testing.T) {
	rec := func(p int32, off int64) *job { return &job{rec: &kgo.Record{Topic: "t", Partition: p, Offset: off}} }
	jobs := []*job{rec(2, 10), rec(2, 11), rec(2, 14), rec(0, 7), rec(1, 3), rec(1, 5)}
	got := recordsAttr(jobs).String()
	if want := "records=[count=6 offsets=t/2:10-14 t/0:7 t/1:3-5]"; got != want {
		t.Fatalf("recordsAttr = %q, want %q", got, want)
	}
}
