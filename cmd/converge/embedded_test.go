package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/internal/testenv"
)

// TestDevSurvivesPostgresCrash kills the embedded postmaster with SIGKILL
// (a PostgreSQL crash: no shutdown checkpoint, the slot's persisted position
// may be older than the relay confirmed) while tasks are in flight. converge
// dev must stay up, start PostgreSQL again (crash recovery from its WAL),
// count the restart, and converge: every task accepted before and after
// completes with exactly one verified artifact, no task created twice, the
// duplicates the relay republishes absorbed by the inbox (README "What
// converge guarantees", issue 13).
func TestDevSurvivesPostgresCrash(t *testing.T) {
	d := newDevTest(t)
	p := startDev(t, d.bin, d.env, d.logf)
	defer p.stop(t)
	waitHTTP(t, d.apiURL+"/healthz", p)
	cl := &submit.Client{BaseURL: d.apiURL, Token: devToken(t, filepath.Join(d.dir, "data")), PollInterval: 50 * time.Millisecond}
	ctx := context.Background()

	// create retries a create through the outage (503 DATABASE_UNAVAILABLE,
	// connection errors) with the same key, as a client would.
	create := func(i int) string {
		doc := []byte(fmt.Sprintf(`{"pg-crash":%d,"z":[3,2,1]}`, i))
		deadline := time.Now().Add(90 * time.Second)
		for {
			r, err := cl.Create(ctx, fmt.Sprintf("pg-crash-%04d", i), doc)
			if err == nil && r.TaskID != "" {
				return r.TaskID
			}
			if time.Now().After(deadline) {
				t.Fatalf("create %d: %+v %v", i, r, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	const before, after = 60, 60
	ids := make([]string, 0, before+after)
	for i := 0; i < before; i++ {
		ids = append(ids, create(i))
	}
	waitSomeCompleted(t, d.dbURL(t), 5)

	pidFile, err := os.ReadFile(filepath.Join(d.dir, "data", "pg", "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(pidFile), "\n", 2)[0]))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 postmaster %d: %v", pid, err)
	}
	t.Logf("killed the postmaster (pid %d) with %d tasks submitted", pid, before)
	for i := before; i < before+after; i++ {
		ids = append(ids, create(i))
	}
	select {
	case <-p.done:
		t.Fatal("converge dev exited after its PostgreSQL crashed")
	default:
	}

	wctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	for i, id := range ids {
		task, err := cl.Wait(wctx, id)
		if err != nil {
			t.Fatalf("task %d (%s) not terminal after the crash: %v", i, id, err)
		}
		if task.Status != "completed" {
			t.Errorf("task %d: %s", i, task.Status)
		}
	}
	n := before + after
	dupDeliveries := checkConverged(t, d.dbURL(t), filepath.Join(d.dir, "data"), n)
	if got := metricValue(t, d.apiURL+"/metrics", `converge_component_restarts_total{component="postgres"}`); got < 1 {
		t.Errorf("converge_component_restarts_total{component=\"postgres\"} = %v, want >= 1", got)
	}
	t.Logf("after the PostgreSQL crash: %d tasks, one verified artifact each, %d duplicate deliveries absorbed by the inbox", n, dupDeliveries)

	// The embedded redis-server is supervised the same way: killed, it is
	// started again (empty), and tasks keep completing.
	rpid := redisPID(t, d.env)
	if err := syscall.Kill(rpid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 redis-server %d: %v", rpid, err)
	}
	testenv.Eventually(t, 60*time.Second, "redis restarted", func() bool {
		return metricValue(t, d.apiURL+"/metrics", `converge_component_restarts_total{component="redis"}`) >= 1
	})
	last := create(before + after)
	if task, err := cl.Wait(wctx, last); err != nil || task.Status != "completed" {
		t.Fatalf("task after the Redis crash: %+v %v", task, err)
	}
}

// redisPID finds the embedded redis-server of env's CONVERGE_DEV_REDIS_PORT
// in /proc.
func redisPID(t *testing.T, env []string) int {
	t.Helper()
	port := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "CONVERGE_DEV_REDIS_PORT="); ok {
			port = v
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// redis-server rewrites its title to "<path> 127.0.0.1:<port>".
		title := strings.TrimRight(strings.ReplaceAll(string(b), "\x00", " "), " ")
		if strings.Contains(title, "redis-server") && strings.HasSuffix(title, ":"+port) {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			return pid
		}
	}
	t.Fatalf("no redis-server on port %s", port)
	return 0
}

// metricValue reads one sample (name with its labels, as exposed) from a
// Prometheus text endpoint; -1 when absent.
func metricValue(t *testing.T, url, sample string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` ([0-9.e+-]+)$`).FindSubmatch(b)
	if m == nil {
		return -1
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}
