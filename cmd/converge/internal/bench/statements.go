package bench

import (
	"context"
	"fmt"
	"strings"
)

// StatementCost is one statement's share of a peer run, from
// pg_stat_statements (PostgreSQL's own per-statement counters): where the
// database's time and WAL go, per task. Times are the server's execution
// and planning time (not CPU alone: waits on locks and I/O are in it; the
// commit's WAL flush is not, it belongs to the COMMIT).
type StatementCost struct {
	Query string `json:"query"`
	// CallsPerTask is calls / tasks of the run.
	CallsPerTask float64 `json:"calls_per_task"`
	// MsPerTask is (total_exec_time + total_plan_time) / tasks, in ms.
	MsPerTask float64 `json:"ms_per_task"`
	// RowsPerTask is rows returned or affected / tasks.
	RowsPerTask float64 `json:"rows_per_task"`
	// WALBytesPerTask and WALRecordsPerTask are the WAL the statement
	// generated / tasks.
	WALBytesPerTask   float64 `json:"wal_bytes_per_task"`
	WALRecordsPerTask float64 `json:"wal_records_per_task"`
}

// statementsSettings are the server settings Config.Statements adds: the
// module loaded at start, planning time tracked, top-level statements
// only (neither River nor converge calls functions on its path, so a
// statement's cost is its client's statement).
var statementsSettings = map[string]string{
	"shared_preload_libraries":          "pg_stat_statements",
	"pg_stat_statements.track":          "top",
	"pg_stat_statements.max":            "2000",
	"pg_stat_statements.track_planning": "on",
}

// resetStatements clears the cluster's statement counters (a no-op when
// Config.Statements is off). The extension lives in the admin database;
// its view shows every database's statements.
func (e *env) resetStatements(ctx context.Context) error {
	if !e.cfg.Statements {
		return nil
	}
	if _, err := e.admin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		return fmt.Errorf("pg_stat_statements: %w", err)
	}
	_, err := e.admin.Exec(ctx, "SELECT pg_stat_statements_reset()")
	return err
}

// readStatements returns the statements of database db since the last
// resetStatements, costliest first (at most 25), per task of a run of n
// tasks; nil when Config.Statements is off. The last row sums the rest.
func (e *env) readStatements(ctx context.Context, db string, n int) ([]StatementCost, error) {
	if !e.cfg.Statements || n <= 0 {
		return nil, nil
	}
	rows, err := e.admin.Query(ctx, `
SELECT s.query, s.calls, s.total_exec_time + s.total_plan_time, s.rows, s.wal_bytes, s.wal_records
FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
WHERE d.datname = $1
ORDER BY s.total_exec_time + s.total_plan_time DESC`, db)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []StatementCost
	var rest StatementCost
	rest.Query = "(all other statements)"
	f := float64(n)
	for rows.Next() {
		var q string
		var calls, nrows, walRecords int64
		var ms float64
		var walBytes float64 // numeric in PostgreSQL
		if err := rows.Scan(&q, &calls, &ms, &nrows, &walBytes, &walRecords); err != nil {
			return nil, err
		}
		c := StatementCost{Query: oneLine(q), CallsPerTask: float64(calls) / f, MsPerTask: ms / f, RowsPerTask: float64(nrows) / f,
			WALBytesPerTask: walBytes / f, WALRecordsPerTask: float64(walRecords) / f}
		if len(out) < 25 {
			out = append(out, c)
			continue
		}
		rest.CallsPerTask += c.CallsPerTask
		rest.MsPerTask += c.MsPerTask
		rest.RowsPerTask += c.RowsPerTask
		rest.WALBytesPerTask += c.WALBytesPerTask
		rest.WALRecordsPerTask += c.WALRecordsPerTask
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if rest.CallsPerTask > 0 {
		out = append(out, rest)
	}
	for i := range out {
		c := &out[i]
		c.CallsPerTask, c.MsPerTask, c.RowsPerTask = round3(c.CallsPerTask), round3(c.MsPerTask), round3(c.RowsPerTask)
		c.WALBytesPerTask, c.WALRecordsPerTask = round2(c.WALBytesPerTask), round3(c.WALRecordsPerTask)
	}
	return out, nil
}

// printStatements writes one progress line per statement and their total.
func (e *env) printStatements(system string, run int, st []StatementCost) {
	if len(st) == 0 {
		return
	}
	var ms, wal float64
	for _, c := range st {
		ms += c.MsPerTask
		wal += c.WALBytesPerTask
	}
	e.progress("peer    %-11s run %d: statements: %.3f ms and %.0f WAL bytes per task (pg_stat_statements; exec + plan time)", system, run+1, ms, wal)
	for _, c := range st {
		q := c.Query
		if len(q) > 110 {
			q = q[:110] + "…"
		}
		e.progress("peer      %6.3f ms %6.2f calls %6.2f rows %7.0f WAL B  %s", c.MsPerTask, c.CallsPerTask, c.RowsPerTask, c.WALBytesPerTask, q)
	}
}

// oneLine collapses a statement's whitespace.
func oneLine(q string) string { return strings.Join(strings.Fields(q), " ") }

func round3(v float64) float64 { return float64(int64(v*1000+0.5)) / 1000 }
