package bench

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/testenv"
)

// relayProcessEnv makes the test binary act as `converge relay` (see
// TestRelayProcess).
const relayProcessEnv = "CONVERGE_BENCH_RELAY_PROCESS"

// TestRunTiny runs every stage once at the tiny size: it proves the driver
// still works. It asserts nothing about speed.
func TestRunTiny(t *testing.T) {
	needCluster(t)
	cfg := Tiny()
	cfg.RelayCommand = []string{os.Args[0], "-test.run=^TestRelayProcess$"}
	t.Setenv(relayProcessEnv, "1")
	res := runTiny(t, cfg)
	switch {
	case len(res.Create) != len(cfg.CreateClients):
		t.Errorf("create points: %d, want %d", len(res.Create), len(cfg.CreateClients))
	case res.Relay == nil || len(res.Relay.RelayRate) != cfg.Runs:
		t.Errorf("relay result missing: %+v", res.Relay)
	case res.RSS == nil || !res.RSS.Completed || res.RSS.PeakRSSMB <= 0:
		t.Errorf("rss result incomplete: %+v", res.RSS)
	case res.Worker == nil || len(res.Worker.WorkerRate) != cfg.Runs:
		t.Errorf("worker result missing: %+v", res.Worker)
	case res.E2E == nil || len(res.E2E.Steps) != len(cfg.E2ERates):
		t.Errorf("end-to-end result missing: %+v", res.E2E)
	}
	for _, p := range res.Create {
		if p.APIMedian <= 0 || p.PgbenchMedian <= 0 || p.APIErrors != nil {
			t.Errorf("create at %d clients: %+v", p.Clients, p)
		}
	}
	wantMarkdown(t, res, "| create, 1 client |")
}

// TestRelayProcess is not a test: run by TestRunTiny as the relay
// subprocess of the RSS stage, it runs a relay configured by the CONVERGE_*
// variables that `converge relay` reads, until SIGTERM.
func TestRelayProcess(t *testing.T) {
	if os.Getenv(relayProcessEnv) == "" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	r, err := cdc.New(cdc.Config{
		DatabaseURL:     os.Getenv("CONVERGE_DATABASE_URL"),
		Brokers:         strings.Split(os.Getenv("CONVERGE_KAFKA_BROKERS"), ","),
		Topic:           os.Getenv("CONVERGE_TOPIC"),
		SlotName:        os.Getenv("CONVERGE_SLOT_NAME"),
		PublicationName: os.Getenv("CONVERGE_PUBLICATION_NAME"),
		Logger:          slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		t.Fatal(err)
	}
}

// needCluster skips a test that starts its own PostgreSQL cluster under
// -short, and when the server binaries or pgbench are missing (fails under
// CI=true).
func needCluster(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts its own PostgreSQL cluster; skipped with -short")
	}
	if _, err := localpg.BinDir(); err != nil {
		unavailable(t, err)
	}
	if pgbenchPath() == "pgbench" {
		unavailable(t, errors.New("pgbench not found"))
	}
}

func unavailable(t *testing.T, err error) {
	t.Helper()
	if testenv.InCI() {
		t.Fatalf("PostgreSQL tools unavailable under CI=true: %v", err)
	}
	t.Skipf("PostgreSQL tools unavailable: %v", err)
}

func TestMedian(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := median(tc.in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// TestABTiny runs the ab stage once at a tiny size, with the same freshly
// built converge on both sides: it proves the stage works (both sides
// start on the shared cluster, run at the same time and are measured). It
// asserts nothing about speed.
func TestABTiny(t *testing.T) {
	needCluster(t)
	bin := filepath.Join(t.TempDir(), "converge")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/converge-run/converge/cmd/converge").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	res := runTiny(t, Config{Stages: []string{StageAB}, Runs: 1, PeerTasks: 400, Loadgen: bin, ABBinaries: []string{bin, bin}})
	ab := res.AB
	if ab == nil || len(ab.Rounds) != 2 {
		t.Fatalf("ab result %+v, want two rounds (one asked for, made even)", ab)
	}
	for i, r := range ab.Rounds {
		if r.WindowSeconds <= 0 || r.TasksPerSec[0] <= 0 || r.TasksPerSec[1] <= 0 || r.CPUMsPerTask[0] <= 0 || r.CPUMsPerTask[1] <= 0 {
			t.Fatalf("round %d %+v: want a window in which both were completing tasks, and rates and CPU for both sides", i+1, r)
		}
	}
	if ab.Rounds[0].First == ab.Rounds[1].First {
		t.Fatalf("both rounds started side %s first, want the order alternated", ab.Rounds[0].First)
	}
	wantMarkdown(t, res, "A/B side by side")
	wantMarkdown(t, res, "(the ab stage: of 2 rounds)")
}

// runTiny runs cfg with fsync off, the components' logs discarded and a
// 4-minute limit; it fails the test when Run or a stage fails, and logs the
// progress lines at the end.
func runTiny(t *testing.T, cfg Config) *Results {
	t.Helper()
	cfg.NoFsync = true
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	var progress strings.Builder
	cfg.Progress = &progress
	t.Cleanup(func() { t.Log("\n" + progress.String()) })
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	res, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(res.Errors) > 0 {
		t.Fatalf("stages failed: %v", res.Errors)
	}
	return res
}

// wantMarkdown fails the test when res's markdown lacks want.
func wantMarkdown(t *testing.T, res *Results, want string) {
	t.Helper()
	var md strings.Builder
	res.Markdown(&md)
	if !strings.Contains(md.String(), want) {
		t.Errorf("markdown lacks %q:\n%s", want, md.String())
	}
}

// The ab stage is asked for with two executables, and only then; each is
// found before anything starts.
func TestABConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	plain := filepath.Join(dir, "not-executable")
	if err := os.WriteFile(plain, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	exe := os.Args[0] // this test binary: an executable file
	for _, tc := range []struct {
		stages, bins []string
		ok           bool
	}{
		{[]string{StageAB}, []string{exe, exe}, true},
		{[]string{StagePeer, StageAB}, []string{exe, exe}, true},
		{[]string{StageAB}, []string{"sh", exe}, true}, // found in PATH
		{[]string{StageAB}, []string{exe}, false},
		{[]string{StageAB}, nil, false},
		{[]string{StagePeer}, []string{exe, exe}, false},
		{nil, []string{exe, exe}, false}, // the default stages leave ab out
		{[]string{StageAB}, []string{exe, filepath.Join(dir, "absent")}, false},
		{[]string{StageAB}, []string{exe, dir}, false},
		{[]string{StageAB}, []string{exe, plain}, false},
	} {
		c := Config{Stages: tc.stages, ABBinaries: tc.bins}
		c.setDefaults()
		err := c.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("stages %v, binaries %v: %v, want ok %v", tc.stages, tc.bins, err, tc.ok)
		}
		for _, b := range c.ABBinaries {
			if err == nil && !filepath.IsAbs(b) {
				t.Errorf("binaries %v: %s not made absolute", tc.bins, b)
			}
		}
	}
}

// An interrupted stage's partial results are dropped (dropStage knows
// every stage): before, its unfinished runs were printed as zero medians.
func TestDropStageRemovesOnlyThatStage(t *testing.T) {
	full := func() *Results {
		return &Results{Create: []CreatePoint{{}}, Relay: &RelayResult{}, RSS: &RSSResult{}, Worker: &WorkerResult{},
			E2E: &E2EResult{}, Peer: &PeerResult{}, AB: &ABResult{}}
	}
	present := func(r *Results) map[string]bool {
		return map[string]bool{StageCreate: r.Create != nil, StageRelay: r.Relay != nil, StageRSS: r.RSS != nil,
			StageWorker: r.Worker != nil, StageE2E: r.E2E != nil, StagePeer: r.Peer != nil, StageAB: r.AB != nil}
	}
	if got := len(present(full())); got != len(knownStages) {
		t.Fatalf("the test knows %d stages, the bench %d", got, len(knownStages))
	}
	for _, s := range knownStages {
		r := full()
		r.dropStage(s)
		for stage, ok := range present(r) {
			if ok == (stage == s) {
				t.Errorf("after dropStage(%s), %s present = %v", s, stage, ok)
			}
		}
	}
}
