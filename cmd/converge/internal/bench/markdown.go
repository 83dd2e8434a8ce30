package bench

import (
	"fmt"
	"io"
	"sort"
	"strings"
)

// Markdown writes the results as the tables of BENCHMARKS.md.
func (r *Results) Markdown(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "Run of %s: `%s`\n\n", r.Date, r.Command)
	medians := fmt.Sprintf("Median of %d runs", r.Settings.Runs)
	if r.AB != nil {
		// The ab stage rounds --runs up to even.
		medians += fmt.Sprintf(" (the ab stage: of %d rounds)", len(r.AB.Rounds))
	}
	fmt.Fprintf(w, "Machine: %d cores (%s), %d MB memory, Linux %s; load average %s before, %s after. PostgreSQL %s, %s, fsync %v. %s; %.0f s in all.\n\n",
		m.Cores, m.CPUModel, m.MemTotalMB, m.Kernel, m.LoadAvgBefore, m.LoadAvgAfter, r.Settings.PostgresVersion, r.Settings.GoVersion,
		onOffWord(r.Settings.Fsync), medians, r.TotalSeconds)
	if len(r.Create) > 0 || r.Relay != nil || r.RSS != nil || r.Worker != nil || r.E2E != nil {
		fmt.Fprintln(w, "| stage | converge | limit, same run | ratio | target | CPU (cores, last run) converge / postgres / other |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
	}
	for _, p := range r.Create {
		fmt.Fprintf(w, "| create, %s | %.0f req/s (p50 %.1f ms, p99 %.1f ms) | pgbench %.0f tps (%.1f ms avg) | %.2f | %s | %s · %s |\n",
			clients(p.Clients), p.APIMedian, p.APIP50, p.APIP99, p.PgbenchMedian, p.PgbenchLatMS, p.Ratio, target(p.Clients == 16, "≥ 0.90", p.Ratio >= 0.9),
			cpuCell(p.APICPU), cpuCell(p.PgbenchCPU))
	}
	for _, p := range r.Create {
		if p.PipelinedMedian > 0 {
			fmt.Fprintf(w, "| create, %s, against pgbench sending the API's statements in the API's two pipelined round trips | %.0f req/s | pgbench pipelined %.0f tps | %.2f | %s | — |\n",
				clients(p.Clients), p.APIMedian, p.PipelinedMedian, p.PipelinedRatio, target(p.Clients == 16, "≥ 0.90", p.PipelinedRatio >= 0.9))
		}
	}
	for _, p := range r.Create {
		if p.WidePoolMedian > 0 {
			fmt.Fprintf(w, "| create, %d clients, API pool of %d connections (the largest client count; not the default) | %.0f req/s | pgbench %.0f tps | %.2f | — | — |\n",
				p.Clients, r.widePool(), p.WidePoolMedian, p.PgbenchMedian, p.WidePoolRatio)
		}
	}
	if rr := r.Relay; rr != nil {
		fmt.Fprintf(w, "| relay, %d rows (1 per txn) | %.0f events/s | decode-only loop %.0f rows/s | %.2f | %s | %s · %s |\n",
			rr.Rows, rr.RelayMedian, rr.DecodeMedian, rr.Ratio, target(true, "≥ 0.80", rr.Ratio >= 0.8), cpuCell(rr.RelayCPU), cpuCell(rr.DecodeCPU))
	}
	if rr := r.Relay; rr != nil {
		fmt.Fprintf(w, "| relay's serial loop, parts alone | transaction record INSERT (1000 per statement, sync commit) %.0f transactions/s; payload canonicalization (which the relay no longer does; for reference) %.0f rows/s | — | — | — | — |\n",
			rr.RecordTransactionsPerSec, rr.CanonicalRowsPerSec)
	}
	if s := r.RSS; s != nil {
		fmt.Fprintf(w, "| relay peak RSS, one txn of %d rows | %.0f MB (%.0f events/s, completed %v) | — | — | %s | — |\n",
			s.Rows, s.PeakRSSMB, s.EventsPerSec, s.Completed, target(true, "≤ 200 MB", s.Completed && s.PeakRSSMB <= 200))
	}
	if wr := r.Worker; wr != nil {
		fmt.Fprintf(w, "| worker, %d tasks | %.0f tasks/s | pgbench %.0f tasks/s (%d clients); artifact store alone %.0f/s | %.2f | — | %s · %s |\n",
			wr.Tasks, wr.WorkerMedian, wr.PgbenchMedian, wr.PgbenchClients, wr.ArtifactMed, wr.Ratio, cpuCell(wr.WorkerCPU), cpuCell(wr.PgbenchCPU))
	}
	if wr := r.Worker; wr != nil && len(wr.RecordMS) > 0 {
		fmt.Fprintf(w, "| worker, one record | %.2f ms from first attempt to durable outcome; %.2f records in process on average (a batch's run holds all its records; Concurrency %d bounds the effects performed at once); a poll spans %.2f partitions | — | — | — | — |\n",
			median(wr.RecordMS), median(wr.Concurrency), wr.PgbenchClients, wr.PartitionsPerPoll)
	}
	if wr := r.Worker; wr != nil {
		fmt.Fprintf(w, "| disk | fdatasync of a 4 KiB write: %.0f/s (%.2f ms each), one thread | — | — | — | — |\n",
			wr.FdatasyncPerSec, 1000/max(wr.FdatasyncPerSec, 1))
	}
	if e := r.E2E; e != nil {
		fmt.Fprintf(w, "| end to end, sustained (p99 < 1 s) | %.0f tasks/s | — | — | %s | — |\n",
			e.SustainedRate, target(true, "≥ 1500", e.SustainedRate >= 1500))
		if e.Measured500 {
			fmt.Fprintf(w, "| end to end, p99 at 500 tasks/s | %.0f ms (%d pending) | — | — | — | — |\n", e.P99At500, e.PendingAt500)
		}
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| fixed rate | sent req/s | completed tasks/s | e2e p50 | e2e p99 (median) | create p99 | pending | sustained | CPU |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
		for _, s := range e.Steps {
			fmt.Fprintf(w, "| %.0f/s | %s | %s | %s ms | %.0f ms | %s ms | %v | %v | %s |\n", s.Rate, list(s.Requests), list(s.Completed), list(s.P50),
				s.P99Median, list(s.CreateP99), s.Pending, s.Sustained, cpuCell(s.CPU))
		}
	}
	if pr := r.Peer; pr != nil && len(pr.Median) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintf(w, "Peer: the same job on converge and on River, %d tasks from %d closed-loop clients per run, first create → last completion, alternating River, River tuned, converge (median of %d):\n\n",
			pr.Tasks, pr.Clients, r.Settings.Runs)
		fmt.Fprintln(w, "| system | tasks/s (runs) | median | CPU ms per task (all processes + PostgreSQL) | write transactions (xids) per task | commits per task |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for _, sys := range []string{peerConverge, peerRiver, peerRiverTuned} {
			var tps []float64
			for _, run := range pr.Runs {
				if run.System == sys {
					tps = append(tps, run.TasksPerSec)
				}
			}
			m := pr.Median[sys]
			fmt.Fprintf(w, "| %s | %s | %.0f | %.2f | %.2f | %.2f |\n", sys, list(tps), m.TasksPerSec, m.CPUMsPerTask, m.XIDsPerTask, m.CommitsPerTask)
		}
		fmt.Fprintf(w, "\nconverge / River: %.2f at River's defaults, %.2f against River tuned (target ≥ 1.5: %s).\n",
			pr.RatioToRiver, pr.RatioToRiverTuned, target(true, "≥ 1.5", pr.RatioToRiver >= 1.5 && pr.RatioToRiverTuned >= 1.5))
		if rt := pr.Retention; rt != nil {
			by := "the pipeline's reconciler"
			if rt.Reconcilers > 1 {
				by = fmt.Sprintf("%d reconcilers (the pipeline's and %d more)", rt.Reconcilers, rt.Reconcilers-1)
			}
			fmt.Fprintf(w, "\nRetention: the last converge run's %d tasks, aged past every window at once, removed by %s (with their artifacts) in %.1f s = %.0f tasks/s; %.2f ms CPU (converge process + PostgreSQL; PostgreSQL %.2f) and %.2f commits per removed task: a second cost of every task, one retention window after it ran.\n",
				rt.Tasks, by, rt.Seconds, rt.TasksPerSec, rt.CPUMsPerTask, rt.PostgresMsPerTask, rt.CommitsPerTask)
		}
		if m := pr.Median[peerConverge]; len(m.PostgresMsPerTask) > 0 {
			keys := make([]string, 0, len(m.PostgresMsPerTask))
			for k := range m.PostgresMsPerTask {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			parts := make([]string, len(keys))
			for i, k := range keys {
				parts[i] = fmt.Sprintf("%s %.2f", k, m.PostgresMsPerTask[k])
			}
			fmt.Fprintf(w, "\nPostgreSQL's CPU of converge's runs, ms per task, by application_name of its backends (median of each): %s.\n", strings.Join(parts, ", "))
		}
	}
	if ab := r.AB; ab != nil && len(ab.Rounds) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintf(w, "A/B side by side: A `%s` and B `%s` on the same job at the same time, %d tasks each from %d closed-loop clients per round, rates in the window in which both were completing tasks (median of %d rounds):\n\n",
			ab.Binaries[0], ab.Binaries[1], ab.Tasks, ab.Clients, len(ab.Rounds))
		fmt.Fprintln(w, "| round (started first) | A tasks/s | B tasks/s | B / A | A CPU ms per task | B CPU ms per task | B / A |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
		for i, rd := range ab.Rounds {
			fmt.Fprintf(w, "| %d (%s) | %.0f | %.0f | %.3f | %.2f | %.2f | %.3f |\n", i+1, rd.First, rd.TasksPerSec[0], rd.TasksPerSec[1], rd.Ratio,
				rd.CPUMsPerTask[0], rd.CPUMsPerTask[1], rd.CPURatio)
		}
		fmt.Fprintf(w, "\nB / A: rate %.3f, CPU per task %.3f (medians).\n", ab.RatioMedian, ab.CPURatioMedian)
	}
	r.boundsMarkdown(w)
	if len(r.Errors) > 0 {
		fmt.Fprintln(w)
		keys := make([]string, 0, len(r.Errors))
		for k := range r.Errors {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(w, "Stage %s failed: %s\n\n", k, strings.ReplaceAll(r.Errors[k], "\n", " "))
		}
	}
}

func clients(n int) string {
	if n == 1 {
		return "1 client"
	}
	return fmt.Sprintf("%d clients", n)
}

func target(applies bool, t string, ok bool) string {
	if !applies {
		return "—"
	}
	if ok {
		return t + " met"
	}
	return t + " **not met**"
}

func cpuCell(c CPU) string {
	return fmt.Sprintf("%.2f / %.2f / %.2f", c.Converge, c.Postgres, c.Other)
}

func list(xs []float64) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(s, ", ")
}

func onOffWord(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// last returns the last value of xs (the run whose CPU is recorded), 0
// when empty.
func last(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return xs[len(xs)-1]
}

// msPer is CPU milliseconds per unit of work: cores / (units per second).
func msPer(cores, rate float64) float64 {
	if rate <= 0 {
		return 0
	}
	return 1000 * cores / rate
}

// boundsMarkdown writes the CPU each stage spent per task (the last run's CPU
// over the last run's rate) and the end-to-end rate those costs allow on
// this machine's cores: the measured bound BENCHMARKS.md cites where a
// target is not met.
func (r *Results) boundsMarkdown(w io.Writer) {
	var create *CreatePoint
	for i := range r.Create {
		if r.Create[i].Clients == 16 {
			create = &r.Create[i]
		}
	}
	wr := r.Worker
	rr := r.Relay
	if create == nil && wr == nil && rr == nil {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "CPU per task or event (milliseconds of CPU, last run's CPU over its rate):")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| stage | converge process | PostgreSQL | pgbench (client) |")
	fmt.Fprintln(w, "|---|---|---|---|")
	var apiConv, apiPG, pgbCreatePG, wConv, wPG, pgbWorkerPG, relayConv, relayPG float64
	if create != nil {
		apiConv, apiPG = msPer(create.APICPU.Converge, last(create.APIRate)), msPer(create.APICPU.Postgres, last(create.APIRate))
		pgbCreatePG = msPer(create.PgbenchCPU.Postgres, last(create.PgbenchTPS))
		fmt.Fprintf(w, "| create, 16 clients: API (with loadgen's HTTP client) | %.3f | %.3f | — |\n", apiConv, apiPG)
		fmt.Fprintf(w, "| create, 16 clients: pgbench, same statements | — | %.3f | %.3f |\n", pgbCreatePG, msPer(create.PgbenchCPU.Other, last(create.PgbenchTPS)))
	}
	if rr != nil {
		relayConv, relayPG = msPer(rr.RelayCPU.Converge, last(rr.RelayRate)), msPer(rr.RelayCPU.Postgres, last(rr.RelayRate))
		fmt.Fprintf(w, "| relay, per event | %.3f | %.3f | — |\n", relayConv, relayPG)
		fmt.Fprintf(w, "| decode-only loop, per row | %.3f | %.3f | — |\n", msPer(rr.DecodeCPU.Converge, last(rr.DecodeRate)), msPer(rr.DecodeCPU.Postgres, last(rr.DecodeRate)))
	}
	if wr != nil {
		wConv, wPG = msPer(wr.WorkerCPU.Converge, last(wr.WorkerRate)), msPer(wr.WorkerCPU.Postgres, last(wr.WorkerRate))
		pgbWorkerPG = msPer(wr.PgbenchCPU.Postgres, last(wr.PgbenchTPS))
		fmt.Fprintf(w, "| worker, per task | %.3f | %.3f | — |\n", wConv, wPG)
		fmt.Fprintf(w, "| worker: pgbench, same statements, per task | — | %.3f | %.3f |\n", pgbWorkerPG, msPer(wr.PgbenchCPU.Other, last(wr.PgbenchTPS)))
	}
	if create == nil || wr == nil || rr == nil {
		return
	}
	cores := float64(r.Machine.Cores)
	// A task is one create transaction, two relayed events (TaskCreated,
	// TaskCompleted) and one worker pass; the projector, the reconciler and
	// the broker come on top.
	all := apiConv + apiPG + 2*(relayConv+relayPG) + wConv + wPG
	pgOnly := pgbCreatePG + 2*relayPG + pgbWorkerPG
	fmt.Fprintln(w)
	fmt.Fprintf(w, "End-to-end bound from these costs on %d cores: one task = one create + two relayed events + one worker pass = %.2f ms of CPU (converge and PostgreSQL; projector, reconciler and broker not counted), so at most **%.0f tasks/s**; PostgreSQL's share alone with pgbench's statements (create + worker) and the relay's = %.2f ms, so at most %.0f tasks/s even if every converge process cost nothing.\n",
		r.Machine.Cores, all, 1000*cores/all, pgOnly, 1000*cores/pgOnly)
}

// widePool is the connection count of the create stage's wide pool: the
// largest client count, at least pgxpool's default max(4, cores).
func (r *Results) widePool() int {
	n := max(4, r.Machine.Cores)
	for _, p := range r.Create {
		n = max(n, p.Clients)
	}
	return n
}
