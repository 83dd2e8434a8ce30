// Package fault provides named fault points: places in converge's code where
// a test or `converge experiment` can make a step fail, crash the process, or
// corrupt data on purpose, to prove that the system converges anyway.
//
// Fault points are off by default. A component holds a *Set (nil when no
// faults are configured) and calls s.Hit(name) at each point; on a nil Set,
// Hit is a nil check and returns ActionNone, so points cost nothing when off.
//
// A Set is configured from a spec string (CONVERGE_FAULTS or --faults):
//
//	name=action[@n][#key][,name=action[@n][#key]...]
//
// where action is "error" (the step returns ErrInjected), "crash" (the
// process exits at once with status 137, running no deferred code), or
// "corrupt" (a point that writes data alters it), and @n fires only on the
// n-th hit (1-based); without @n the point fires on every hit.
//
// #key restricts a rule to the passes whose key matches: points that act on
// one task pass its keys to HitKey/ErrKey — the task id and the task's
// input_sha256 (the SHA-256 of the document's RFC 8785 form, known before
// the task exists). Passes with other keys, and Hit calls without keys, are
// not counted for @n. Example: a poison message for one document,
//
//	worker.process-error=error#<input_sha256 or task_id>
//
// Hit on a nil *Set is a nil check: off costs nothing.
package fault

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Action is what a fault point does when it fires.
type Action int

const (
	// ActionNone: the point does not fire.
	ActionNone Action = iota
	// ActionError: the step fails with ErrInjected.
	ActionError
	// ActionCrash: the process ends at once (os.Exit(137)).
	ActionCrash
	// ActionCorrupt: the data written at this point is altered.
	ActionCorrupt
)

func (a Action) String() string {
	switch a {
	case ActionError:
		return "error"
	case ActionCrash:
		return "crash"
	case ActionCorrupt:
		return "corrupt"
	default:
		return "none"
	}
}

// ErrInjected is returned (wrapped) by a step whose fault point fired with
// ActionError.
var ErrInjected = errors.New("injected fault")

// Known fault point names. Components call Hit with these constants; the
// spec parser rejects any other name, so a typo cannot silently disable an
// experiment.
const (
	// RelayAfterAckBeforeConfirm: the relay got Kafka's acknowledgement and
	// recorded the transaction published (outbox_published_transaction),
	// but has not advanced the replication slot.
	RelayAfterAckBeforeConfirm = "relay.after-ack-before-confirm"
	// RelayBeforeMarkPublished: Kafka acknowledged, the transaction not yet
	// recorded published (the name predates migration 00015, when the relay
	// set published_at on each row; kept for the experiments that arm it).
	RelayBeforeMarkPublished = "relay.before-mark-published"
	// WorkerAfterArtifactWrite: the artifact is written, the completion
	// transaction has not run.
	WorkerAfterArtifactWrite = "worker.after-artifact-write"
	// WorkerBeforeOffsetCommit: the completion transaction committed, the
	// Kafka offset is not committed (the ack is lost).
	WorkerBeforeOffsetCommit = "worker.before-offset-commit"
	// ArtifactPutTimeoutAfterCommit: the store durably wrote the artifact
	// but the caller sees a timeout.
	ArtifactPutTimeoutAfterCommit = "artifact.put-timeout-after-commit"
	// ArtifactCorruptAfterWrite: the stored bytes are altered after the
	// write (use action "corrupt").
	ArtifactCorruptAfterWrite = "artifact.corrupt-after-write"
	// APIAfterCommitResponseLost: the create transaction committed, the
	// response is not sent (the connection is closed).
	APIAfterCommitResponseLost = "api.after-commit-response-lost"
	// APICreateGroupAbort: a create transaction of several requests (the
	// API's group commit) inserted their idempotency records and fails
	// before its COMMIT: nothing of it is committed, and each request runs
	// alone.
	APICreateGroupAbort = "api.create-group-abort"
	// RelayPublishConfirmLost: Kafka acknowledged a record but the relay
	// sees a produce error (the publisher confirm is lost): Run fails and a
	// restart republishes from the slot (seed 13.2, experiment 1).
	RelayPublishConfirmLost = "relay.publish-confirm-lost"
	// CacheWriteError: a task view write (projector Put, API back-fill,
	// reconciler repair) or an invalidation (DEL) fails before reaching
	// Redis (seed 14, "cache invalidation fails"). Keys: task id, input
	// SHA-256.
	CacheWriteError = "cache.write-error"
	// WorkerProcessError: a deterministic processing error (a poison
	// message, seed 13.5) for the task events of a task. Keys: task id,
	// input SHA-256. Use with #key to poison one task.
	WorkerProcessError = "worker.process-error"
	// ArtifactHideTimeoutAfterCommit: the store hid an object (a
	// compensation) but the caller sees a timeout (seed 14, "compensation
	// times out").
	ArtifactHideTimeoutAfterCommit = "artifact.hide-timeout-after-commit"
	// RetentionAfterDeletePlanned: the retention of a task wrote the
	// artifact.delete ledger row of an artifact; the file is not removed
	// yet. Keys: task id.
	RetentionAfterDeletePlanned = "retention.after-delete-planned"
	// RetentionAfterArtifactDelete: the retention of a task removed an
	// artifact's file; the artifact.delete effect is not verified yet.
	// Keys: task id.
	RetentionAfterArtifactDelete = "retention.after-artifact-delete"
)

var known = map[string]bool{
	RelayAfterAckBeforeConfirm:     true,
	RelayBeforeMarkPublished:       true,
	WorkerAfterArtifactWrite:       true,
	WorkerBeforeOffsetCommit:       true,
	ArtifactPutTimeoutAfterCommit:  true,
	ArtifactCorruptAfterWrite:      true,
	APIAfterCommitResponseLost:     true,
	APICreateGroupAbort:            true,
	RelayPublishConfirmLost:        true,
	CacheWriteError:                true,
	WorkerProcessError:             true,
	ArtifactHideTimeoutAfterCommit: true,
	RetentionAfterDeletePlanned:    true,
	RetentionAfterArtifactDelete:   true,
}

// Names returns the known fault point names, sorted.
func Names() []string {
	out := make([]string, 0, len(known))
	for n := range known {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

type rule struct {
	action Action
	nth    int    // 0: every hit
	key    string // "": any pass
	hits   int
}

// Set is a configured collection of armed fault points. The zero value and
// nil are valid and have no point armed. A Set is safe for concurrent use.
type Set struct {
	mu    sync.Mutex
	rules map[string][]*rule // per point; one rule per key
	fired map[string]int
	// Exit ends the process for ActionCrash; tests replace it. Defaults to
	// os.Exit.
	Exit func(code int)
}

// Parse builds a Set from a spec (see the package doc). An empty spec gives a
// nil Set.
func Parse(spec string) (*Set, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	s := &Set{}
	for _, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		name, act, ok := strings.Cut(part, "=")
		if !ok {
			return nil, fmt.Errorf("fault spec %q: want name=action", part)
		}
		nth, key := 0, ""
		if a, k, ok := strings.Cut(act, "#"); ok {
			if k == "" {
				return nil, fmt.Errorf("fault spec %q: #key must not be empty", part)
			}
			act, key = a, k
		}
		if a, n, ok := strings.Cut(act, "@"); ok {
			v, err := strconv.Atoi(n)
			if err != nil || v < 1 {
				return nil, fmt.Errorf("fault spec %q: @n must be a positive integer", part)
			}
			act, nth = a, v
		}
		var action Action
		switch act {
		case "error":
			action = ActionError
		case "crash":
			action = ActionCrash
		case "corrupt":
			action = ActionCorrupt
		default:
			return nil, fmt.Errorf("fault spec %q: unknown action %q (error, crash, corrupt)", part, act)
		}
		if err := s.ArmKey(name, action, nth, key); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Arm arms point name with action, firing on the nth hit only (nth >= 1) or
// on every hit (nth == 0). Unknown names are an error.
func (s *Set) Arm(name string, action Action, nth int) error {
	return s.ArmKey(name, action, nth, "")
}

// ArmKey is Arm restricted to the passes of HitKey/ErrKey that carry key
// (key "" matches every pass).
func (s *Set) ArmKey(name string, action Action, nth int, key string) error {
	if !known[name] {
		return fmt.Errorf("unknown fault point %q (known: %s)", name, strings.Join(Names(), ", "))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rules == nil {
		s.rules = map[string][]*rule{}
	}
	nr := &rule{action: action, nth: nth, key: key}
	for i, r := range s.rules[name] {
		if r.key == key { // re-arming the same point and key replaces the rule
			s.rules[name][i] = nr
			return nil
		}
	}
	s.rules[name] = append(s.rules[name], nr)
	return nil
}

// String describes the armed rules in the spec grammar, sorted ("" when none
// is armed), for the start-up log: an armed fault must never go unnoticed.
func (s *Set) String() string {
	if s == nil {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for name, rs := range s.rules {
		for _, r := range rs {
			x := name + "=" + r.action.String()
			if r.nth != 0 {
				x += "@" + strconv.Itoa(r.nth)
			}
			if r.key != "" {
				x += "#" + r.key
			}
			out = append(out, x)
		}
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

// Disarm removes every rule of point name.
func (s *Set) Disarm(name string) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.rules, name)
}

// Hit records a pass through point name and returns the action to take.
// ActionCrash never returns: the process exits with status 137.
func (s *Set) Hit(name string) Action {
	if s == nil {
		return ActionNone
	}
	return s.hit(name, nil)
}

// HitKey is Hit for a pass that concerns the given keys (for example a
// task id and an input SHA-256): a rule armed with #key fires only when one
// of keys equals it.
func (s *Set) HitKey(name string, keys ...string) Action {
	if s == nil {
		return ActionNone
	}
	return s.hit(name, keys)
}

func (s *Set) hit(name string, keys []string) Action {
	s.mu.Lock()
	var r *rule
	for _, c := range s.rules[name] {
		if c.key != "" && !slices.Contains(keys, c.key) {
			continue
		}
		c.hits++
		if r == nil && (c.nth == 0 || c.hits == c.nth) {
			r = c
		}
	}
	if r == nil {
		s.mu.Unlock()
		return ActionNone
	}
	if s.fired == nil {
		s.fired = map[string]int{}
	}
	s.fired[name]++
	exit := s.Exit
	s.mu.Unlock()
	if r.action == ActionCrash {
		if exit == nil {
			exit = os.Exit
		}
		fmt.Fprintf(os.Stderr, "converge: fault point %s: crashing the process\n", name)
		exit(137)
	}
	return r.action
}

// Err is Hit for points whose only meaningful actions are error and crash:
// it returns a wrapped ErrInjected when the point fires, nil otherwise.
func (s *Set) Err(name string) error {
	if s.Hit(name) != ActionNone {
		return fmt.Errorf("%s: %w", name, ErrInjected)
	}
	return nil
}

// ErrKey is Err for HitKey.
func (s *Set) ErrKey(name string, keys ...string) error {
	if s.HitKey(name, keys...) != ActionNone {
		return fmt.Errorf("%s: %w", name, ErrInjected)
	}
	return nil
}

// Fired returns how many times point name fired.
func (s *Set) Fired(name string) int {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fired[name]
}
