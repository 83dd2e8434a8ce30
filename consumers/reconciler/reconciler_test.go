package reconciler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/testenv"
)

type testBundle struct {
	db    *testenv.DB
	store *artifact.Store
	r     *Reconciler
}

func setup(t *testing.T, cfg Config) *testBundle {
	t.Helper()
	b := &testBundle{db: testenv.NewDB(t)}
	var err error
	b.store, err = artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Pool, cfg.ArtifactStore = b.db.Pool, b.store
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg.Registerer = prometheus.NewRegistry()
	b.r, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// effectFor creates a running task (attempt 1) and its artifact.put effect
// in state, last updated age ago, with data as the effect's request, and
// returns the effect's token.
func (b *testBundle) effectFor(t *testing.T, state ledger.State, data []byte, age time.Duration) string {
	t.Helper()
	c := testenv.MustCreateTask(t, b.db.Pool, data)
	running := testenv.MustStartTask(t, b.db.Pool, c.Task.TaskID)
	return testenv.MustPlanEffect(t, b.db.Pool, running, state, data, age).Token
}

type row struct {
	state    ledger.State
	observed *string
	code     *string
}

func (b *testBundle) effect(t *testing.T, kind ledger.Kind, token string) row {
	t.Helper()
	e := testenv.RequireEffect(t, b.db.Pool, kind, token)
	return row{state: e.State, observed: e.ObservedSHA256, code: e.ErrorCode}
}

func (b *testBundle) put(t *testing.T, token string, attempt int, data []byte) {
	t.Helper()
	taskID := token[:len(token)-len(".attempt-1")]
	if _, err := b.store.Put(token, taskID, attempt, data); err != nil {
		t.Fatal(err)
	}
}

func (b *testBundle) actions(kind string) float64 {
	var m dto.Metric
	if err := b.r.m.actions.WithLabelValues(kind).Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

func TestPassResolvesStaleEffects(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{EffectDeadline: time.Minute})
	old := time.Hour
	data := []byte(`{"a":1}`)

	present := b.effectFor(t, ledger.Started, data, old)
	b.put(t, present, 1, data)
	absent := b.effectFor(t, ledger.Unknown, data, old)
	wrongBytes := b.effectFor(t, ledger.Started, data, old)
	b.put(t, wrongBytes, 1, []byte(`{"a":2}`))
	wrongAttempt := b.effectFor(t, ledger.Unknown, data, old)
	b.put(t, wrongAttempt, 2, data)
	fresh := b.effectFor(t, ledger.Started, data, 0)
	done := b.effectFor(t, ledger.Verified, data, old)

	res, err := b.r.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := Result{Examined: 4, Verified: 1, Planned: 1, CompensationRequired: 2}
	if res != want {
		t.Errorf("Pass = %+v, want %+v", res, want)
	}
	if e := b.effect(t, ledger.KindArtifactPut, present); e.state != ledger.Verified || e.observed == nil || *e.observed != sum(data) {
		t.Errorf("present: %+v, want verified with observed hash", e)
	}
	if e := b.effect(t, ledger.KindArtifactPut, absent); e.state != ledger.Planned || e.observed != nil {
		t.Errorf("absent: %+v, want planned", e)
	}
	for _, tok := range []string{wrongBytes, wrongAttempt} {
		e := b.effect(t, ledger.KindArtifactPut, tok)
		if e.state != ledger.CompensationRequired || e.code == nil || *e.code != CodeArtifactVerificationFailed || e.observed == nil {
			t.Errorf("%s: %+v, want compensation_required with code and observed hash", tok, e)
		}
	}
	if e := b.effect(t, ledger.KindArtifactPut, fresh); e.state != ledger.Started {
		t.Errorf("fresh effect touched: %+v", e)
	}
	if e := b.effect(t, ledger.KindArtifactPut, done); e.state != ledger.Verified || e.observed != nil {
		t.Errorf("verified effect touched: %+v", e)
	}
	for kind, n := range map[string]float64{ActionVerified: 1, ActionPlanned: 1, ActionCompensationRequired: 2, ActionSkipped: 0, ActionError: 0} {
		if got := b.actions(kind); got != n {
			t.Errorf("actions{kind=%s} = %v, want %v", kind, got, n)
		}
	}

	// A second pass right away finds nothing past the deadline.
	if res, err := b.r.Pass(context.Background()); err != nil || res != (Result{}) {
		t.Errorf("second pass = %+v, %v; want nothing", res, err)
	}

	// Past the deadline, compensation_required effects are compensated.
	if _, err := b.db.Pool.Exec(context.Background(), `UPDATE effect_ledger SET updated_at = now() - interval '1 hour' WHERE state = 'compensation_required'`); err != nil {
		t.Fatal(err)
	}
	res, err = b.r.Pass(context.Background())
	if err != nil || res != (Result{Examined: 2, Compensated: 2}) {
		t.Errorf("compensation pass = %+v, %v; want 2 compensated", res, err)
	}
	for _, tok := range []string{wrongBytes, wrongAttempt} {
		if e := b.effect(t, ledger.KindArtifactPut, tok); e.state != ledger.Compensated {
			t.Errorf("%s: %s, want compensated", tok, e.state)
		}
		if h := b.effect(t, "artifact.hide", "compensation-for-"+tok); h.state != ledger.Verified {
			t.Errorf("hide of %s: %s, want verified", tok, h.state)
		}
		if _, err := b.store.Head(tok); !errors.Is(err, artifact.ErrNotFound) {
			t.Errorf("%s readable after compensation: %v", tok, err)
		}
	}
	if _, err := b.store.Head(present); err != nil {
		t.Errorf("verified artifact hidden: %v", err)
	}
}

// A pass never overwrites an effect that changed after the pass read it.
func TestPassIsCompareAndSet(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{})
	data := []byte(`[1,2]`)
	absent := b.effectFor(t, ledger.Started, data, time.Hour)
	// While the pass observes the store (and finds nothing), the worker
	// writes the artifact and records the effect verified.
	b.r.beforeRepair = func(ctx context.Context, effectID string) {
		b.put(t, absent, 1, data)
		if _, err := b.db.Pool.Exec(ctx, `UPDATE effect_ledger SET state = 'verified', observed_result_sha256 = $2 WHERE effect_id = $1`, effectID, sum(data)); err != nil {
			t.Error(err)
		}
	}
	res, err := b.r.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (Result{Examined: 1, Skipped: 1}) {
		t.Errorf("Pass = %+v, want 1 skipped", res)
	}
	if e := b.effect(t, ledger.KindArtifactPut, absent); e.state != ledger.Verified || e.observed == nil || *e.observed != sum(data) {
		t.Errorf("effect %+v, want the concurrent verified state kept", e)
	}
	if got := b.actions(ActionSkipped); got != 1 {
		t.Errorf("actions{kind=skipped} = %v, want 1", got)
	}
}

func TestPassIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{BatchSize: 2})
	for i := 0; i < 5; i++ {
		b.effectFor(t, ledger.Started, []byte(`{}`), time.Hour+time.Duration(i)*time.Minute)
	}
	for i, want := range []int{2, 2, 1, 0} {
		res, err := b.r.Pass(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.Examined != want || res.Planned != want {
			t.Errorf("pass %d: %+v, want %d examined and planned", i, res, want)
		}
	}
}

func TestRunRepairsAndStops(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{Interval: 20 * time.Millisecond})
	data := []byte(`"x"`)
	tok := b.effectFor(t, ledger.Unknown, data, time.Hour)
	b.put(t, tok, 1, data)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.r.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, "effect verified by Run", func() bool {
		return b.effect(t, ledger.KindArtifactPut, tok).state == ledger.Verified
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not stop")
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{ArtifactStore: store}); err == nil {
		t.Error("New without a database: want an error")
	}
	if _, err := New(Config{DatabaseURL: "postgres://x/y"}); err == nil {
		t.Error("New without a store: want an error")
	}
}

// At most one artifact.put effect of a task is verified (the unique index
// of migration 00003): an effect of another attempt found matching in the
// store after one is verified — the old attempt of a replayed task,
// resolved late — is superseded and its object hidden in the same pass.
func TestPassSupersedesSecondVerifiedArtifact(t *testing.T) {
	t.Parallel()
	b := setup(t, Config{EffectDeadline: time.Minute})
	ctx := context.Background()
	data := []byte(`{"one":"artifact"}`)
	first := b.effectFor(t, ledger.Verified, data, time.Hour)
	b.put(t, first, 1, data)
	taskID := first[:len(first)-len(".attempt-1")]
	second := artifact.Token(taskID, 2)
	if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state,
  request_sha256, request_size, updated_at)
VALUES ($1, $2, 2, 'artifact.put', $1, 'artifact://' || $1, 'unknown', $3, $4, now() - interval '1 hour')`,
		second, taskID, sum(data), len(data)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Put(second, taskID, 2, data); err != nil {
		t.Fatal(err)
	}
	// The constraint, not a prior SELECT, decides.
	_, err := b.db.Pool.Exec(ctx, `UPDATE effect_ledger SET state = 'verified' WHERE effect_id = $1`, second)
	if !ledger.OneVerifiedViolation(err) {
		t.Fatalf("second verified effect: %v, want a violation of %s", err, ledger.OneVerifiedIndex)
	}

	res, err := b.r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Examined: 1, Superseded: 1, Compensated: 1}); res != want {
		t.Errorf("Pass = %+v, want %+v", res, want)
	}
	if e := b.effect(t, ledger.KindArtifactPut, second); e.state != ledger.Compensated || e.code == nil || *e.code != CodeArtifactSuperseded {
		t.Errorf("second effect %+v, want compensated with %s", e, CodeArtifactSuperseded)
	}
	if h := b.effect(t, "artifact.hide", "compensation-for-"+second); h.state != ledger.Verified {
		t.Errorf("hide of the second artifact: %s, want verified", h.state)
	}
	if _, err := b.store.Head(second); !errors.Is(err, artifact.ErrNotFound) {
		t.Errorf("second artifact readable: %v", err)
	}
	if e := b.effect(t, ledger.KindArtifactPut, first); e.state != ledger.Verified {
		t.Errorf("first effect %s, want verified", e.state)
	}
	if _, err := b.store.Head(first); err != nil {
		t.Errorf("first artifact hidden: %v", err)
	}
	if n := b.actions(ActionSuperseded); n != 1 {
		t.Errorf("actions{kind=superseded} = %v, want 1", n)
	}
}
