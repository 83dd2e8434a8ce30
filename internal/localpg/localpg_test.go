package localpg_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// With a Password the cluster refuses connections without it (also one
// first initialized on trust, restarted with a password), and URL carries
// it.
func TestPassword(t *testing.T) {
	ctx := context.Background()
	dir := tempParent(t)
	port := testenv.FreePort(t)
	cfg := localpg.Config{DataDir: filepath.Join(dir, "data"), Port: port}
	c, err := localpg.Start(ctx, cfg) // on trust
	if err != nil {
		t.Fatal(err)
	}
	plain := c.URL("postgres")
	c.Stop()
	cfg.Password = "s3cret_Pass-word_0123456789"
	c, err = localpg.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if !strings.Contains(c.URL("postgres"), cfg.Password) {
		t.Fatalf("URL %q lacks the password", c.URL("postgres"))
	}
	if conn, err := pgx.Connect(ctx, plain); err == nil {
		conn.Close(ctx)
		t.Fatal("connected without the password")
	}
	bad := strings.Replace(c.URL("postgres"), cfg.Password, "wrong_password_0123456789", 1)
	if conn, err := pgx.Connect(ctx, bad); err == nil {
		conn.Close(ctx)
		t.Fatal("connected with a wrong password")
	}
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		t.Fatalf("with the password: %v", err)
	}
	conn.Close(ctx)
}

// A second Start on the data directory of a running cluster says that its
// PostgreSQL is still running, with its pid, instead of "port in use" or a
// lock-file error (issue 13: a postmaster left behind by a killed parent).
func TestStartWhileTheDataDirectoryIsServed(t *testing.T) {
	defer localpg.SetOldPostmasterWait(300 * time.Millisecond)()
	ctx := context.Background()
	dir := tempParent(t)
	cfg := localpg.Config{DataDir: filepath.Join(dir, "data"), Port: testenv.FreePort(t)}
	c, err := localpg.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	again := cfg
	again.Port = testenv.FreePort(t)
	c2, err := localpg.Start(ctx, again)
	if err == nil {
		c2.Stop()
		t.Fatal("second Start on a served data directory succeeded")
	}
	if want := "still running as pid " + strconv.Itoa(c.PID()); !strings.Contains(err.Error(), want) {
		t.Fatalf("second Start: %v; want it to say %q", err, want)
	}
}

// An initdb that is killed part way (here by its context, as when `converge
// dev` is interrupted on its first start) leaves no half-initialized data
// directory behind: the next Start initializes and starts the cluster.
func TestStartAfterAnInterruptedInitdb(t *testing.T) {
	dir := tempParent(t)
	cfg := localpg.Config{DataDir: filepath.Join(dir, "data"), Port: testenv.FreePort(t)}
	for _, after := range []time.Duration{50 * time.Millisecond, 300 * time.Millisecond, 800 * time.Millisecond} {
		ctx, cancel := context.WithTimeout(context.Background(), after)
		c, err := localpg.Start(ctx, cfg)
		cancel()
		if err == nil { // initdb finished in time: start over
			c.Stop()
			os.RemoveAll(cfg.DataDir)
			continue
		}
		c, err = localpg.Start(context.Background(), cfg)
		if err != nil {
			t.Fatalf("Start after initdb was interrupted at %s: %v", after, err)
		}
		conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
		if err != nil {
			c.Stop()
			t.Fatal(err)
		}
		conn.Close(context.Background())
		c.Stop()
		os.RemoveAll(cfg.DataDir)
	}
}

// The data directory may exist when empty (a directory made by hand or by
// an older converge): Start initializes the cluster in it, removing what
// killed attempts left beside it and nothing else. One that is not empty
// and holds no cluster is refused before any initdb, naming it, and
// nothing is left beside it.
func TestStartOnAnEmptyOrForeignDataDirectory(t *testing.T) {
	dir := tempParent(t)
	cfg := localpg.Config{DataDir: filepath.Join(dir, "data"), Port: testenv.FreePort(t)}
	if err := os.Mkdir(cfg.DataDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// Beside it: a killed attempt's directory (removed) and a file of the
	// user's whose name only begins like one (kept).
	leftover, notes := cfg.DataDir+".initdb-123", cfg.DataDir+".initdb.notes"
	if err := os.MkdirAll(filepath.Join(leftover, "base"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(notes, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := localpg.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Start on an empty data directory: %v", err)
	}
	c.Stop()
	if _, err := os.Stat(leftover); !os.IsNotExist(err) {
		t.Errorf("a killed attempt's directory is still there (%v)", err)
	}
	if _, err := os.Stat(notes); err != nil {
		t.Errorf("a file beside the data directory was removed: %v", err)
	}
	// A path with glob characters matches nothing but itself: data in
	// "?" leaves x's leftover-like directory alone.
	other := filepath.Join(dir, "x", "pg.initdb-keepme")
	if err := os.MkdirAll(other, 0o755); err != nil {
		t.Fatal(err)
	}
	globby := localpg.Config{DataDir: filepath.Join(dir, "?", "pg"), Port: testenv.FreePort(t)}
	if err := os.MkdirAll(filepath.Dir(globby.DataDir), 0o755); err != nil {
		t.Fatal(err)
	}
	startStop(t, globby)
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a directory matching the data directory's path as a glob was removed: %v", err)
	}

	foreign := localpg.Config{DataDir: filepath.Join(dir, "foreign"), Port: testenv.FreePort(t)}
	if err := os.MkdirAll(filepath.Join(foreign.DataDir, "notes"), 0o755); err != nil {
		t.Fatal(err)
	}
	if c, err := localpg.Start(context.Background(), foreign); err == nil || !strings.Contains(err.Error(), "not empty") {
		if c != nil {
			c.Stop()
		}
		t.Fatalf("Start on a non-empty directory without a cluster = %v, want it refused as not empty", err)
	}
	if left, _ := filepath.Glob(foreign.DataDir + ".initdb*"); len(left) > 0 {
		t.Fatalf("left beside the refused directory: %v", left)
	}
}

// tempParent returns a directory PostgreSQL's user can enter, removed at
// the end of the test.
func tempParent(t *testing.T) string {
	t.Helper()
	if _, err := localpg.BinDir(); err != nil {
		if testenv.InCI() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	dir, err := os.MkdirTemp("", "converge-localpg-test-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startStop starts cfg's cluster, checks that it answers, and stops it.
func startStop(t *testing.T, cfg localpg.Config) {
	t.Helper()
	c, err := localpg.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
}

// An empty data directory that is a mount point is initialized in place,
// with a marker beside it while initdb runs. A start that finds the marker
// beside a directory that is not empty (an in-place initdb killed part way,
// or by then anything else) refuses and removes nothing; beside an empty
// directory it is removed and initdb runs.
func TestStartInitializesAMountPointInPlace(t *testing.T) {
	defer localpg.TreatAsMountPoint()()
	cfg := localpg.Config{DataDir: filepath.Join(tempParent(t), "data"), Port: testenv.FreePort(t)}
	marker := localpg.InPlaceMarker(cfg.DataDir)
	if err := os.Mkdir(cfg.DataDir, 0o755); err != nil {
		t.Fatal(err)
	}
	startStop(t, cfg)
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("the in-place marker is still there after a complete initdb (%v)", err)
	}
	refused := func() {
		t.Helper()
		before, _ := os.ReadDir(cfg.DataDir)
		c, err := localpg.Start(context.Background(), cfg)
		if err == nil || !strings.Contains(err.Error(), "nothing was removed") {
			if c != nil {
				c.Stop()
			}
			t.Fatalf("Start with the marker beside a directory that is not empty = %v, want it refused", err)
		}
		if after, _ := os.ReadDir(cfg.DataDir); len(after) != len(before) {
			t.Fatalf("the directory went from %d to %d entries", len(before), len(after))
		}
	}

	// The marker beside the complete cluster (a restore, another volume).
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	refused()
	if err := os.Remove(marker); err != nil {
		t.Fatal(err)
	}
	startStop(t, cfg) // the operator removed the marker: the cluster is kept

	// A killed in-place initdb: some of initdb's files, and the marker.
	if err := removeAllIn(cfg.DataDir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cfg.DataDir, "PG_VERSION"), []byte("15\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	refused()
	// The operator empties it, as the error says: initdb runs again.
	if err := removeAllIn(cfg.DataDir); err != nil {
		t.Fatal(err)
	}
	startStop(t, cfg)
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("the in-place marker is still there after initdb (%v)", err)
	}
}

// removeAllIn removes everything in dir, not dir.
func removeAllIn(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// A data directory that is a symbolic link gets its cluster in the link's
// target (the link stays); a link to nothing and a file are refused.
func TestStartFollowsASymlinkedDataDir(t *testing.T) {
	parent := tempParent(t)
	target := filepath.Join(parent, "disk")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(parent, "data")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	startStop(t, localpg.Config{DataDir: link, Port: testenv.FreePort(t)})
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the link was replaced (%v)", err)
	}
	if _, err := os.Stat(filepath.Join(target, "PG_VERSION")); err != nil {
		t.Fatalf("no cluster in the link's target: %v", err)
	}

	dangling := filepath.Join(parent, "dangling")
	if err := os.Symlink(filepath.Join(parent, "missing"), dangling); err != nil {
		t.Fatal(err)
	}
	if _, err := localpg.Start(context.Background(), localpg.Config{DataDir: dangling, Port: testenv.FreePort(t)}); err == nil || !strings.Contains(err.Error(), "symbolic link") {
		t.Fatalf("Start on a dangling link = %v, want it refused", err)
	}
	file := filepath.Join(parent, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := localpg.Start(context.Background(), localpg.Config{DataDir: file, Port: testenv.FreePort(t)}); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("Start on a file = %v, want it refused", err)
	}
	toFile := filepath.Join(parent, "tofile")
	if err := os.Symlink(file, toFile); err != nil {
		t.Fatal(err)
	}
	if _, err := localpg.Start(context.Background(), localpg.Config{DataDir: toFile, Port: testenv.FreePort(t)}); err == nil || !strings.Contains(err.Error(), toFile+" is a symbolic link to "+file) {
		t.Fatalf("Start on a link to a file = %v, want it refused naming the link", err)
	}

	if left, _ := filepath.Glob(filepath.Join(parent, "*.initdb*")); len(left) > 0 {
		t.Fatalf("left beside the refused directories: %v", left)
	}
}

// A marker beside an empty directory that is not a mount point now (the
// volume its in-place initdb ran on may be unmounted, still holding the
// half cluster) is refused, and kept.
func TestStartRefusesAMarkerBesideAnUnmountedPath(t *testing.T) {
	cfg := localpg.Config{DataDir: filepath.Join(tempParent(t), "data"), Port: testenv.FreePort(t)}
	marker := localpg.InPlaceMarker(cfg.DataDir)
	if err := os.Mkdir(cfg.DataDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := localpg.Start(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "not a mount point now") {
		if c != nil {
			c.Stop()
		}
		t.Fatalf("Start = %v, want it refused", err)
	}
	if _, err := os.Stat(marker); err != nil {
		t.Fatalf("the marker was removed: %v", err)
	}
}

// Mount points are found (statx's mount-root attribute, or the device).
func TestIsMountPoint(t *testing.T) {
	if ok, err := localpg.IsMountPoint("/proc"); err != nil || !ok {
		t.Errorf("IsMountPoint(/proc) = %v, %v", ok, err)
	}
	dir := t.TempDir()
	if ok, err := localpg.IsMountPoint(dir); err != nil || ok {
		t.Errorf("IsMountPoint(%s) = %v, %v", dir, ok, err)
	}
}
