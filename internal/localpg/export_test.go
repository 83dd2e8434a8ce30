package localpg

import "time"

// SetOldPostmasterWait shortens waitForOldPostmaster for a test and
// returns the function that restores it.
func SetOldPostmasterWait(d time.Duration) (restore func()) {
	old := oldPostmasterWait
	oldPostmasterWait = d
	return func() { oldPostmasterWait = old }
}
