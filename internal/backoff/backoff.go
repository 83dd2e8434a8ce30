// Package backoff is converge's one retry delay: exponential with jitter.
// The worker's in-place retries, the projector's Redis writes and the
// dead-letter intake's inserts wait by it.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Delay returns the wait before retry n (0-based): min doubled n times,
// capped at max, drawn uniformly from [d/2, d] (jitter spreads the retries of
// many records or processes that failed together). min <= 0 gives 0.
func Delay(min, max time.Duration, n int) time.Duration {
	if min <= 0 {
		return 0
	}
	d := max
	if n < 32 {
		if v := min << n; v > 0 && v < max {
			d = v
		}
	}
	half := d / 2
	return half + rand.N(d-half+1)
}

// Sleep waits Delay(min, max, n); false when ctx ended first.
func Sleep(ctx context.Context, min, max time.Duration, n int) bool {
	return Wait(ctx, Delay(min, max, n))
}

// Wait waits d (a delay the caller drew with Delay, e.g. to log it first);
// false when ctx ended first.
func Wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
