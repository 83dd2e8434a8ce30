// Package localpg runs a local PostgreSQL cluster as a child process, with
// wal_level=logical, for `converge dev` (make run) and for tests.
//
// It uses the installed server binaries (pg_config --bindir, else the newest
// /usr/lib/postgresql/*/bin). PostgreSQL refuses to run as root, so when the
// caller is root the cluster is created and run as the "postgres" system user
// (the data directory is chowned to it). The server process gets a parent
// death signal, so it never outlives the process that started it.
package localpg

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sys/unix"

	"github.com/converge-run/converge/internal/fsutil"
)

// Config describes the cluster to run. Zero values take the documented
// defaults.
type Config struct {
	// DataDir is the cluster's data directory; created with initdb when it
	// holds no cluster. Required.
	DataDir string
	// Port is the TCP port on 127.0.0.1. Required (use FreePort in tests).
	Port int
	// Fsync keeps fsync on. Defaults to false; `converge dev` and benchmarks
	// set it, tests leave it off for speed.
	Fsync bool
	// Settings are extra -c name=value server settings.
	Settings map[string]string
	// Password, when set, is required of every connection (user postgres,
	// SCRAM-SHA-256; URL carries it): set with ALTER ROLE at every start and
	// pg_hba.conf's trust entries rewritten to scram-sha-256, so a cluster
	// initialized without one gets it too. It must consist of URL-safe
	// characters (A-Z a-z 0-9 _ -). Empty leaves the cluster on trust (tests,
	// benchmarks).
	Password string
	// Logger receives progress messages. Defaults to slog.Default().
	Logger *slog.Logger
}

// Cluster is a running local PostgreSQL server.
type Cluster struct {
	cfg  Config
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// ErrNoBinaries: no PostgreSQL server binaries are installed.
var ErrNoBinaries = errors.New("PostgreSQL server binaries not found (install Debian's postgresql-15 package)")

// BinDir returns the directory of the PostgreSQL server binaries.
func BinDir() (string, error) {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		d := strings.TrimSpace(string(out))
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", ErrNoBinaries
}

func versionOf(dir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return v
}

// Start initialises DataDir when needed, starts the server and waits until it
// accepts connections (at most 60 s).
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.DataDir == "" || cfg.Port == 0 {
		return nil, errors.New("localpg: DataDir and Port are required")
	}
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	cred, err := credential()
	if err != nil {
		return nil, err
	}
	dataDir, err := resolveDataDir(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	cfg.DataDir = dataDir
	if err := checkTraversable(filepath.Dir(dataDir), cred); err != nil {
		return nil, err
	}
	removeInitdbLeftovers(dataDir, cfg.Logger)
	_, err = os.Stat(filepath.Join(dataDir, "PG_VERSION"))
	if _, merr := os.Lstat(inPlaceMarker(dataDir)); errors.Is(err, os.ErrNotExist) || merr == nil {
		if err := initdb(ctx, bin, dataDir, cfg.Fsync, cred, cfg.Logger); err != nil {
			return nil, err
		}
	} else if err != nil {
		return nil, err
	}
	if pid := waitForOldPostmaster(dataDir, cfg.Logger); pid != 0 {
		return nil, fmt.Errorf("a PostgreSQL of this data directory (%s) is still running as pid %d after %s: stop it (kill -INT %d) and start again", dataDir, pid, oldPostmasterWait, pid)
	}
	// After the wait: an old postmaster's fast shutdown removes files while
	// the walk runs.
	if err := chown(dataDir, cred); err != nil {
		return nil, err
	}
	if err := portFree(cfg.Port); err != nil {
		return nil, err
	}
	logPath := filepath.Join(dataDir, "server.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	settings := map[string]string{
		"listen_addresses":        "127.0.0.1",
		"port":                    strconv.Itoa(cfg.Port),
		"unix_socket_directories": "",
		"wal_level":               "logical",
		"max_replication_slots":   "32",
		"max_wal_senders":         "32",
		"max_connections":         "200",
		"fsync":                   onOff(cfg.Fsync),
		"synchronous_commit":      onOff(cfg.Fsync),
		"full_page_writes":        onOff(cfg.Fsync),
		"shared_buffers":          "256MB",
		"max_slot_wal_keep_size":  "4GB",
	}
	for k, v := range cfg.Settings {
		settings[k] = v
	}
	args := []string{"-D", dataDir}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		args = append(args, "-c", k+"="+settings[k])
	}
	cmd := exec.Command(filepath.Join(bin, "postgres"), args...)
	cmd.Dir = os.TempDir()
	cmd.Stdout, cmd.Stderr = logf, logf
	// SIGINT is PostgreSQL's fast shutdown: it ends sessions and checkpoints.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGINT, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	c := &Cluster{cfg: cfg, cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err == nil {
			// Make sure we reached our own server, not another one that
			// took the port after portFree looked.
			var dir string
			qerr := conn.QueryRow(ctx, "SHOW data_directory").Scan(&dir)
			conn.Close(ctx)
			if qerr == nil && filepath.Clean(dir) != dataDir {
				c.Stop()
				return nil, fmt.Errorf("port %d is served by another PostgreSQL (data directory %s)", cfg.Port, dir)
			}
			break
		}
		select {
		case <-c.done:
			return nil, fmt.Errorf("postgres exited during start-up (%v); see %s", c.err, logPath)
		case <-ctx.Done():
			c.Stop()
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			c.Stop()
			return nil, fmt.Errorf("postgres did not accept connections within 60s: %v; see %s", err, logPath)
		}
	}
	if cfg.Password != "" {
		if err := c.requirePassword(ctx, cred); err != nil {
			c.Stop()
			return nil, err
		}
	}
	cfg.Logger.Info("postgres started", "port", cfg.Port, "data_dir", dataDir, "fsync", cfg.Fsync, "password", cfg.Password != "")
	return c, nil
}

var passwordRE = regexp.MustCompile(`^[A-Za-z0-9_-]{16,128}$`)

// requirePassword sets the postgres role's password and makes pg_hba.conf
// ask for it (see Config.Password).
func (c *Cluster) requirePassword(ctx context.Context, cred *syscall.Credential) error {
	if !passwordRE.MatchString(c.cfg.Password) {
		return errors.New("localpg: Password must be 16-128 characters of A-Z a-z 0-9 _ -")
	}
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	// The character set checked above cannot end the literal.
	if _, err := conn.Exec(ctx, "ALTER ROLE postgres PASSWORD '"+c.cfg.Password+"'"); err != nil {
		return fmt.Errorf("set the postgres password: %w", err)
	}
	hba := filepath.Join(c.cfg.DataDir, "pg_hba.conf")
	b, err := os.ReadFile(hba)
	if err != nil {
		return err
	}
	lines := strings.Split(string(b), "\n")
	changed := false
	for i, l := range lines {
		f := strings.Fields(l)
		if len(f) >= 4 && !strings.HasPrefix(f[0], "#") && f[len(f)-1] == "trust" {
			lines[i] = strings.Join(append(f[:len(f)-1], "scram-sha-256"), " ")
			changed = true
		}
	}
	if !changed {
		return nil
	}
	if err := os.WriteFile(hba, []byte(strings.Join(lines, "\n")), 0o600); err != nil {
		return err
	}
	if err := chown(hba, cred); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("reload pg_hba.conf: %w", err)
	}
	c.cfg.Logger.Info("postgres: password authentication (scram-sha-256) required from now on", "data_dir", c.cfg.DataDir)
	return nil
}

// URL returns a connection URL for database db.
func (c *Cluster) URL(db string) string {
	user := "postgres"
	if c.cfg.Password != "" {
		user += ":" + c.cfg.Password
	}
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", user, c.cfg.Port, db)
}

// Port returns the TCP port.
func (c *Cluster) Port() int { return c.cfg.Port }

// Exited is closed when the postmaster has exited, by Stop or otherwise (a
// crash, kill -9); ExitErr then tells how.
func (c *Cluster) Exited() <-chan struct{} { return c.done }

// ExitErr is the postmaster's exit status (exec.Cmd.Wait's error; nil for a
// clean exit) once Exited is closed, nil before.
func (c *Cluster) ExitErr() error {
	select {
	case <-c.done:
		return c.err
	default:
		return nil
	}
}

// PID returns the postmaster's process id.
func (c *Cluster) PID() int { return c.cmd.Process.Pid }

// Stop shuts the server down (fast shutdown, then kill after 30 s) and waits
// for it to exit.
func (c *Cluster) Stop() error {
	if c == nil || c.cmd == nil || c.cmd.Process == nil {
		return nil
	}
	_ = c.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	return nil
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// resolveDataDir returns the absolute path of the data directory, the
// target of a symbolic link (a data directory linked to another disk: the
// cluster goes where the link points, and the link stays). A link whose
// target is missing, and a path that is not a directory, are errors.
func resolveDataDir(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return dir, nil
	} else if err != nil {
		return "", err
	}
	real := dir
	if fi.Mode()&os.ModeSymlink != 0 {
		if real, err = filepath.EvalSymlinks(dir); err != nil {
			return "", fmt.Errorf("the data directory %s is a symbolic link that does not resolve (a missing target or a loop): %w", dir, err)
		}
		if fi, err = os.Stat(real); err != nil {
			return "", err
		}
	}
	if !fi.IsDir() {
		if real != dir {
			return "", fmt.Errorf("the data directory %s is a symbolic link to %s, which is not a directory", dir, real)
		}
		return "", fmt.Errorf("the data directory %s is not a directory", dir)
	}
	return real, nil
}

// inPlaceMarker is the file beside dataDir that marks an initdb running in
// dataDir itself (a mount point, see initdb): while it exists, what dataDir
// holds may be a half-made cluster.
func inPlaceMarker(dataDir string) string { return dataDir + ".inplace-initdb" }

// removeInitdbLeftovers removes, as far as it can, the directories that
// interrupted initdb attempts left beside dataDir (the entries of its
// parent named base+".initdb-*", the names initdb gives them; compared as
// strings, not as a glob, so that a path holding * ? [ matches nothing
// else). Best effort: an attempt of a killed process may still be writing
// into its directory for a moment (initdb's postgres child outlives a
// killed initdb until it reads the end of its input); what stays is
// removed at a later start.
func removeInitdbLeftovers(dataDir string, log *slog.Logger) {
	parent, base := filepath.Dir(dataDir), filepath.Base(dataDir)
	entries, _ := os.ReadDir(parent)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), base+".initdb-") {
			continue
		}
		d := filepath.Join(parent, e.Name())
		if err := os.RemoveAll(d); err != nil {
			log.Warn("initdb: an interrupted attempt's directory is not removed yet", "dir", d, "err", err)
		}
	}
}

// isMountPoint reports whether directory dir is a mount point, a bind mount
// of its parent's filesystem included: statx's STATX_ATTR_MOUNT_ROOT
// (Linux 5.8 and later), else a device that differs from its parent's. A
// variable so that a test can make a directory one.
var isMountPoint = func(dir string) (bool, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &st); err != nil {
		return false, err
	}
	if st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
	}
	var p unix.Stat_t
	if err := unix.Stat(filepath.Dir(dir), &p); err != nil {
		return false, err
	}
	return unix.Mkdev(st.Dev_major, st.Dev_minor) != p.Dev, nil
}

// initdb creates the cluster of dataDir so that dataDir holds either a
// complete cluster or none, whenever the process is killed:
//
//   - dataDir must be absent or an empty directory (else an error says so,
//     before any initdb);
//   - initdb runs in a new sibling directory dataDir+".initdb-<random>"
//     (a fresh name per attempt keeps an attempt still running from a
//     killed process, whose failure cleanup empties its own directory,
//     away from this one; Start removes the leftovers), with Pdeathsig so
//     that it dies with us;
//   - its files are synced when sync is set (initdb --sync-only; the run
//     itself is --no-sync, faster than syncing file by file; a cluster run
//     without fsync skips it);
//   - the directory is renamed to dataDir, replacing an empty one in the
//     same step (rename(2); Go's os.Rename refuses to), and the rename is
//     synced. A directory that is no longer empty then is refused.
//
// A dataDir that is a mount point cannot be replaced (its device differs
// from its parent's, or the rename answers EBUSY: a bind mount): initdb
// runs in it (initdbInPlace), with inPlaceMarker beside it until the
// cluster is complete. A start that finds the marker beside a directory
// that is not empty refuses, naming both, and removes nothing: the
// directory may hold a half-made cluster, or by then anything else (a
// restore, another volume), and only its owner can tell. Beside an empty
// mount point the marker is removed and initdb runs; beside an empty
// directory that is not a mount point, or none, it refuses too (the volume
// that holds the half cluster may be unmounted).
//
// Without sync (a cluster run without fsync), a power loss may make the
// rename or the marker's removal durable before the cluster's files.
//
// Before, an initdb killed part way (an interrupted first `converge dev`)
// left PG_VERSION in dataDir and every later start failed.
func initdb(ctx context.Context, bin, dataDir string, sync bool, cred *syscall.Credential, log *slog.Logger) error {
	parent, base := filepath.Dir(dataDir), filepath.Base(dataDir)
	marker := inPlaceMarker(dataDir)
	if _, err := os.Lstat(marker); err == nil {
		entries, err := os.ReadDir(dataDir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if len(entries) > 0 {
			return fmt.Errorf("initdb: %s says an initdb in %s was interrupted, so the directory may hold a half-made cluster; nothing was removed: if the directory is to be kept (a complete cluster, a restore), remove the marker; else empty the directory and remove the marker; then start again", marker, dataDir)
		}
		// Empty: the marker is removed only where its initdb ran, on a
		// mount point; an empty directory that is not one now may be the
		// path with the volume unmounted, which still holds the half
		// cluster.
		mount := false
		if err == nil {
			if mount, err = isMountPoint(dataDir); err != nil {
				return err
			}
		}
		if !mount {
			return fmt.Errorf("initdb: %s says an initdb in %s was interrupted, and %s is not a mount point now: mount the volume it ran on and start again, or remove the marker if that initdb is to be forgotten", marker, dataDir, dataDir)
		}
		if err := os.Remove(marker); err != nil {
			return err
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	entries, err := os.ReadDir(dataDir)
	switch {
	case err == nil && len(entries) > 0:
		return fmt.Errorf("initdb: %s is not empty and holds no cluster (no PG_VERSION): remove it, or point the data directory elsewhere", dataDir)
	case err == nil:
		mount, err := isMountPoint(dataDir)
		if err != nil {
			return err
		}
		if mount {
			return initdbInPlace(ctx, bin, dataDir, sync, cred, log)
		}
	case !errors.Is(err, os.ErrNotExist):
		return err
	}
	tmp, err := os.MkdirTemp(parent, base+".initdb-")
	if err != nil {
		return err
	}
	if err := runInitdb(ctx, bin, tmp, dataDir, sync, cred, log); err != nil {
		return err
	}
	if err := syscall.Rename(tmp, dataDir); err != nil {
		_ = os.RemoveAll(tmp)
		if errors.Is(err, syscall.EBUSY) { // a mount point on its parent's device (a bind mount)
			return initdbInPlace(ctx, bin, dataDir, sync, cred, log)
		}
		return fmt.Errorf("initdb: move the new cluster into place at %s: %w (it must be absent or an empty directory)", dataDir, err)
	}
	return fsutil.SyncDir(parent)
}

// initdbInPlace runs initdb in dataDir itself (an empty mount point), with
// inPlaceMarker beside it from before the run until the cluster is complete
// and synced (see initdb). A failure before the run removes the marker; an
// initdb that fails leaves it (initdb removes what it wrote when it fails,
// so the next start finds the directory empty and proceeds).
func initdbInPlace(ctx context.Context, bin, dataDir string, sync bool, cred *syscall.Credential, log *slog.Logger) error {
	parent, marker := filepath.Dir(dataDir), inPlaceMarker(dataDir)
	f, err := os.OpenFile(marker, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o644)
	if err != nil {
		return fmt.Errorf("initdb: %s is a mount point, initialized in place, and its marker cannot be written beside it: %w", dataDir, err)
	}
	_, err = f.WriteString(dataDir + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fsutil.SyncDir(parent)
	}
	if err == nil {
		// Still empty now that the marker is there (a file written
		// meanwhile would be taken for initdb's by nobody, but refused).
		var entries []os.DirEntry
		if entries, err = os.ReadDir(dataDir); err == nil && len(entries) > 0 {
			err = fmt.Errorf("%s changed while its initdb was being prepared: start again", dataDir)
		}
	}
	if err != nil {
		_ = os.Remove(marker)
		return fmt.Errorf("initdb: %w", err)
	}
	if err := runInitdb(ctx, bin, dataDir, dataDir, sync, cred, log); err != nil {
		return err
	}
	if err := os.Remove(marker); err != nil {
		return err
	}
	return fsutil.SyncDir(parent)
}

// runInitdb runs initdb in dir (dataDir's cluster, named in messages) as
// cred, with Pdeathsig, then initdb --sync-only when sync is set.
func runInitdb(ctx context.Context, bin, dir, dataDir string, sync bool, cred *syscall.Credential, log *slog.Logger) error {
	if err := os.Chmod(dir, 0o700); err != nil {
		return err
	}
	if err := chown(dir, cred); err != nil {
		return err
	}
	log.Info("initdb", "data_dir", dataDir)
	run := func(args ...string) error {
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
		cmd.Dir = os.TempDir()
		out, err := cmd.CombinedOutput()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil: // interrupted: its output is only its cleanup
			return fmt.Errorf("initdb %s: %w", dataDir, ctx.Err())
		}
		return fmt.Errorf("initdb %s: %w\n%s", dataDir, err, out)
	}
	if err := run("-D", dir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"); err != nil {
		return err
	}
	if sync {
		return run("-D", dir, "--sync-only")
	}
	return nil
}

// credential returns the identity to run PostgreSQL as: the postgres system
// user when we are root, nil (ourselves) otherwise.
func credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root needs the postgres system user (from the postgresql package): %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func chown(dir string, cred *syscall.Credential) error {
	if cred == nil {
		return nil
	}
	return filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err == nil {
			err = os.Lchown(p, int(cred.Uid), int(cred.Gid))
		}
		if errors.Is(err, os.ErrNotExist) && p != dir {
			return nil // removed meanwhile (an old postmaster's postmaster.pid)
		}
		return err
	})
}

// waitForOldPostmaster waits (at most 30 s) for a postmaster that a killed
// parent left shutting down to exit, so the new one can take the data
// directory's lock file. It returns the pid of one still running after
// that, 0 when none is (no postmaster.pid, or its process is gone).
func waitForOldPostmaster(dataDir string, log *slog.Logger) int {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil || pid <= 0 {
		return 0
	}
	for i := 0; i < int(oldPostmasterWait/(100*time.Millisecond)); i++ {
		if err := syscall.Kill(pid, 0); err != nil || !isPostgres(pid) {
			return 0
		}
		if i == 0 {
			log.Info("waiting for the previous postgres to exit", "pid", pid)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return pid
}

// oldPostmasterWait bounds waitForOldPostmaster (a variable for tests).
var oldPostmasterWait = 30 * time.Second

// isPostgres reports whether process pid is a PostgreSQL server process
// (/proc/<pid>/comm; true where /proc cannot tell), not another process
// that reused the pid of a stale postmaster.pid.
func isPostgres(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	if err != nil {
		return !errors.Is(err, fs.ErrNotExist)
	}
	return strings.HasPrefix(strings.TrimSpace(string(b)), "postgres")
}

// checkTraversable reports, when the server runs as another user, a parent
// directory that user cannot enter (initdb would fail with a bare
// "Permission denied").
func checkTraversable(dir string, cred *syscall.Credential) error {
	if cred == nil {
		return nil
	}
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err == nil {
			sys, ok := st.Sys().(*syscall.Stat_t)
			if ok && st.Mode().Perm()&0o001 == 0 && sys.Uid != cred.Uid {
				return fmt.Errorf("PostgreSQL runs as the postgres user, which cannot enter %s (mode %v): make it traversable (chmod o+x %s) or choose another data directory", d, st.Mode().Perm(), d)
			}
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// portFree reports an error when something already listens on
// 127.0.0.1:port: PostgreSQL would fail to bind and the start-up check
// would reach the other server.
func portFree(port int) error {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return fmt.Errorf("port %d on 127.0.0.1 is already in use (choose another with CONVERGE_DEV_PG_PORT): %w", port, err)
	}
	return l.Close()
}
