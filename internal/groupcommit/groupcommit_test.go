package groupcommit_test

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/groupcommit"
)

// item is a submission: its name, and where its answer goes.
type item struct {
	name   string
	answer chan int // the size of the group that processed it
}

func newItem(name string) *item { return &item{name: name, answer: make(chan int, 1)} }

// queue returns a queue of at most max groups of at most maxBatch items
// whose Process records each group's names and, while hold is open, waits
// for it to close.
func queue(max, maxBatch int, hold chan struct{}) (*groupcommit.Queue[*item], func() [][]string) {
	var mu sync.Mutex
	var groups [][]string
	q := &groupcommit.Queue[*item]{
		Max: max,
		Take: func(w []*item) ([]*item, []*item) {
			n := min(len(w), maxBatch)
			return slices.Clone(w[:n]), slices.Delete(w, 0, n)
		},
		Process: func(group []*item) {
			var names []string
			for _, x := range group {
				names = append(names, x.name)
			}
			mu.Lock()
			groups = append(groups, names)
			mu.Unlock()
			if hold != nil {
				<-hold
			}
			for _, x := range group {
				x.answer <- len(group)
			}
		},
	}
	return q, func() [][]string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(groups)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// A quiet queue processes each submission at once, alone.
func TestASubmissionAloneIsProcessedAtOnce(t *testing.T) {
	q, groups := queue(2, 8, nil)
	for _, name := range []string{"a", "b", "c"} {
		x := newItem(name)
		q.Submit(x)
		if n := <-x.answer; n != 1 {
			t.Fatalf("%s processed in a group of %d, want alone", name, n)
		}
	}
	if got := groups(); !slices.EqualFunc(got, [][]string{{"a"}, {"b"}, {"c"}}, slices.Equal) {
		t.Fatalf("groups %v", got)
	}
	eventually(t, "the queue idle", q.Idle)
}

// Submissions that arrive while Max groups run wait, and are then taken
// together, in their order, within Take's bound.
func TestSubmissionsWhileBusyShareAGroup(t *testing.T) {
	hold := make(chan struct{})
	q, groups := queue(1, 3, hold)
	first := newItem("first")
	q.Submit(first)
	eventually(t, "the first group running", func() bool { return len(groups()) == 1 })
	var rest []*item
	for _, name := range []string{"b", "c", "d", "e"} {
		x := newItem(name)
		rest = append(rest, x)
		q.Submit(x)
	}
	if got := len(q.Waiting()); got != 4 {
		t.Fatalf("%d waiting, want 4", got)
	}
	close(hold)
	<-first.answer
	for i, x := range rest {
		want := 3
		if i == 3 {
			want = 1
		}
		if n := <-x.answer; n != want {
			t.Fatalf("%s in a group of %d, want %d", x.name, n, want)
		}
	}
	if got := groups(); !slices.EqualFunc(got, [][]string{{"first"}, {"b", "c", "d"}, {"e"}}, slices.Equal) {
		t.Fatalf("groups %v", got)
	}
	eventually(t, "the queue idle", q.Idle)
}

// Max groups run at once, and no more.
func TestMaxGroupsRunAtOnce(t *testing.T) {
	hold := make(chan struct{})
	q, groups := queue(2, 1, hold)
	xs := []*item{newItem("a"), newItem("b"), newItem("c")}
	for _, x := range xs {
		q.Submit(x)
	}
	eventually(t, "two groups running", func() bool { return len(groups()) == 2 })
	time.Sleep(20 * time.Millisecond)
	if n := len(groups()); n != 2 {
		t.Fatalf("%d groups started while 2 run, want 2", n)
	}
	close(hold)
	for _, x := range xs {
		<-x.answer
	}
	eventually(t, "the queue idle", q.Idle)
}

// Withdraw removes an item no group took (it is never processed) and
// leaves one a group took (it is answered).
func TestWithdraw(t *testing.T) {
	hold := make(chan struct{})
	q, groups := queue(1, 8, hold)
	taken, waiting := newItem("taken"), newItem("waiting")
	q.Submit(taken)
	eventually(t, "the first group running", func() bool { return len(groups()) == 1 })
	q.Submit(waiting)
	if q.Withdraw(taken) {
		t.Fatal("Withdraw of a taken item reported it withdrawn")
	}
	if !q.Withdraw(waiting) {
		t.Fatal("Withdraw of a waiting item reported it taken")
	}
	if q.Withdraw(waiting) {
		t.Fatal("a second Withdraw reported it withdrawn again")
	}
	close(hold)
	<-taken.answer
	eventually(t, "the queue idle", q.Idle)
	if got := groups(); !slices.EqualFunc(got, [][]string{{"taken"}}, slices.Equal) {
		t.Fatalf("groups %v: the withdrawn item was processed", got)
	}
}

// Done runs after each group's Process, with the group Take returned, and
// a Take that leaves everything waiting (what waits is reserved by the
// running group) is retried after that group's Done.
func TestDoneReleasesWhatTakeReserved(t *testing.T) {
	hold := make(chan struct{})
	var reserved map[string]bool // guarded by the queue's lock (Take, Done)
	var done [][]string
	q := &groupcommit.Queue[*item]{Max: 2,
		Take: func(w []*item) (group, rest []*item) {
			if reserved == nil {
				reserved = map[string]bool{}
			}
			for _, x := range w {
				if reserved[x.name] {
					rest = append(rest, x)
					continue
				}
				reserved[x.name] = true
				group = append(group, x)
			}
			return group, rest
		},
		Process: func(group []*item) {
			if group[0].answer == nil {
				<-hold
			}
			for _, x := range group {
				if x.answer != nil {
					x.answer <- len(group)
				}
			}
		},
		Done: func(group []*item) {
			var names []string
			for _, x := range group {
				delete(reserved, x.name)
				names = append(names, x.name)
			}
			done = append(done, names)
		},
	}
	q.Submit(&item{name: "k"}) // held: a nil answer channel
	eventually(t, "k running", func() bool { return len(q.Waiting()) == 0 && !q.Idle() })
	again := newItem("k") // the same name: not takeable while the first k runs
	q.Submit(again)
	time.Sleep(20 * time.Millisecond)
	if len(q.Waiting()) != 1 {
		t.Fatal("the second k was taken while the first ran")
	}
	close(hold)
	if n := <-again.answer; n != 1 {
		t.Fatalf("second k in a group of %d", n)
	}
	eventually(t, "the queue idle", q.Idle)
	if !slices.EqualFunc(done, [][]string{{"k"}, {"k"}}, slices.Equal) {
		t.Fatalf("Done saw %v", done)
	}
}
