package api

import (
	"errors"
	"net"
	"os"
	"sync"
)

// limits are the API's admission bounds: requests in process per tenant
// (Config.MaxInFlightPerTenant) and request-body bytes in flight
// (Config.MaxBodyBytesInFlight). Both answer at once instead of queueing:
// a client told 429 or 503 with Retry-After backs off; one left waiting
// holds a connection.
type limits struct {
	perTenant int
	maxBytes  int64

	mu       sync.Mutex
	inFlight map[string]int // tenant id -> requests in process (absent: 0)
	bytes    int64
}

func newLimits(perTenant int, maxBytes int64) *limits {
	return &limits{perTenant: perTenant, maxBytes: maxBytes, inFlight: map[string]int{}}
}

// enter admits one more request of tenant, or reports false when it has
// perTenant in process; release ends it.
func (l *limits) enter(tenant string) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.inFlight[tenant] >= l.perTenant {
		return nil, false
	}
	l.inFlight[tenant]++
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.inFlight[tenant]--; l.inFlight[tenant] <= 0 {
			delete(l.inFlight, tenant)
		}
	}, true
}

// reserveBody reserves n bytes of body buffer, or reports false when they
// do not fit under maxBytes; release returns them.
func (l *limits) reserveBody(n int64) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.bytes+n > l.maxBytes {
		return nil, false
	}
	l.bytes += n
	return func() {
		l.mu.Lock()
		l.bytes -= n
		l.mu.Unlock()
	}, true
}

// isTimeout reports whether err is a read deadline that passed (the
// server's ReadTimeout while the body was read).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
