package worker

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

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

// The runs submitted while the groups are busy wait, and are processed
// together: one group for all of them, in submission order, within
// MaxBatchRecords records, of distinct tasks (a run sharing a task with
// the group waits for the next one); each run gets its own jobs' outcomes.
func TestRunsSubmittedWhileBusyShareAGroup(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var mu sync.Mutex
	var groups [][]string // each group's task ids
	g := &runGroups{max: 1, maxJobs: 6, process: func(jobs []*job) []string {
		var ids []string
		done := make([]string, len(jobs))
		for i, j := range jobs {
			ids = append(ids, j.ev.TaskID)
			done[i] = "ok:" + j.ev.TaskID
		}
		mu.Lock()
		groups = append(groups, ids)
		first := len(groups) == 1
		mu.Unlock()
		if first {
			<-release // busy, while the other runs are submitted
		}
		return done
	}}
	runs := map[string][]*job{
		"first": testRun("first", 1),
		"a":     testRun("a", 2),
		"b":     testRun("b", 3),
		"c":     testRun("c", 2),      // does not fit with a and b (6 records): the next group
		"d":     {testRun("a", 1)[0]}, // shares task a-0 with a: the next group
	}
	outcomes := map[string][]string{}
	var wg sync.WaitGroup
	submit := func(name string) {
		wg.Go(func() {
			done := g.do(runs[name])
			mu.Lock()
			outcomes[name] = done
			mu.Unlock()
		})
	}
	submit("first")
	testenv.Eventually(t, waitFor, "the first group busy", func() bool { mu.Lock(); defer mu.Unlock(); return len(groups) == 1 })
	for _, name := range []string{"a", "b", "c", "d"} {
		submit(name)
		// in this order: each is waiting before the next
		testenv.Eventually(t, waitFor, "run "+name+" waiting", func() bool {
			g.mu.Lock()
			defer g.mu.Unlock()
			return len(g.waiting) > 0 && g.waiting[len(g.waiting)-1].run[0] == runs[name][0]
		})
	}
	close(release)
	wg.Wait()

	want := [][]string{{"first-0"}, {"a-0", "a-1", "b-0", "b-1", "b-2"}, {"c-0", "c-1", "a-0"}}
	if !slices.EqualFunc(groups, want, slices.Equal) {
		t.Errorf("groups %v, want %v", groups, want)
	}
	for name, run := range runs {
		for i, j := range run {
			if got := outcomes[name]; len(got) != len(run) || got[i] != "ok:"+j.ev.TaskID {
				t.Errorf("run %s: outcomes %v, want one per job in order", name, got)
			}
		}
	}
	testenv.Eventually(t, waitFor, "no group active, no run waiting", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.active == 0 && len(g.waiting) == 0
	})
}

// A run submitted while fewer than RunGroups groups are busy is processed
// at once: groups never wait for each other.
func TestRunGroupsRunAtOnce(t *testing.T) {
	t.Parallel()
	started := make(chan struct{}, 2)
	release := make(chan struct{})
	g := &runGroups{max: 2, maxJobs: 64, process: func(jobs []*job) []string {
		started <- struct{}{}
		<-release
		return make([]string, len(jobs))
	}}
	var wg sync.WaitGroup
	for _, name := range []string{"x", "y"} {
		wg.Go(func() { g.do(testRun(name, 2)) })
		select {
		case <-started:
		case <-time.After(waitFor):
			t.Fatalf("run %s, submitted while fewer than two groups are busy: not processed at once", name)
		}
	}
	close(release)
	wg.Wait()
}
