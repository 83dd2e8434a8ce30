package artifact

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// openUnnamed opens a new file without a name in dir (open(2) with
// O_TMPFILE, mode 0600): it has an inode but no directory entry until
// linkUnnamed gives it one, and the kernel frees it when it is closed
// without a name, so a Put that crashes leaves nothing behind in tmp/.
// It fails where the filesystem or kernel does not support O_TMPFILE
// (EOPNOTSUPP, EISDIR or EINVAL); unnamedSupported tells in advance.
func openUnnamed(dir string) (*os.File, error) {
	return os.OpenFile(dir, unix.O_TMPFILE|os.O_WRONLY, 0o600)
}

// linkUnnamed gives f, opened by openUnnamed, the name dst: linkat(2) of
// /proc/self/fd/<fd> with AT_SYMLINK_FOLLOW, the documented way to link an
// O_TMPFILE file without CAP_DAC_READ_SEARCH (open(2)). Like os.Link it
// fails with an *os.LinkError wrapping EEXIST when dst exists, which is
// never replaced. f must still be open.
func linkUnnamed(f *os.File, dst string) error {
	fd := "/proc/self/fd/" + strconv.FormatUint(uint64(f.Fd()), 10)
	if err := unix.Linkat(unix.AT_FDCWD, fd, unix.AT_FDCWD, dst, unix.AT_SYMLINK_FOLLOW); err != nil {
		return &os.LinkError{Op: "linkat", Old: fd, New: dst, Err: err}
	}
	return nil
}

// probePrefix starts the names of unnamedSupported's probes: a put-* name,
// which RemoveLeftovers sweeps too.
const probePrefix = "put-probe-"

// unnamedSupported reports whether openUnnamed and linkUnnamed work in dir
// (the filesystem supports O_TMPFILE and /proc is mounted), by linking an
// unnamed file to a probe name in dir and removing it. A process killed
// between the two leaves its probe name behind: each call first removes
// every probe name it finds, which is safe while other processes probe (a
// probe name is never needed once linked, and its own removal accepts that
// it is gone), so the names crashed probes left are gone after the next
// Open.
func unnamedSupported(dir string) bool {
	_, _ = removeTempNames(dir, probePrefix, time.Now().Add(time.Hour)) // every probe name: none is needed once linked
	f, err := openUnnamed(dir)
	if err != nil {
		return false
	}
	defer f.Close()
	probe := filepath.Join(dir, probePrefix+strconv.Itoa(os.Getpid())+"-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	if err := linkUnnamed(f, probe); err != nil {
		return false
	}
	err = os.Remove(probe)
	return err == nil || errors.Is(err, os.ErrNotExist)
}
