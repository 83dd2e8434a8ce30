package localpg

import (
	"syscall"
	"time"
)

// SetOldPostmasterWait shortens waitForOldPostmaster for a test and
// returns the function that restores it.
func SetOldPostmasterWait(d time.Duration) (restore func()) {
	old := oldPostmasterWait
	oldPostmasterWait = d
	return func() { oldPostmasterWait = old }
}

// FailRemoveEmptyDir makes initdb find its empty data directory
// unremovable, as a mount point is, and returns the function that
// restores it.
func FailRemoveEmptyDir() (restore func()) {
	old := removeEmptyDir
	removeEmptyDir = func(string) error { return syscall.EBUSY }
	return func() { removeEmptyDir = old }
}

// InPlaceMarker is inPlaceMarker.
func InPlaceMarker(dataDir string) string { return inPlaceMarker(dataDir) }
