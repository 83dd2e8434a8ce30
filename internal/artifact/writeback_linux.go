package artifact

import (
	"os"

	"golang.org/x/sys/unix"
)

// startWriteback asks the kernel to start writing f's dirty pages
// (sync_file_range(2), SYNC_FILE_RANGE_WRITE) without waiting. It is a hint
// that makes no data durable and reports nothing: the fsync that follows
// does both.
func startWriteback(f *os.File) {
	_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
}
