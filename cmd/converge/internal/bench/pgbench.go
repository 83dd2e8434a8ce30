package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/localpg"
)

// pgbenchRun is the outcome of one pgbench invocation.
type pgbenchRun struct {
	TPS          float64       // transactions per second, without connection time
	LatencyMS    float64       // average latency
	Transactions int           // processed
	CPU          time.Duration // pgbench's own user+system time
	Output       string
}

var (
	tpsRE     = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)
	latencyRE = regexp.MustCompile(`latency average = ([0-9.]+) ms`)
	txnsRE    = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)
)

func pgbenchPath() string {
	if p, err := exec.LookPath("pgbench"); err == nil {
		return p
	}
	if bin, err := localpg.BinDir(); err == nil {
		return filepath.Join(bin, "pgbench")
	}
	return "pgbench"
}

// pgbench runs script against database db with clients clients in prepared
// mode (pgx, which the components use, also prepares and caches every
// statement), for seconds seconds or, when perClient > 0, for perClient
// transactions per client.
func (e *env) pgbench(ctx context.Context, db, script string, clients int, seconds, perClient int) (pgbenchRun, error) {
	f := filepath.Join(e.dir, fmt.Sprintf("pgbench-%d.sql", time.Now().UnixNano()))
	if err := os.WriteFile(f, []byte(script), 0o644); err != nil {
		return pgbenchRun{}, err
	}
	defer os.Remove(f)
	args := []string{"-n", "-M", "prepared", "-f", f, "-c", strconv.Itoa(clients), "-j", strconv.Itoa(min(clients, 2)),
		"-h", "127.0.0.1", "-p", strconv.Itoa(e.pg.Port()), "-U", "postgres"}
	if perClient > 0 {
		args = append(args, "-t", strconv.Itoa(perClient))
	} else {
		args = append(args, "-T", strconv.Itoa(seconds))
	}
	args = append(args, db)
	cmd := exec.CommandContext(ctx, pgbenchPath(), args...)
	// The components' session settings (enable_seqscan=off, jit=off, ...):
	// pgbench's prepared statements then get the plans converge's get.
	cmd.Env = append(os.Environ(), "PGOPTIONS="+dbpool.PGOptions())
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	r := pgbenchRun{Output: out.String()}
	if cmd.ProcessState != nil {
		r.CPU = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	}
	if err != nil {
		return r, fmt.Errorf("pgbench: %w\n%s", err, clip(out.String(), 2000))
	}
	m := tpsRE.FindStringSubmatch(r.Output)
	if m == nil {
		return r, fmt.Errorf("pgbench: no tps in output:\n%s", clip(r.Output, 2000))
	}
	r.TPS, _ = strconv.ParseFloat(m[1], 64)
	if m := latencyRE.FindStringSubmatch(r.Output); m != nil {
		r.LatencyMS, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := txnsRE.FindStringSubmatch(r.Output); m != nil {
		r.Transactions, _ = strconv.Atoi(m[1])
	}
	return r, nil
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
