package worker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/taskevent"
)

// stressState is what TestRunGroupsUnderRandomLoad observed.
type stressState struct {
	mu        sync.Mutex
	active    map[string]bool
	seen      map[*job]int
	returned  map[*job]bool
	violation []string
}

func (s *stressState) bad(f string, a ...any) {
	s.violation = append(s.violation, fmt.Sprintf(f, a...))
}

// Many partitions submit random runs (overlapping tasks, a record that is
// not fresh in about one run in 30, about one run in 6 with a context that
// ends within 200 µs) to groups of random bounds: no task is ever in two
// groups at once, no job is processed after its run's outcomes were
// returned, every run gets its own outcomes (none for a run with a stale
// record; none only when its context ended), nothing hangs, and the groups
// end idle. (From the second review of groups.go.)
func TestRunGroupsUnderRandomLoad(t *testing.T) {
	t.Parallel()
	for iter := 0; iter < 10; iter++ {
		seed := uint64(iter)
		rng := rand.New(rand.NewPCG(seed, 99))
		st := &stressState{active: map[string]bool{}, seen: map[*job]int{}, returned: map[*job]bool{}}
		process := func(jobs []*job) ([]string, int) {
			st.mu.Lock()
			for _, j := range jobs {
				if st.active[j.ev.TaskID] {
					st.bad("task %s in two groups at once", j.ev.TaskID)
				}
				st.active[j.ev.TaskID] = true
				st.seen[j]++
				if st.returned[j] {
					st.bad("job of task %s processed after its do returned", j.ev.TaskID)
				}
			}
			st.mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
			stale := -1
			done := make([]string, len(jobs))
			for i, j := range jobs {
				if strings.HasPrefix(j.sha, "stale") {
					stale = i
					break
				}
			}
			for i, j := range jobs {
				done[i] = "ok:" + j.ev.TaskID // also when stale: never to be handed out
			}
			st.mu.Lock()
			for _, j := range jobs {
				delete(st.active, j.ev.TaskID)
			}
			st.mu.Unlock()
			return done, stale
		}
		g := newRunGroups(1+rng.IntN(3), 2+rng.IntN(8), process)
		parts := 2 + rng.IntN(10)
		var wg sync.WaitGroup
		for p := 0; p < parts; p++ {
			prng := rand.New(rand.NewPCG(seed, uint64(p)))
			wg.Go(func() {
				for r := 0; r < 200; r++ {
					n := 1 + prng.IntN(5)
					run := make([]*job, 0, n)
					used := map[string]bool{}
					hasStale := false
					for len(run) < n {
						id := fmt.Sprintf("t%d", prng.IntN(40))
						if used[id] {
							continue
						}
						used[id] = true
						sha := "fresh"
						if prng.IntN(30) == 0 {
							sha, hasStale = "stale", true
						}
						run = append(run, &job{ev: &taskevent.Event{TaskID: id}, sha: sha})
					}
					ctx, cancel := context.Background(), func() {}
					cancelled := false
					if prng.IntN(6) == 0 {
						ctx, cancel = context.WithTimeout(context.Background(), time.Duration(prng.IntN(200))*time.Microsecond)
						cancelled = true
					}
					done := g.do(ctx, run)
					cancel()
					st.mu.Lock()
					seen := 0
					for _, j := range run {
						st.returned[j] = true
						seen += st.seen[j]
					}
					if done == nil && cancelled {
						st.mu.Unlock()
						continue // nothing of it written: left the queue, or its group rolled back
					}
					if len(done) != len(run) {
						st.bad("outcomes %d for %d jobs", len(done), len(run))
					}
					for i, j := range run {
						switch {
						case hasStale && done[i] != "":
							st.bad("stale run got outcome %q", done[i])
						case !hasStale && done[i] != "" && done[i] != "ok:"+j.ev.TaskID:
							st.bad("wrong outcome %q for %s", done[i], j.ev.TaskID)
						case !hasStale && done[i] == "" && !cancelled:
							st.bad("fresh run without outcome (cancelled=%v seen=%d)", cancelled, seen)
						}
					}
					st.mu.Unlock()
				}
			})
		}
		ch := make(chan struct{})
		go func() { wg.Wait(); close(ch) }()
		select {
		case <-ch:
		case <-time.After(waitFor):
			t.Fatalf("iter %d: hang (max %d, maxJobs %d, parts %d)", iter, g.q.Max, g.maxJobs, parts)
		}
		wantIdle(t, g)
		st.mu.Lock()
		if len(st.violation) > 0 {
			t.Fatalf("iter %d: %d violations, first: %v", iter, len(st.violation), st.violation[:min(5, len(st.violation))])
		}
		st.mu.Unlock()
	}
}
