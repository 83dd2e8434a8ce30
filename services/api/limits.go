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
	perTenant      int
	maxBytes       int64
	maxTenantBytes int64 // a tenant's share of maxBytes

	mu          sync.Mutex
	inFlight    map[string]int   // tenant id -> requests in process (absent: 0)
	bytes       int64            // body bytes reserved, all tenants
	tenantBytes map[string]int64 // tenant id -> body bytes reserved (absent: 0)
}

// tenantBytesShare is the fraction of the body bytes in flight one tenant
// may hold: a tenant that holds bodies open (sending them slowly, or not at
// all until the read timeout) can take at most a quarter, so other tenants'
// creates are still read.
const tenantBytesShare = 4

func newLimits(perTenant int, maxBytes int64) *limits {
	return &limits{perTenant: perTenant, maxBytes: maxBytes, maxTenantBytes: maxBytes / tenantBytesShare,
		inFlight: map[string]int{}, tenantBytes: map[string]int64{}}
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

// reserveBody reserves n bytes of body buffer for tenant, or reports false
// when they do not fit under maxBytes or under the tenant's share
// (maxBytes / tenantBytesShare, but at least one body of n bytes when the
// tenant holds none); release returns them.
func (l *limits) reserveBody(tenant string, n int64) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	held := l.tenantBytes[tenant]
	if l.bytes+n > l.maxBytes || (held > 0 && held+n > l.maxTenantBytes) {
		return nil, false
	}
	l.bytes += n
	l.tenantBytes[tenant] = held + n
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.bytes -= n
		if l.tenantBytes[tenant] -= n; l.tenantBytes[tenant] <= 0 {
			delete(l.tenantBytes, tenant)
		}
	}, true
}

// isTimeout reports whether err is a read deadline that passed (the
// server's ReadTimeout while the body was read).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
