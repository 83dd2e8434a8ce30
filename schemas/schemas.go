// Package schemas holds converge's contracts as files: the numbered SQL
// migrations of the PostgreSQL data model (migrations/, applied by goose),
// the JSON Schema of every Kafka event type (events/), and the HTTP API
// description (openapi.yaml).
//
// Migrations are embedded with go:embed, so the binary carries the schema it
// expects; Migrate applies what is missing and is safe to call from several
// processes at once (goose takes a PostgreSQL advisory lock).
package schemas

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

//go:embed events/*.json
var eventFS embed.FS

// Migrations returns the embedded migration files (numbered NNNNN_name.sql).
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFS, "migrations")
	if err != nil {
		panic(err) // the embed pattern guarantees the folder exists
	}
	return sub
}

// Events returns the embedded event JSON Schemas, one file per event type and
// major version (for example TaskCreated.v1.json).
func Events() fs.FS {
	sub, err := fs.Sub(eventFS, "events")
	if err != nil {
		panic(err)
	}
	return sub
}

// Migrate applies every embedded migration not yet applied to the database
// behind pool. It serialises concurrent callers with a session advisory lock.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	return migrateDB(ctx, db)
}

func migrateDB(ctx context.Context, db *sql.DB) error {
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return fmt.Errorf("migration lock: %w", err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, Migrations(), goose.WithSessionLocker(locker))
	if err != nil {
		return fmt.Errorf("migration provider: %w", err)
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("apply migrations: %w", err)
	}
	return nil
}
