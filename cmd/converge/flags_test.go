package main

import (
	"os"
	"strings"
	"testing"

	"github.com/alecthomas/kong"
)

// Every environment variable a converge command reads is in README's
// table of settings (its name in backquotes), so that an operator finds
// each one there.
func TestEveryEnvironmentVariableIsDocumented(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var cli CLI
	p, err := kong.New(&cli, kong.Name("converge"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, f := range n.Flags {
			for _, env := range f.Envs {
				if !seen[env] && !strings.Contains(string(readme), "`"+env+"`") {
					t.Errorf("%s (--%s of %q) is not in README.md", env, f.Name, n.Path())
				}
				seen[env] = true
			}
		}
		for _, c := range n.Children {
			walk(c)
		}
	}
	walk(p.Model.Node)
	if len(seen) < 10 {
		t.Fatalf("found %d environment variables; the walk of the flags is broken", len(seen))
	}
}

// The group commit's settings reach the commands that run the API, from
// their flags or their environment.
func TestCreateGroupSettings(t *testing.T) {
	t.Setenv("CONVERGE_CREATE_TRANSACTIONS", "3")
	for _, args := range [][]string{{"dev"}, {"api"}, {"api", "--create-transactions", "5", "--create-batch-max", "8"}} {
		cli := parseCLI(t, args...)
		got := cli.Dev.APIServer
		if args[0] == "api" {
			got = cli.API.APIServer
		}
		wantTx, wantBatch := 3, 32
		if len(args) > 1 {
			wantTx, wantBatch = 5, 8
		}
		if got.CreateTx != wantTx || got.CreateBatchMax != wantBatch {
			t.Fatalf("%v: create transactions %d, batch %d; want %d and %d", args, got.CreateTx, got.CreateBatchMax, wantTx, wantBatch)
		}
	}
}

// parseCLI parses args as converge's command line (flags and the
// environment's CONVERGE_* variables), failing the test on an error.
func parseCLI(t *testing.T, args ...string) *CLI {
	t.Helper()
	var cli CLI
	p, err := kong.New(&cli, kong.Name("converge"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Parse(args); err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	return &cli
}

// Counts of the API that are not at least 1 are refused when the command
// line is parsed, before anything starts, naming the flag and the variable
// (api.Config would take 0 for its default, and -1 was refused only after
// the embedded PostgreSQL started).
func TestAPICountsAreChecked(t *testing.T) {
	for _, args := range [][]string{
		{"dev", "--create-transactions=0"}, {"dev", "--create-batch-max=-1"}, {"api", "--max-in-flight-per-tenant=0"},
	} {
		err := parseError(t, args...)
		flag, _, _ := strings.Cut(strings.TrimPrefix(args[1], "--"), "=")
		if err == nil || !strings.Contains(err.Error(), "--"+flag) || !strings.Contains(err.Error(), "want at least 1") {
			t.Errorf("%v: %v, want it refused naming --%s", args, err, flag)
		}
	}
	t.Setenv("CONVERGE_CREATE_TRANSACTIONS", "0")
	if err := parseError(t, "api"); err == nil || !strings.Contains(err.Error(), "CONVERGE_CREATE_TRANSACTIONS") {
		t.Errorf("CONVERGE_CREATE_TRANSACTIONS=0: %v, want it refused naming the variable", err)
	}
	// The components that run no API neither take nor check its settings:
	// an environment shared by all of them, with a bad API count, stops the
	// API alone (it refused `converge worker` too).
	t.Setenv("CONVERGE_MAX_IN_FLIGHT_PER_TENANT", "0")
	for _, cmd := range []string{"worker", "relay", "projector", "reconciler"} {
		if err := parseError(t, cmd); err != nil {
			t.Errorf("%s with CONVERGE_MAX_IN_FLIGHT_PER_TENANT=0: %v, want it parsed", cmd, err)
		}
		if err := parseError(t, cmd, "--max-in-flight-per-tenant=3"); err == nil {
			t.Errorf("%s --max-in-flight-per-tenant: parsed, want the flag unknown", cmd)
		}
	}
}

// The bench's negative counts and durations are refused when the command
// line is parsed, naming the flag (-1 was silently the default); 0 and
// leaving a flag out keep the default.
func TestBenchCountsAreChecked(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "--runs=-1"}, {"bench", "--peer-tasks=-5"}, {"bench", "--create-duration=-1s"},
		{"bench", "--create-clients=4,0"}, {"bench", "--e2e-rates=100,-2"}, {"bench", "--e2e-rates=2e6"},
		{"bench", "--e2e-rates=+Inf"}, {"bench", "--e2e-rates=NaN"}, {"bench", "--e2e-rates=0.0001"},
	} {
		err := parseError(t, args...)
		flag, _, _ := strings.Cut(strings.TrimPrefix(args[1], "--"), "=")
		if err == nil || !strings.Contains(err.Error(), "--"+flag) {
			t.Errorf("%v: %v, want it refused naming --%s", args, err, flag)
		}
	}
	parseCLI(t, "bench", "--runs=0", "--peer-tasks", "100")
}

// parseError parses args as converge's command line and returns the
// parser's error (nil when args parse).
func parseError(t *testing.T, args ...string) error {
	t.Helper()
	var cli CLI
	p, err := kong.New(&cli, kong.Name("converge"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Parse(args)
	return err
}
