package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/bench"
	"github.com/converge-run/converge/cmd/converge/internal/loadgen"
)

// BenchCmd runs every stage against its physical limit (make bench).
type BenchCmd struct {
	Quick                bool          `help:"Small sizes: every stage in a few minutes."`
	Stages               []string      `sep:"," help:"Stages to run (create,relay,rss,worker,e2e,peer; default all; ab only when named, with --ab-binaries)."`
	Runs                 int           `help:"Repetitions of each measurement; the median is reported (default 3)."`
	CreateClients        []int         `sep:"," help:"Client counts of the create stage (default 1,4,16,64)."`
	CreateDuration       time.Duration `help:"Length of each create measurement (default 5s)."`
	RelayRows            int           `help:"Rows of the pre-filled outbox of the relay stage (default 200000)."`
	RSSRows              int           `name:"rss-rows" help:"Rows of the single transaction of the relay RSS stage (default 1000000)."`
	WorkerTasks          int           `help:"Pre-filled tasks of the worker stage (default 10000)."`
	E2ERates             []float64     `name:"e2e-rates" sep:"," help:"Fixed rates of the end-to-end ladder (default 100,200,300,400,500,750,1000,1500,2000)."`
	E2EStep              time.Duration `name:"e2e-step" help:"Sending time of each end-to-end step (default 8s)."`
	DocSize              int           `help:"Size in bytes of the generated documents (default 1024)."`
	PeerTasks            int           `help:"Tasks of each run of the peer stage, converge against River on the same job (default 20000)."`
	RetentionReconcilers int           `help:"Reconcilers removing the peer stage's tasks in its retention measurement: the pipeline's own and more in the bench process, on the same database and artifacts (default 1)."`
	RiverDir             string        `type:"path" help:"Source directory of the peer stage's River program (default cmd/converge/internal/bench/riverpeer)."`
	Partitions           int           `help:"Partitions of the task-events topic in the worker and end-to-end stages (default 4)."`
	WorkerConcurrency    int           `help:"Records the worker processes at once in the worker and end-to-end stages; also the worker pgbench's clients (default 4)."`
	ABBinaries           []string      `name:"ab-binaries" sep:"," help:"Two converge executables A,B that the ab stage runs side by side on the same job, --runs rounds (rounded up to even) of --peer-tasks tasks each (e.g. builds of two commits)."`
	Dir                  string        `type:"path" help:"Working directory (cluster, broker, logs), made if missing and kept; default a temporary directory, removed at the end."`
	ProfileDir           string        `type:"path" help:"Write CPU profiles of the converge process per stage to this directory."`
	Statements           bool          `help:"Load pg_stat_statements and print each peer run's costliest statements per task (off by default: it costs every statement)."`
	Out                  string        `type:"path" default:"bench-results.json" help:"JSON results file."`
	Markdown             string        `type:"path" help:"Also write the results table (markdown) to this file."`
}

// Run runs the benchmark, prints progress and the results table, and writes
// the JSON file.
func (c *BenchCmd) Run(env *runEnv) error {
	cfg := bench.Config{}
	if c.Quick {
		cfg = bench.Quick()
	}
	setIf(&cfg.Runs, c.Runs)
	setIf(&cfg.RelayRows, c.RelayRows)
	setIf(&cfg.RSSRows, c.RSSRows)
	setIf(&cfg.WorkerTasks, c.WorkerTasks)
	setIf(&cfg.DocSize, c.DocSize)
	setIf(&cfg.PeerTasks, c.PeerTasks)
	setIf(&cfg.RetentionReconcilers, c.RetentionReconcilers)
	if c.RiverDir != "" {
		cfg.RiverDir = c.RiverDir
	}
	setIf(&cfg.Partitions, c.Partitions)
	setIf(&cfg.WorkerConcurrency, c.WorkerConcurrency)
	setIf(&cfg.CreateDuration, c.CreateDuration)
	setIf(&cfg.E2EStep, c.E2EStep)
	if len(c.CreateClients) > 0 {
		cfg.CreateClients = c.CreateClients
	}
	if len(c.E2ERates) > 0 {
		cfg.E2ERates = c.E2ERates
	}
	cfg.ABBinaries = c.ABBinaries
	cfg.Stages, cfg.Dir, cfg.ProfileDir, cfg.Statements, cfg.Progress = c.Stages, c.Dir, c.ProfileDir, c.Statements, os.Stdout
	res, err := bench.Run(env.ctx, cfg)
	if res == nil {
		if errors.Is(err, context.Canceled) {
			return exitCode(130) // interrupted before any stage ran
		}
		return err
	}
	var md strings.Builder
	res.Markdown(&md)
	fmt.Println()
	fmt.Print(md.String())
	b, jerr := json.MarshalIndent(res, "", "  ")
	if jerr != nil {
		return jerr
	}
	if werr := os.WriteFile(c.Out, append(b, '\n'), 0o644); werr != nil {
		return werr
	}
	fmt.Println("\nresults written to", c.Out)
	if c.Markdown != "" {
		if werr := os.WriteFile(c.Markdown, []byte(md.String()), 0o644); werr != nil {
			return werr
		}
	}
	if errors.Is(err, context.Canceled) {
		// main takes a cancelled context for a clean stop (exit 0): an
		// interrupted measurement is not one.
		fmt.Fprintln(os.Stderr, "converge bench: interrupted; the results above are incomplete")
		return exitCode(130)
	}
	if err != nil {
		return err
	}
	if len(res.Errors) > 0 {
		return exitCode(1)
	}
	return nil
}

// Validate refuses a negative count or duration when the command line is
// parsed (0 is the stage's default; before, -1 was silently the default).
func (c *BenchCmd) Validate() error {
	for _, v := range []struct {
		n    int64
		flag string
	}{
		{int64(c.Runs), "--runs"}, {int64(c.RelayRows), "--relay-rows"}, {int64(c.RSSRows), "--rss-rows"},
		{int64(c.WorkerTasks), "--worker-tasks"}, {int64(c.DocSize), "--doc-size"}, {int64(c.PeerTasks), "--peer-tasks"},
		{int64(c.RetentionReconcilers), "--retention-reconcilers"},
		{int64(c.Partitions), "--partitions"}, {int64(c.WorkerConcurrency), "--worker-concurrency"},
		{int64(c.CreateDuration), "--create-duration"}, {int64(c.E2EStep), "--e2e-step"},
	} {
		if v.n < 0 {
			return fmt.Errorf("%s: want a positive value, or leave it out for the default", v.flag)
		}
	}
	for _, n := range c.CreateClients {
		if n < 1 {
			return fmt.Errorf("--create-clients %d: want at least 1", n)
		}
	}
	for _, r := range c.E2ERates {
		if !(r >= loadgen.MinRate && r <= loadgen.MaxRate) { // NaN and ±Inf included
			return fmt.Errorf("--e2e-rates %g: want %g to %g requests/s (the load generator's bounds)", r, loadgen.MinRate, loadgen.MaxRate)
		}
	}
	return nil
}

func setIf[T comparable](dst *T, v T) {
	var zero T
	if v != zero {
		*dst = v
	}
}
