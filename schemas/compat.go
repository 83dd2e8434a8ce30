package schemas

import (
	"context"
	"errors"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"
)

// Versions are what a binary and a database know of each other's schema,
// as migration numbers (the NNNNN of migrations/NNNNN_name.sql).
type Versions struct {
	// Database is the highest migration applied to the database, as goose
	// records it in goose_db_version (0: none, or no goose table).
	Database int64
	// Binary is the highest migration embedded in this binary: the schema
	// it was built for.
	Binary int64
	// OldestBinary is schema_compatibility.oldest_binary: the oldest
	// binary, by its Binary number, that the database's schema still
	// serves. A migration that removes what older binaries use raises it.
	// 0 when the database has no such table (before migration 00018).
	OldestBinary int64
}

var (
	// ErrSchemaBehind: the database lacks migrations this binary needs
	// (Database < Binary). Run `converge migrate` of this binary first.
	ErrSchemaBehind = errors.New("database schema is behind this binary")
	// ErrBinaryTooOld: the database's schema no longer serves this binary
	// (Binary < OldestBinary), as after a rollback across a migration that
	// removed something this binary uses.
	ErrBinaryTooOld = errors.New("the database schema no longer serves this binary")
)

// ArtifactPacksFrom is the first binary version that reads artifact pack
// files (migration 00021; internal/artifact). Binaries write them only
// where the schema serves no older binary: see Versions.ArtifactPacks.
const ArtifactPacksFrom = 21

// ArtifactPacks reports whether a binary may write artifact pack files:
// whether the schema serves only binaries that read them (OldestBinary >=
// ArtifactPacksFrom, after Finalize). Otherwise it writes one file per
// object, which every release reads, so that a rollback to the previous
// release keeps reading every artifact.
func (v Versions) ArtifactPacks() bool { return v.OldestBinary >= ArtifactPacksFrom }

// Finalize ends an upgrade: it raises schema_compatibility.oldest_binary to
// this binary's version (never lowers it), so that binaries built before
// it no longer start against the database (ErrBinaryTooOld) and the
// formats they cannot read may be written (Versions.ArtifactPacks). It
// first checks as Check does and fails the same way; it returns the
// versions after the change. `converge migrate --finalize` calls it once
// every component runs this release (deploy/README.md, "Upgrades and
// rollbacks"); the all-in-one pipeline calls it when told to
// (pipeline.Config.Finalize: `converge dev` on its embedded database).
func Finalize(ctx context.Context, pool *pgxpool.Pool) (Versions, error) {
	v, err := Check(ctx, pool)
	if err != nil {
		return v, err
	}
	if err := pool.QueryRow(ctx, `UPDATE schema_compatibility SET oldest_binary = GREATEST(oldest_binary, $1) RETURNING oldest_binary`, v.Binary).
		Scan(&v.OldestBinary); err != nil {
		return v, fmt.Errorf("raise the database's oldest served binary: %w", err)
	}
	return v, nil
}

// BinaryVersion is the highest migration embedded in this binary.
func BinaryVersion() int64 {
	names, err := fs.Glob(Migrations(), "*.sql")
	if err != nil {
		panic(err) // only a malformed pattern fails
	}
	var max int64
	for _, n := range names {
		v, err := goose.NumericComponent(n)
		if err != nil {
			panic(fmt.Sprintf("embedded migration %s: %v", n, err)) // TestBinaryVersion reads every name
		}
		if v > max {
			max = v
		}
	}
	return max
}

// Check compares the database's schema with this binary's, the upgrade rule
// of deploy/README.md ("Upgrades and rollbacks"): `converge migrate` of a release runs
// before its components start, and a release's schema serves the binaries
// of the release before it, until a migration raises
// schema_compatibility.oldest_binary past them. It returns the versions and
//   - ErrSchemaBehind (wrapped, with both numbers) when Database < Binary;
//   - ErrBinaryTooOld (wrapped) when Binary < OldestBinary;
//   - another error when the database cannot be read;
//   - nil otherwise, also when Database > Binary: a newer schema that still
//     serves this binary.
//
// Components check once, when they start: a migration applied later that
// raises the floor above a running binary is not noticed by it.
func Check(ctx context.Context, pool *pgxpool.Pool) (Versions, error) {
	v := Versions{Binary: BinaryVersion()}
	// goose_db_version: goose deletes a migration's row when it goes
	// down, so the highest version_id is the schema's version (as goose's
	// GetDBVersion, which fails where the table does not exist yet). A
	// table that does not exist cannot be named even in a branch not
	// taken, so the first query asks which of the two exist.
	var hasGoose, hasFloor bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('goose_db_version') IS NOT NULL, to_regclass('schema_compatibility') IS NOT NULL`).
		Scan(&hasGoose, &hasFloor); err != nil {
		return v, fmt.Errorf("read the database's schema version: %w", err)
	}
	if hasGoose {
		if err := pool.QueryRow(ctx, `SELECT COALESCE(max(version_id), 0) FROM goose_db_version`).Scan(&v.Database); err != nil {
			return v, fmt.Errorf("read the database's schema version: %w", err)
		}
	}
	if hasFloor {
		if err := pool.QueryRow(ctx, `SELECT oldest_binary FROM schema_compatibility`).Scan(&v.OldestBinary); err != nil {
			return v, fmt.Errorf("read the database's oldest served binary: %w", err)
		}
	}
	switch {
	case v.Database < v.Binary:
		return v, fmt.Errorf("%w: the database is at migration %d, this binary needs %d: run `converge migrate` of this binary first",
			ErrSchemaBehind, v.Database, v.Binary)
	case v.Binary < v.OldestBinary:
		return v, fmt.Errorf("%w: the database is at migration %d, which serves binaries built for migration %d or later; this one is built for %d: run a newer binary",
			ErrBinaryTooOld, v.Database, v.OldestBinary, v.Binary)
	}
	return v, nil
}
