// Package dbpool holds what every PostgreSQL user of converge shares: the
// rule for its pool (use the pool the caller gives, or open one from a URL
// and own it) and Querier, the interface the aggregate stores run their
// statements on.
package dbpool

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

// Querier is what the aggregate stores (task, outbox, inbox, ledger) need
// from a pgx.Tx, a *pgx.Conn or a *pgxpool.Pool: a statement runs in the
// caller's transaction when the caller passes one.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ Querier = pgx.Tx(nil)
	_ Querier = (*pgx.Conn)(nil)
	_ Querier = (*pgxpool.Pool)(nil)
)
