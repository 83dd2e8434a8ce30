// Package dbpool holds the one rule the consumers share for their
// PostgreSQL pool: use the pool the caller gives, or open one from a URL and
// own it.
package dbpool

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Use returns pool and owned=false when pool is not nil: the caller keeps
// owning it. Otherwise it opens a pool on url (pgxpool defaults, or the
// pool_* parameters of the URL) and returns owned=true: the component must
// close it when it stops. The error wraps pgxpool's, prefixed with who.
func Use(pool *pgxpool.Pool, url, who string) (p *pgxpool.Pool, owned bool, err error) {
	if pool != nil {
		return pool, false, nil
	}
	if p, err = pgxpool.New(context.Background(), url); err != nil {
		return nil, false, fmt.Errorf("%s: open database pool: %w", who, err)
	}
	return p, true, nil
}
