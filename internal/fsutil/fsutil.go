// Package fsutil holds the file-system steps that more than one durable
// store needs (the artifact store, the embedded PostgreSQL's data directory).
package fsutil

import (
	"fmt"
	"os"
)

// SyncDir fsyncs directory dir, making its entries' creations, renames and
// removals durable (fsync(2) on a directory; POSIX leaves a new name's
// durability to it, ext4 and XFS honour it). The error names dir: an open or
// fsync failure, for example ENOENT when dir is gone.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}
