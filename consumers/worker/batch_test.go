package worker

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
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
	// Every record through runs is counted in one group's observation.
	var h dto.Metric
	if err := rw.w.m.groups.(prometheus.Metric).Write(&h); err != nil || h.GetHistogram().GetSampleSum() != counterValue(rw.w.m.batched) ||
		h.GetHistogram().GetSampleCount() == 0 {
		t.Errorf("group records histogram %v (%v), want a sum of %v records", h.GetHistogram(), err, counterValue(rw.w.m.batched))
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
	b.processAll(t, tasks)
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

// processAll produces the TaskCreated records of tasks, starts a worker,
// waits until every task is completed and checks that each record was
// processed once.
func (b *testBundle) processAll(t *testing.T, tasks []created) *runningWorker {
	t.Helper()
	for _, c := range tasks {
		b.produce(t, c.record())
	}
	rw := b.start(t, nil)
	b.waitCompleted(t, tasks)
	if got := rw.count(OutcomeProcessed); got != float64(len(tasks)) {
		t.Errorf("processed=%v, want %d", got, len(tasks))
	}
	return rw
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

// A run takes tasks at their first attempt only: a re-opened task (a
// dead-letter replay, here at attempt 1 with its verified artifact) among
// fresh records starts attempt 2, which the run refuses, so the records go
// the per-record path, where the task resumes its attempt-1 effect instead
// of planning a second artifact (seed 7, 13.3): every task completes, the
// re-opened ones with their one effect and one object.
func TestRunRefusesTasksPastTheirFirstAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	const n = 12
	var tasks []created
	reopened := map[int]string{} // index -> artifact SHA-256
	for i := range n {
		doc := []byte(fmt.Sprintf(`{"attempt":%d}`, i))
		c := createTask(t, b.db.Pool, doc)
		tasks = append(tasks, c)
		if i != 3 && i != 8 {
			continue
		}
		out, err := canon.Transform(doc)
		if err != nil {
			t.Fatal(err)
		}
		token := artifact.Token(c.taskID, 1)
		if _, err := b.store.Put(token, c.taskID, 1, out); err != nil {
			t.Fatal(err)
		}
		if _, err := b.db.Pool.Exec(ctx, `UPDATE task SET status = 'queued', version = 3, attempt = 1 WHERE task_id = $1`, c.taskID); err != nil {
			t.Fatal(err)
		}
		if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size, observed_result_sha256)
VALUES ($1, $2, 1, 'artifact.put', $1, 'artifact://' || $1, 'verified', $3, $4, $3)`, token, c.taskID, canon.SHA256Hex(out), len(out)); err != nil {
			t.Fatal(err)
		}
		reopened[i] = canon.SHA256Hex(out)
	}
	b.processAll(t, tasks)
	for i, sha := range reopened {
		c := tasks[i]
		tk := b.task(t, c.taskID)
		if tk.Attempt != 2 || tk.ArtifactSHA256 == nil || *tk.ArtifactSHA256 != sha {
			t.Errorf("re-opened task %s: %+v, want attempt 2 completed with its attempt-1 artifact", c.taskID, tk)
		}
		if got := b.scalar(t, `SELECT count(*) FROM effect_ledger WHERE task_id = $1`, c.taskID); got != int64(1) {
			t.Errorf("re-opened task %s: %v effects, want its one verified", c.taskID, got)
		}
		if got := b.objects(t, c.taskID); got != 1 {
			t.Errorf("re-opened task %s: %d objects, want 1", c.taskID, got)
		}
	}
}

// A run's fresh effect is put without looking its token up first (Put
// does): an object already under the token — which no worker writes before
// the token's ledger row, so only a stray file can be one — is decided as
// the per-record path decides it. The same bytes are kept and verified (one
// object, task completed); other bytes fail the read-back (task failed,
// ARTIFACT_VERIFICATION_FAILED), never overwritten.
func TestRunFindsAnObjectUnderItsToken(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n, same, other = 10, 2, 6
	var tasks []created
	for i := range n {
		doc := []byte(fmt.Sprintf(`{"stray":%d}`, i))
		c := createTask(t, b.db.Pool, doc)
		tasks = append(tasks, c)
		out, err := canon.Transform(doc)
		if err != nil {
			t.Fatal(err)
		}
		switch i {
		case same:
		case other:
			out = []byte(`{"other":true}`)
		default:
			continue
		}
		if _, err := b.store.Put(artifact.Token(c.taskID, 1), c.taskID, 1, out); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range tasks {
		b.produce(t, c.record())
	}
	rw := b.start(t, nil)
	testenv.Eventually(t, waitFor, "every task terminal", func() bool {
		for _, c := range tasks {
			if s := b.task(t, c.taskID).Status; s != "completed" && s != "failed" {
				return false
			}
		}
		return true
	})
	if got := counterValue(rw.w.m.batched); got < n/2 {
		t.Errorf("%v records through runs, want most of %d", got, n)
	}
	for i, c := range tasks {
		tk := b.task(t, c.taskID)
		switch {
		case i == other:
			if tk.Status != "failed" || tk.TerminalErrorCode == nil || *tk.TerminalErrorCode != CodeArtifactVerificationFailed {
				t.Errorf("task %d with another object under its token: %+v, want failed %s", i, tk, CodeArtifactVerificationFailed)
			}
		case tk.Status != "completed":
			t.Errorf("task %d: %s, want completed", i, tk.Status)
		case b.objects(t, c.taskID) != 1:
			t.Errorf("task %d: %d objects, want 1", i, b.objects(t, c.taskID))
		}
	}
}

// The artifact is the RFC 8785 form of the task's input whether the input
// is stored in that form (what the API stores: task.CanonicalInput returns
// the bytes as they are) or as an earlier release stored it, as received
// (canonicalized by the worker), on the path of runs (every task fresh) and
// on the per-record path (every task started already, so none is fresh).
func TestArtifactIsTheCanonicalFormOfTheStoredInput(t *testing.T) {
	t.Parallel()
	docs := []string{
		`{"b":2,"a":1}`, // as received: key order
		`{ "n" : 1.0, "e" : 1e2, "s" : "\u00e9\/" }`, // as received: whitespace, numbers, escapes
		`{"a":1,"b":2}`,               // canonical already
		`[1,"é",{"y":null,"x":true}]`, // as received: nested key order
	}
	for _, path := range []string{"runs", "per record"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			var tasks []created
			want := map[string]string{}
			for _, d := range docs {
				out, err := canon.Transform([]byte(d))
				if err != nil {
					t.Fatal(err)
				}
				c := createTask(t, b.db.Pool, []byte(d))
				tasks = append(tasks, c)
				want[c.taskID] = string(out)
				if path == "per record" {
					testenv.MustStartTask(t, b.db.Pool, c.taskID) // not fresh: resumed per record
				}
			}
			rw := b.processAll(t, tasks)
			wantBatched := float64(len(tasks))
			if path == "per record" {
				wantBatched = 0
			}
			if got := counterValue(rw.w.m.batched); got != wantBatched {
				t.Errorf("%v records through runs, want %v", got, wantBatched)
			}
			for _, c := range tasks {
				r, _, err := b.store.Open(artifact.Token(c.taskID, 1))
				if err != nil {
					t.Fatalf("artifact of %s: %v", c.taskID, err)
				}
				got, _ := io.ReadAll(r)
				r.Close()
				if string(got) != want[c.taskID] {
					t.Errorf("task %s: artifact %s, want %s", c.taskID, got, want[c.taskID])
				}
			}
		})
	}
}
