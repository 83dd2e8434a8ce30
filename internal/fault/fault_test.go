package fault_test

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/converge-run/converge/internal/fault"
)

// allPoints are the exported point constants; Names must list exactly these.
var allPoints = []string{
	fault.RelayAfterAckBeforeConfirm,
	fault.RelayBeforeMarkPublished,
	fault.WorkerAfterArtifactWrite,
	fault.WorkerBeforeOffsetCommit,
	fault.ArtifactPutTimeoutAfterCommit,
	fault.ArtifactCorruptAfterWrite,
	fault.APIAfterCommitResponseLost,
	fault.APICreateGroupAbort,
	fault.RelayPublishConfirmLost,
	fault.CacheWriteError,
	fault.WorkerProcessError,
	fault.ArtifactHideTimeoutAfterCommit,
	fault.RetentionAfterDeletePlanned,
	fault.RetentionAfterArtifactDelete,
}

// hits calls s.Hit(name) n times and returns the actions.
func hits(s *fault.Set, name string, n int) []fault.Action {
	out := make([]fault.Action, n)
	for i := range out {
		out[i] = s.Hit(name)
	}
	return out
}

// noExit replaces s.Exit so a crash action cannot end the test binary.
func noExit(t *testing.T, s *fault.Set) *[]int {
	t.Helper()
	var mu sync.Mutex
	codes := &[]int{}
	s.Exit = func(code int) {
		mu.Lock()
		defer mu.Unlock()
		*codes = append(*codes, code)
	}
	return codes
}

func TestParse(t *testing.T) {
	t.Parallel()
	const (
		none    = fault.ActionNone
		errA    = fault.ActionError
		crash   = fault.ActionCrash
		corrupt = fault.ActionCorrupt
	)
	tests := []struct {
		name string
		spec string
		// want maps a point to the actions of its first hits.
		want map[string][]fault.Action
	}{
		{"every hit", "relay.before-mark-published=error",
			map[string][]fault.Action{fault.RelayBeforeMarkPublished: {errA, errA, errA}}},
		{"nth hit", "worker.after-artifact-write=crash@2",
			map[string][]fault.Action{fault.WorkerAfterArtifactWrite: {none, crash, none, none}}},
		{"first hit", "artifact.corrupt-after-write=corrupt@1",
			map[string][]fault.Action{fault.ArtifactCorruptAfterWrite: {corrupt, none, none}}},
		{"several points, spaces", "  relay.after-ack-before-confirm=error@3 , api.after-commit-response-lost=crash  ",
			map[string][]fault.Action{
				fault.RelayAfterAckBeforeConfirm: {none, none, errA, none},
				fault.APIAfterCommitResponseLost: {crash, crash},
				fault.WorkerBeforeOffsetCommit:   {none, none},
			}},
		{"last rule for a point wins", "worker.before-offset-commit=error,worker.before-offset-commit=corrupt@2",
			map[string][]fault.Action{fault.WorkerBeforeOffsetCommit: {none, corrupt, none}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, err := fault.Parse(tt.spec)
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.spec, err)
			}
			if s == nil {
				t.Fatalf("Parse(%q) = nil set", tt.spec)
			}
			noExit(t, s)
			for name, want := range tt.want {
				if got := hits(s, name, len(want)); !slices.Equal(got, want) {
					t.Errorf("%s: hits = %v, want %v", name, got, want)
				}
			}
		})
	}
}

func TestParseEmpty(t *testing.T) {
	t.Parallel()
	for _, spec := range []string{"", "   ", "\t\n"} {
		s, err := fault.Parse(spec)
		if err != nil || s != nil {
			t.Errorf("Parse(%q) = %v, %v; want nil, nil", spec, s, err)
		}
	}
}

func TestParseEveryKnownName(t *testing.T) {
	t.Parallel()
	for _, name := range fault.Names() {
		if _, err := fault.Parse(name + "=error"); err != nil {
			t.Errorf("Parse(%s=error): %v", name, err)
		}
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		spec string
		want string // substring of the error
	}{
		{"relay.nope=error", "unknown fault point"},
		{"RELAY.BEFORE-MARK-PUBLISHED=error", "unknown fault point"},
		{"relay.before-mark-published =error", "unknown fault point"},
		{"relay.before-mark-published=explode", "unknown action"},
		{"relay.before-mark-published=", "unknown action"},
		{"relay.before-mark-published=Error", "unknown action"},
		{"relay.before-mark-published=error@0", "positive integer"},
		{"relay.before-mark-published=error@-1", "positive integer"},
		{"relay.before-mark-published=error@x", "positive integer"},
		{"relay.before-mark-published=error@", "positive integer"},
		{"relay.before-mark-published=error@1@2", "positive integer"},
		{"relay.before-mark-published=error@1.5", "positive integer"},
		{"relay.before-mark-published", "want name=action"},
		{"relay.before-mark-published:error", "want name=action"},
		{"relay.before-mark-published=error,", "want name=action"},
		{",relay.before-mark-published=error", "want name=action"},
		{"relay.before-mark-published=error,worker.nope=crash", "unknown fault point"},
	}
	for _, tt := range tests {
		s, err := fault.Parse(tt.spec)
		if err == nil {
			t.Errorf("Parse(%q): no error", tt.spec)
			continue
		}
		if s != nil {
			t.Errorf("Parse(%q): non-nil set with error", tt.spec)
		}
		if !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Parse(%q): error %q, want it to mention %q", tt.spec, err, tt.want)
		}
	}
}

func TestNilSet(t *testing.T) {
	t.Parallel()
	var s *fault.Set
	for _, name := range append(slices.Clone(allPoints), "not-a-point") {
		if got := s.Hit(name); got != fault.ActionNone {
			t.Errorf("nil Hit(%s) = %v", name, got)
		}
		if err := s.Err(name); err != nil {
			t.Errorf("nil Err(%s) = %v", name, err)
		}
		if got := s.Fired(name); got != 0 {
			t.Errorf("nil Fired(%s) = %d", name, got)
		}
		s.Disarm(name) // must not panic
	}
}

func TestZeroSet(t *testing.T) {
	t.Parallel()
	var s fault.Set
	if got := s.Hit(fault.WorkerAfterArtifactWrite); got != fault.ActionNone {
		t.Errorf("zero Hit = %v", got)
	}
	s.Disarm(fault.WorkerAfterArtifactWrite)
	if err := s.Arm(fault.WorkerAfterArtifactWrite, fault.ActionError, 0); err != nil {
		t.Fatalf("Arm on zero Set: %v", err)
	}
	if got := s.Hit(fault.WorkerAfterArtifactWrite); got != fault.ActionError {
		t.Errorf("armed Hit = %v", got)
	}
}

func TestNthFiresOnce(t *testing.T) {
	t.Parallel()
	for _, nth := range []int{1, 2, 5} {
		s := &fault.Set{}
		if err := s.Arm(fault.RelayBeforeMarkPublished, fault.ActionError, nth); err != nil {
			t.Fatal(err)
		}
		got := hits(s, fault.RelayBeforeMarkPublished, 10)
		for i, a := range got {
			want := fault.ActionNone
			if i+1 == nth {
				want = fault.ActionError
			}
			if a != want {
				t.Errorf("@%d: hit %d = %v, want %v", nth, i+1, a, want)
			}
		}
		if f := s.Fired(fault.RelayBeforeMarkPublished); f != 1 {
			t.Errorf("@%d: Fired = %d, want 1", nth, f)
		}
	}
}

func TestArmResetsCount(t *testing.T) {
	t.Parallel()
	s := &fault.Set{}
	if err := s.Arm(fault.RelayBeforeMarkPublished, fault.ActionError, 2); err != nil {
		t.Fatal(err)
	}
	hits(s, fault.RelayBeforeMarkPublished, 3) // past the 2nd hit
	if err := s.Arm(fault.RelayBeforeMarkPublished, fault.ActionError, 2); err != nil {
		t.Fatal(err)
	}
	want := []fault.Action{fault.ActionNone, fault.ActionError, fault.ActionNone}
	if got := hits(s, fault.RelayBeforeMarkPublished, 3); !slices.Equal(got, want) {
		t.Errorf("after re-Arm: %v, want %v", got, want)
	}
}

func TestArmUnknown(t *testing.T) {
	t.Parallel()
	s := &fault.Set{}
	err := s.Arm("worker.after-artifact-wrote", fault.ActionError, 0)
	if err == nil {
		t.Fatal("Arm of unknown point: no error")
	}
	// The message helps the user: it lists the known points.
	if !strings.Contains(err.Error(), fault.WorkerAfterArtifactWrite) {
		t.Errorf("error %q does not list the known points", err)
	}
	if got := s.Hit("worker.after-artifact-wrote"); got != fault.ActionNone {
		t.Errorf("unknown point fires: %v", got)
	}
}

func TestErr(t *testing.T) {
	t.Parallel()
	s := &fault.Set{}
	if err := s.Arm(fault.RelayAfterAckBeforeConfirm, fault.ActionError, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.Err(fault.RelayAfterAckBeforeConfirm); err != nil {
		t.Errorf("first Err = %v, want nil", err)
	}
	err := s.Err(fault.RelayAfterAckBeforeConfirm)
	if !errors.Is(err, fault.ErrInjected) {
		t.Fatalf("second Err = %v, want ErrInjected", err)
	}
	if !strings.Contains(err.Error(), fault.RelayAfterAckBeforeConfirm) {
		t.Errorf("error %q does not name the point", err)
	}
	if err := s.Err(fault.RelayAfterAckBeforeConfirm); err != nil {
		t.Errorf("third Err = %v, want nil", err)
	}
	if err := s.Err(fault.WorkerBeforeOffsetCommit); err != nil {
		t.Errorf("Err of an unarmed point = %v", err)
	}
}

func TestFired(t *testing.T) {
	t.Parallel()
	s := &fault.Set{}
	if err := s.Arm(fault.WorkerBeforeOffsetCommit, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Arm(fault.RelayBeforeMarkPublished, fault.ActionError, 4); err != nil {
		t.Fatal(err)
	}
	hits(s, fault.WorkerBeforeOffsetCommit, 5)
	hits(s, fault.RelayBeforeMarkPublished, 3)
	hits(s, fault.APIAfterCommitResponseLost, 2) // not armed
	tests := []struct {
		name string
		want int
	}{
		{fault.WorkerBeforeOffsetCommit, 5},
		{fault.RelayBeforeMarkPublished, 0},
		{fault.APIAfterCommitResponseLost, 0},
	}
	for _, tt := range tests {
		if got := s.Fired(tt.name); got != tt.want {
			t.Errorf("Fired(%s) = %d, want %d", tt.name, got, tt.want)
		}
	}
	hits(s, fault.RelayBeforeMarkPublished, 1)
	if got := s.Fired(fault.RelayBeforeMarkPublished); got != 1 {
		t.Errorf("Fired after the 4th hit = %d, want 1", got)
	}
}

func TestCrashCallsExit(t *testing.T) {
	t.Parallel()
	s, err := fault.Parse("worker.after-artifact-write=crash@2")
	if err != nil {
		t.Fatal(err)
	}
	codes := noExit(t, s)
	if got := s.Hit(fault.WorkerAfterArtifactWrite); got != fault.ActionNone || len(*codes) != 0 {
		t.Fatalf("first hit: %v, exit codes %v", got, *codes)
	}
	s.Hit(fault.WorkerAfterArtifactWrite)
	if !slices.Equal(*codes, []int{137}) {
		t.Errorf("exit codes = %v, want [137]", *codes)
	}
	if got := s.Fired(fault.WorkerAfterArtifactWrite); got != 1 {
		t.Errorf("Fired = %d, want 1", got)
	}
}

// TestCrashExitsProcess checks the default Exit: the process ends at once
// with status 137. The test binary re-runs itself as the crashing process.
func TestCrashExitsProcess(t *testing.T) {
	t.Parallel()
	if os.Getenv("FAULT_TEST_CRASH_CHILD") == "1" {
		s, err := fault.Parse("relay.after-ack-before-confirm=crash")
		if err != nil {
			os.Exit(2)
		}
		defer os.Exit(3) // deferred code must not run
		s.Hit(fault.RelayAfterAckBeforeConfirm)
		os.Exit(4)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashExitsProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "FAULT_TEST_CRASH_CHILD=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 137 {
		t.Fatalf("child: err = %v, want exit status 137; output:\n%s", err, out)
	}
	if !strings.Contains(string(out), fault.RelayAfterAckBeforeConfirm) {
		t.Errorf("child output does not name the point:\n%s", out)
	}
}

func TestDisarm(t *testing.T) {
	t.Parallel()
	s, err := fault.Parse("relay.before-mark-published=error,worker.before-offset-commit=error")
	if err != nil {
		t.Fatal(err)
	}
	s.Disarm(fault.RelayBeforeMarkPublished)
	if got := s.Hit(fault.RelayBeforeMarkPublished); got != fault.ActionNone {
		t.Errorf("disarmed point fires: %v", got)
	}
	if got := s.Hit(fault.WorkerBeforeOffsetCommit); got != fault.ActionError {
		t.Errorf("Disarm removed another point: %v", got)
	}
	s.Disarm(fault.RelayBeforeMarkPublished) // again: no-op
	s.Disarm("not-a-point")                  // unknown: no-op
}

func TestNames(t *testing.T) {
	t.Parallel()
	got := fault.Names()
	if !slices.IsSorted(got) {
		t.Errorf("Names not sorted: %v", got)
	}
	want := slices.Sorted(slices.Values(allPoints))
	if !slices.Equal(got, want) {
		t.Errorf("Names = %v, want %v", got, want)
	}
	// The caller owns the slice.
	got[0] = "mutated"
	if fault.Names()[0] == "mutated" {
		t.Error("Names returns shared state")
	}
}

func TestActionString(t *testing.T) {
	t.Parallel()
	tests := []struct {
		a    fault.Action
		want string
	}{
		{fault.ActionNone, "none"},
		{fault.ActionError, "error"},
		{fault.ActionCrash, "crash"},
		{fault.ActionCorrupt, "corrupt"},
		{fault.Action(99), "none"},
	}
	for _, tt := range tests {
		if got := tt.a.String(); got != tt.want {
			t.Errorf("Action(%d).String() = %q, want %q", int(tt.a), got, tt.want)
		}
	}
}

// TestConcurrentHit is meant for -race: Hit, Err, Fired, Arm and Disarm from
// many goroutines, with exact counts at the end.
func TestConcurrentHit(t *testing.T) {
	t.Parallel()
	const goroutines, perG = 16, 200
	s := &fault.Set{}
	if err := s.Arm(fault.WorkerBeforeOffsetCommit, fault.ActionError, 0); err != nil {
		t.Fatal(err)
	}
	const nth = goroutines * perG / 2
	if err := s.Arm(fault.RelayBeforeMarkPublished, fault.ActionError, nth); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	nthFired := 0
	for g := range goroutines {
		wg.Go(func() {
			for range perG {
				s.Hit(fault.WorkerBeforeOffsetCommit)
				if s.Err(fault.RelayBeforeMarkPublished) != nil {
					mu.Lock()
					nthFired++
					mu.Unlock()
				}
				_ = s.Fired(fault.WorkerBeforeOffsetCommit)
				// Churn on a third point while the others are hit.
				if g%2 == 0 {
					_ = s.Arm(fault.APIAfterCommitResponseLost, fault.ActionCorrupt, 0)
				} else {
					s.Disarm(fault.APIAfterCommitResponseLost)
				}
				s.Hit(fault.APIAfterCommitResponseLost)
			}
		})
	}
	wg.Wait()
	if got := s.Fired(fault.WorkerBeforeOffsetCommit); got != goroutines*perG {
		t.Errorf("every-hit point fired %d times, want %d", got, goroutines*perG)
	}
	if nthFired != 1 || s.Fired(fault.RelayBeforeMarkPublished) != 1 {
		t.Errorf("@%d point fired %d times (Fired %d), want exactly once", nth, nthFired, s.Fired(fault.RelayBeforeMarkPublished))
	}
}

var sinkAction fault.Action

// BenchmarkHitNilSet measures the cost of a fault point when faults are off
// (the production path): a nil check.
func BenchmarkHitNilSet(b *testing.B) {
	var s *fault.Set
	var a fault.Action
	for b.Loop() {
		a = s.Hit(fault.WorkerAfterArtifactWrite)
	}
	sinkAction = a
}

// BenchmarkHitUnarmedPoint measures a configured Set passing a point that is
// not armed (a mutex and a map lookup).
func BenchmarkHitUnarmedPoint(b *testing.B) {
	s, err := fault.Parse("relay.before-mark-published=error")
	if err != nil {
		b.Fatal(err)
	}
	var a fault.Action
	for b.Loop() {
		a = s.Hit(fault.WorkerAfterArtifactWrite)
	}
	sinkAction = a
}

func TestKeyFilter(t *testing.T) {
	t.Parallel()
	s, err := fault.Parse("worker.process-error=error#task-7, cache.write-error=error@2#sha")
	if err != nil {
		t.Fatal(err)
	}
	if got := s.HitKey(fault.WorkerProcessError, "task-1", "other"); got != fault.ActionNone {
		t.Errorf("other task: %v, want none", got)
	}
	if got := s.Hit(fault.WorkerProcessError); got != fault.ActionNone {
		t.Errorf("keyless hit: %v, want none", got)
	}
	if got := s.HitKey(fault.WorkerProcessError, "task-7", "x"); got != fault.ActionError {
		t.Errorf("matching task: %v, want error", got)
	}
	if err := s.ErrKey(fault.WorkerProcessError, "x", "task-7"); !errors.Is(err, fault.ErrInjected) {
		t.Errorf("ErrKey = %v, want ErrInjected", err)
	}
	// @n counts only matching passes.
	got := []fault.Action{
		s.HitKey(fault.CacheWriteError, "nope"),
		s.HitKey(fault.CacheWriteError, "sha"),
		s.HitKey(fault.CacheWriteError, "nope"),
		s.HitKey(fault.CacheWriteError, "sha"),
		s.HitKey(fault.CacheWriteError, "sha"),
	}
	want := []fault.Action{fault.ActionNone, fault.ActionNone, fault.ActionNone, fault.ActionError, fault.ActionNone}
	if !slices.Equal(got, want) {
		t.Errorf("@2#sha: %v, want %v", got, want)
	}
	var nilSet *fault.Set
	if nilSet.HitKey(fault.WorkerProcessError, "task-7") != fault.ActionNone || nilSet.ErrKey(fault.WorkerProcessError) != nil {
		t.Error("nil set fired")
	}
	if _, err := fault.Parse("worker.process-error=error#"); err == nil {
		t.Error("empty key: want an error")
	}
}

// TestSeveralKeysOnOnePoint: two #key rules on one point both stay armed
// (poisoning two tasks); re-arming the same key replaces its rule; String
// describes what is armed.
func TestSeveralKeysOnOnePoint(t *testing.T) {
	t.Parallel()
	s, err := fault.Parse("worker.process-error=error#A,worker.process-error=error#B,worker.process-error=error@2#B")
	if err != nil {
		t.Fatal(err)
	}
	if got := s.HitKey(fault.WorkerProcessError, "A"); got != fault.ActionError {
		t.Errorf("key A: %v, want error", got)
	}
	if got := s.HitKey(fault.WorkerProcessError, "B"); got != fault.ActionNone {
		t.Errorf("key B first hit: %v, want none (its rule was replaced by @2)", got)
	}
	if got := s.HitKey(fault.WorkerProcessError, "B"); got != fault.ActionError {
		t.Errorf("key B second hit: %v, want error", got)
	}
	if got := s.HitKey(fault.WorkerProcessError, "C"); got != fault.ActionNone {
		t.Errorf("key C: %v, want none", got)
	}
	if want := "worker.process-error=error#A,worker.process-error=error@2#B"; s.String() != want {
		t.Errorf("String() = %q, want %q", s.String(), want)
	}
	var none *fault.Set
	if none.String() != "" {
		t.Error("nil set describes rules")
	}
}
