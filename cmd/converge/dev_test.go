package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/cmd/converge/internal/submit"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
	"github.com/converge-run/converge/internal/testenv"
)

// devProcess is one `converge dev` process of the crash test.
type devProcess struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func startDev(t *testing.T, bin string, env []string, log io.Writer) *devProcess {
	t.Helper()
	cmd := exec.Command(bin, "dev")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &devProcess{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p
}

// stop sends SIGINT (Ctrl-C) and expects a clean exit within 30 s; else it
// asks for a goroutine dump (SIGQUIT, into the log) and fails the test.
func (p *devProcess) stop(t *testing.T) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.done:
		if code := p.cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("converge dev exited with status %d after SIGINT", code)
		}
		return
	case <-time.After(30 * time.Second):
	}
	t.Error("converge dev did not exit within 30s of SIGINT; goroutine dump in the log")
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func requireServices(t *testing.T) {
	t.Helper()
	_, pgErr := localpg.BinDir()
	_, redisErr := exec.LookPath("redis-server")
	for _, err := range []error{pgErr, redisErr} {
		if err == nil {
			continue
		}
		if testenv.InCI() {
			t.Fatalf("service binaries missing under CI=true: %v", err)
		}
		t.Skip(err)
	}
	_ = localredis.ErrNoBinary
}

// devTest is the world of a test that runs the real binary on embedded
// defaults: its build, free ports, environment and log file.
type devTest struct {
	dir, bin, apiURL string
	env              []string
	logf             *os.File
	pgPort           int
}

// newDevTest builds the binary and prepares a data directory and ports;
// it skips under -short and fails without service binaries under CI=true.
func newDevTest(t *testing.T) *devTest {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	requireServices(t)
	// Not t.TempDir: PostgreSQL runs as the postgres user when we are root
	// and must be able to enter every parent of its data directory.
	dir, err := os.MkdirTemp("", "converge-dev-test-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "converge")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	pgPort, kPort, rPort, hPort := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
	d := &devTest{dir: dir, bin: bin, apiURL: "http://127.0.0.1:" + strconv.Itoa(hPort), pgPort: pgPort}
	d.env = []string{
		"CONVERGE_DATA_DIR=" + filepath.Join(dir, "data"),
		"CONVERGE_DEV_PG_PORT=" + strconv.Itoa(pgPort),
		"CONVERGE_DEV_KAFKA_PORT=" + strconv.Itoa(kPort),
		"CONVERGE_DEV_REDIS_PORT=" + strconv.Itoa(rPort),
		"CONVERGE_HTTP_ADDR=127.0.0.1:" + strconv.Itoa(hPort),
		"CONVERGE_ADMIN_ADDR=127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
		"CONVERGE_DEV_NO_EXAMPLES=true",
		"CONVERGE_DATABASE_URL=", "CONVERGE_KAFKA_BROKERS=", "CONVERGE_REDIS_URL=", "CONVERGE_FAULTS=",
	}
	if d.logf, err = os.Create(filepath.Join(dir, "dev.log")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "dev.log"))
			t.Logf("dev log (tail):\n%s", tail(string(b), 60))
		}
	})
	return d
}

// dbURL is the embedded PostgreSQL's URL, with its password, that dev wrote
// into its data directory.
func (d *devTest) dbURL(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(d.dir, "data", devDatabaseURLFile))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(raw))
}

// TestDevKilledMidBatch runs the real binary on embedded defaults, submits a
// batch, kills the process with SIGKILL while the batch is being processed,
// starts it again on the same data directory, and checks from the database
// and the artifact directory that every task completed with exactly one
// verified artifact and that no task was created twice.
func TestDevKilledMidBatch(t *testing.T) {
	d := newDevTest(t)
	dir, bin, env, logf, apiURL, pgPort := d.dir, d.bin, d.env, d.logf, d.apiURL, d.pgPort

	p := startDev(t, bin, env, logf)
	defer func() { _ = p.cmd.Process.Kill(); <-p.done }()
	waitHTTP(t, apiURL+"/healthz", p)
	cl := &submit.Client{BaseURL: apiURL, Token: devToken(t, filepath.Join(dir, "data")), PollInterval: 20 * time.Millisecond}

	const n = 300
	ctx := context.Background()
	ids := make([]string, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			doc := []byte(fmt.Sprintf(`{"n":%d,"payload":"%s","z":[3,2,1],"a":{"y":1.50,"x":-0.0}}`, i, strings.Repeat("x", i%50)))
			r, err := cl.Create(ctx, fmt.Sprintf("crash-test-%04d", i), doc)
			if err != nil || r.TaskID == "" {
				t.Errorf("create %d: %+v %v", i, r, err)
				return
			}
			ids[i] = r.TaskID
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	// Kill as soon as some, but not all, tasks completed: mid-batch.
	// The embedded PostgreSQL wants its password: the URL is in the data
	// directory (mode 0600).
	rawURL, err := os.ReadFile(filepath.Join(dir, "data", devDatabaseURLFile))
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "data", devDatabaseURLFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("database.url mode %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	dbURL := strings.TrimSpace(string(rawURL))
	if noPw := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/converge?sslmode=disable", pgPort); noPw == dbURL {
		t.Fatal("the embedded PostgreSQL has no password")
	} else if c, err := pgx.Connect(ctx, noPw); err == nil {
		c.Close(ctx)
		t.Fatal("the embedded PostgreSQL accepted a connection without its password")
	}
	waitSomeCompleted(t, dbURL, 5)
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-p.done

	p2 := startDev(t, bin, env, logf)
	defer p2.stop(t)
	waitHTTP(t, apiURL+"/healthz", p2)

	// The same intents again: replayed, no new task.
	for i := 0; i < n; i += 37 {
		doc := []byte(fmt.Sprintf(`{"n":%d,"payload":"%s","z":[3,2,1],"a":{"y":1.50,"x":-0.0}}`, i, strings.Repeat("x", i%50)))
		r, err := cl.Create(ctx, fmt.Sprintf("crash-test-%04d", i), doc)
		if err != nil || r.TaskID != ids[i] || !r.Replayed {
			t.Errorf("replay %d: %+v %v (want task %s)", i, r, err, ids[i])
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	for i, id := range ids {
		task, err := cl.Wait(wctx, id)
		if err != nil {
			t.Fatalf("task %d (%s) not terminal after restart: %v", i, id, err)
		}
		if task.Status != "completed" {
			t.Errorf("task %d: %s", i, task.Status)
		}
	}
	dupDeliveries := checkConverged(t, dbURL, filepath.Join(dir, "data"), n)
	t.Logf("after the crash: %d tasks, one verified artifact each, %d duplicate deliveries absorbed by the inbox", n, dupDeliveries)

	// A clean stop persists the slot position: the next start resumes where
	// the relay last confirmed, not from an older position (PostgreSQL 15
	// writes the position only for a dirty slot; see cdc.persistSlot).
	p2.stop(t)
	stopped := lastMatch(t, filepath.Join(dir, "dev.log"), `msg=stopped component=relay .*confirmed_lsn=([0-9A-F]+/[0-9A-F]+)`)
	p3 := startDev(t, bin, env, logf)
	defer p3.stop(t)
	waitHTTP(t, apiURL+"/healthz", p3)
	resumed := lastMatch(t, filepath.Join(dir, "dev.log"), `msg=streaming component=relay .*confirmed_flush_lsn=([0-9A-F]+/[0-9A-F]+)`)
	s, _ := pglogrepl.ParseLSN(stopped)
	r, _ := pglogrepl.ParseLSN(resumed)
	if s == 0 || r < s {
		t.Errorf("after a clean restart the slot resumed at %s, before the last confirmed %s", resumed, stopped)
	}
}

// waitSomeCompleted waits until at least n tasks are completed in dev's
// database (dbURL).
func waitSomeCompleted(t *testing.T, dbURL string, n int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	testenv.Eventually(t, 60*time.Second, "some tasks completed", func() bool {
		var c int
		_ = conn.QueryRow(ctx, "SELECT count(*) FROM task WHERE status = 'completed'").Scan(&c)
		return c >= n
	})
}

// checkConverged checks from dev's database (dbURL) and artifact
// directory (under dataDir) that there are exactly n tasks, n verified
// artifact effects and n artifact objects, and returns the duplicate
// deliveries the inbox absorbed.
func checkConverged(t *testing.T, dbURL, dataDir string, n int) (dupDeliveries int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var tasks, verified int
	conn.QueryRow(ctx, "SELECT count(*) FROM task").Scan(&tasks)
	conn.QueryRow(ctx, "SELECT count(*) FROM effect_ledger WHERE effect_kind='artifact.put' AND state='verified'").Scan(&verified)
	conn.QueryRow(ctx, "SELECT coalesce(sum(deliveries - 1), 0) FROM inbox_message").Scan(&dupDeliveries)
	if tasks != n || verified != n {
		t.Errorf("%d tasks, %d verified artifact effects; want %d each", tasks, verified, n)
	}
	objs, _ := filepath.Glob(filepath.Join(dataDir, "artifacts", "objects", "*.obj"))
	if len(objs) != n {
		t.Errorf("%d artifact objects in the store, want %d (one per task)", len(objs), n)
	}
	// converge dev finalizes its schema (nothing older runs on it), so its
	// worker writes pack files.
	for _, o := range objs {
		if raw, err := os.ReadFile(o); err != nil || !bytes.HasPrefix(raw, []byte("CVPACK1\n")) {
			t.Errorf("artifact %s is not a pack file (%v): %.20q", filepath.Base(o), err, raw)
		}
	}
	return dupDeliveries
}

func waitHTTP(t *testing.T, url string, p *devProcess) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			t.Fatal("converge dev exited during start-up")
		default:
		}
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s not up within 90s", url)
}

func tail(s string, lines int) string {
	sc := bufio.NewScanner(strings.NewReader(s))
	var all []string
	for sc.Scan() {
		all = append(all, sc.Text())
	}
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// lastMatch returns the first group of the last line of the file matching re.
func lastMatch(t *testing.T, path, re string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(re).FindAllStringSubmatch(string(b), -1)
	if len(m) == 0 {
		t.Fatalf("no log line matches %s", re)
	}
	return m[len(m)-1][1]
}

// devToken reads the dev tenant's token that converge dev wrote into its
// data directory dir (it exists before the API serves).
func devToken(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, devTokenDir, "dev.token"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// An API address in use fails `converge dev` at once, naming it, before
// any embedded service starts (before, it failed only after PostgreSQL,
// the broker and Redis had started).
func TestDevRefusesABusyAPIAddressFirst(t *testing.T) {
	d := newDevTest(t)
	busy, err := net.Listen("tcp", strings.TrimPrefix(d.apiURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	var out bytes.Buffer
	cmd := exec.Command(d.bin, "dev")
	cmd.Env = append(os.Environ(), d.env...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	if err == nil || !strings.Contains(out.String(), "API listen "+busy.Addr().String()) {
		t.Fatalf("dev with its API address in use: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(filepath.Join(d.dir, "data", "pg")); !os.IsNotExist(err) {
		t.Fatalf("the embedded PostgreSQL's directory exists (%v): dev started it before binding the API", err)
	}
}

// A `converge dev` killed (SIGKILL) while its first initdb runs, started
// again at once on the same data directory, comes up: the killed initdb
// dies with it (Pdeathsig) and an attempt still finishing in its own
// directory cannot empty the new one (the review of the thirteenth
// session: 4 of 9 such restarts failed). So does one killed once it
// runs.
func TestDevStartsAgainAfterKilledDuringInitdb(t *testing.T) {
	d := newDevTest(t)
	for i, after := range []time.Duration{50 * time.Millisecond, 120 * time.Millisecond, 250 * time.Millisecond} {
		os.RemoveAll(filepath.Join(d.dir, "data"))
		p := startDev(t, d.bin, d.env, d.logf)
		time.Sleep(after)
		_ = p.cmd.Process.Kill()
		<-p.done
		p = startDev(t, d.bin, d.env, d.logf)
		waitHTTP(t, d.apiURL+"/healthz", p)
		if i == 0 {
			// And killed once it runs, started again at once: the killed
			// dev's lock and its postmaster's shutdown are waited for (the
			// same review: 9 of 16 such restarts failed in a shell; this
			// test's timing has not reproduced those races, which
			// TestLockDataDirWaitsForAReleasedLock and the order of
			// localpg.Start cover).
			old := p
			_ = old.cmd.Process.Kill() // not waited for, as `kill -9 <pid>; converge dev` in a shell
			p = startDev(t, d.bin, d.env, d.logf)
			<-old.done
			waitHTTP(t, d.apiURL+"/healthz", p)
		}
		p.stop(t)
		if t.Failed() {
			t.Fatalf("after a kill at %s", after)
		}
	}
}

// A second lock of a dev data directory waits for the first to be
// released (a dev just killed holds it until the kernel has torn the
// process down) and fails, naming the holder's pid, when it is not.
func TestLockDataDirWaitsForAReleasedLock(t *testing.T) {
	dir := t.TempDir()
	unlock, err := lockDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockDataDir(dir); err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("second lock while held = %v, want it refused naming pid %d", err, os.Getpid())
	}
	time.AfterFunc(300*time.Millisecond, unlock)
	again, err := lockDataDir(dir)
	if err != nil {
		t.Fatalf("lock released during the wait: %v", err)
	}
	again()
}
