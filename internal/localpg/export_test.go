package localpg

import "time"

// SetOldPostmasterWait shortens waitForOldPostmaster for a test and
// returns the function that restores it.
func SetOldPostmasterWait(d time.Duration) (restore func()) {
	old := oldPostmasterWait
	oldPostmasterWait = d
	return func() { oldPostmasterWait = old }
}

// TreatAsMountPoint makes initdb take every existing empty data directory
// for a mount point, and returns the function that restores it.
func TreatAsMountPoint() (restore func()) {
	old := isMountPoint
	isMountPoint = func(string) (bool, error) { return true, nil }
	return func() { isMountPoint = old }
}

// InPlaceMarker is inPlaceMarker.
func InPlaceMarker(dataDir string) string { return inPlaceMarker(dataDir) }

// IsMountPoint is isMountPoint.
func IsMountPoint(dir string) (bool, error) { return isMountPoint(dir) }
