package tenant

import (
	"context"
	"sync"
	"time"

	"github.com/converge-run/converge/internal/dbpool"
)

// DefaultCacheTTL is how long an Authenticator trusts a successful lookup.
const DefaultCacheTTL = 2 * time.Second

// maxCached bounds an Authenticator's cache; it is emptied when full.
const maxCached = 10_000

// Authenticator authenticates bearer tokens (Lookup), remembering each
// successful lookup for TTL so that a busy client costs one query per TTL,
// not one per request. A rotated or disabled credential is therefore
// refused at most TTL after its change. Failed lookups are not remembered.
// Safe for concurrent use.
type Authenticator struct {
	db  dbpool.Querier
	ttl time.Duration
	now func() time.Time

	mu    sync.Mutex
	cache map[[32]byte]cached
}

type cached struct {
	p       Principal
	expires time.Time
}

// NewAuthenticator returns an Authenticator over db; ttl <= 0 takes
// DefaultCacheTTL.
func NewAuthenticator(db dbpool.Querier, ttl time.Duration) *Authenticator {
	if ttl <= 0 {
		ttl = DefaultCacheTTL
	}
	return &Authenticator{db: db, ttl: ttl, now: time.Now, cache: map[[32]byte]cached{}}
}

// Authenticate returns the principal of token, or ErrUnauthenticated, or a
// database error (the caller answers 503: the token may be valid).
func (a *Authenticator) Authenticate(ctx context.Context, token string) (Principal, error) {
	if !WellFormed(token) {
		return Principal{}, ErrUnauthenticated
	}
	h := Hash(token)
	now := a.now()
	a.mu.Lock()
	c, ok := a.cache[h]
	a.mu.Unlock()
	if ok && now.Before(c.expires) {
		return c.p, nil
	}
	p, err := Lookup(ctx, a.db, token)
	if err != nil {
		return Principal{}, err
	}
	a.mu.Lock()
	if len(a.cache) >= maxCached {
		clear(a.cache)
	}
	a.cache[h] = cached{p: p, expires: now.Add(a.ttl)}
	a.mu.Unlock()
	return p, nil
}
