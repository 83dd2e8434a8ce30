package schemas_test

import (
	"context"
	"errors"
	"io/fs"
	"strings"
	"testing"

	"github.com/pressly/goose/v3"

	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/schemas"
)

// TestBinaryVersion: the binary's version is its highest embedded migration,
// and every embedded name carries a number.
func TestBinaryVersion(t *testing.T) {
	names, err := fs.Glob(schemas.Migrations(), "*.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("embedded migrations: %v %v", names, err)
	}
	last, err := goose.NumericComponent(names[len(names)-1])
	if err != nil {
		t.Fatal(err)
	}
	if got := schemas.BinaryVersion(); got != last || got < 18 {
		t.Fatalf("BinaryVersion %d, want %d (the last of %d files, at least 18)", got, last, len(names))
	}
}

// TestCheck: a binary runs against its own schema and a newer one that
// still serves it; it refuses a database behind it (ErrSchemaBehind, also
// one without any migration) and a schema whose oldest served binary is
// newer than it (ErrBinaryTooOld).
func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := schemas.BinaryVersion()

	t.Run("same", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		v, err := schemas.Check(ctx, db.Pool)
		if err != nil || v != (schemas.Versions{Database: bin, Binary: bin, OldestBinary: v.OldestBinary}) || v.OldestBinary == 0 || v.OldestBinary > bin {
			t.Fatalf("Check = %+v, %v; want database = binary = %d, 0 < oldest ≤ %d", v, err, bin, bin)
		}
	})
	t.Run("newer schema that serves it", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		if _, err := db.Pool.Exec(ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, bin+1); err != nil {
			t.Fatal(err)
		}
		if v, err := schemas.Check(ctx, db.Pool); err != nil || v.Database != bin+1 {
			t.Fatalf("Check = %+v, %v; want database %d and no error", v, err, bin+1)
		}
		// converge dev of this binary migrates first: a migration it does
		// not know is left alone.
		if err := schemas.Migrate(ctx, db.Pool); err != nil {
			t.Fatalf("Migrate on a newer schema: %v", err)
		}
	})
	t.Run("newer schema that no longer serves it", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		if _, err := db.Pool.Exec(ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, bin+1); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, `UPDATE schema_compatibility SET oldest_binary = $1`, bin+1); err != nil {
			t.Fatal(err)
		}
		v, err := schemas.Check(ctx, db.Pool)
		if !errors.Is(err, schemas.ErrBinaryTooOld) || v.OldestBinary != bin+1 {
			t.Fatalf("Check = %+v, %v; want ErrBinaryTooOld", v, err)
		}
		t.Log(err)
	})
	t.Run("behind", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		p := db.Migrations(t)
		if _, err := p.DownTo(ctx, bin-1); err != nil {
			t.Fatal(err)
		}
		v, err := schemas.Check(ctx, db.Pool)
		if !errors.Is(err, schemas.ErrSchemaBehind) || v.Database != bin-1 {
			t.Fatalf("Check = %+v, %v; want ErrSchemaBehind at %d", v, err, bin-1)
		}
		t.Log(err)
		if err := schemas.Migrate(ctx, db.Pool); err != nil {
			t.Fatal(err)
		}
		if _, err := schemas.Check(ctx, db.Pool); err != nil {
			t.Fatalf("after Migrate: %v", err)
		}
	})
	t.Run("no migrations", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		if _, err := db.Pool.Exec(ctx, `DROP TABLE goose_db_version, schema_compatibility`); err != nil {
			t.Fatal(err)
		}
		v, err := schemas.Check(ctx, db.Pool)
		if !errors.Is(err, schemas.ErrSchemaBehind) || v.Database != 0 || v.OldestBinary != 0 {
			t.Fatalf("Check = %+v, %v; want ErrSchemaBehind at 0", v, err)
		}
	})
}

// TestFinalize: a migrated database serves the previous release's binaries
// and so has binaries write one-object artifact files; Finalize raises the
// floor to this binary (never lowers it), after which packs are written,
// a binary one below is refused, and migration 00021 refuses to go down.
func TestFinalize(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := schemas.BinaryVersion()
	db := testenv.NewDB(t)
	v, err := schemas.Check(ctx, db.Pool)
	if err != nil || v.ArtifactPacks() || v.OldestBinary >= schemas.ArtifactPacksFrom {
		t.Fatalf("migrated: %+v, %v; want a floor below %d, no packs", v, err, schemas.ArtifactPacksFrom)
	}
	p := db.Migrations(t)
	if _, err := p.DownTo(ctx, schemas.ArtifactPacksFrom-1); err != nil {
		t.Fatalf("down before finalizing: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	v, err = schemas.Finalize(ctx, db.Pool)
	if err != nil || v.OldestBinary != bin || !v.ArtifactPacks() {
		t.Fatalf("Finalize = %+v, %v; want oldest %d and packs", v, err, bin)
	}
	if v, err := schemas.Check(ctx, db.Pool); err != nil || v.OldestBinary != bin {
		t.Fatalf("Check after Finalize = %+v, %v", v, err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE schema_compatibility SET oldest_binary = $1`, bin+5); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, bin+5); err != nil {
		t.Fatal(err)
	}
	if v, err := schemas.Finalize(ctx, db.Pool); !errors.Is(err, schemas.ErrBinaryTooOld) {
		t.Fatalf("Finalize by a binary the schema no longer serves = %+v, %v; want ErrBinaryTooOld", v, err)
	}
	if _, err := db.Pool.Exec(ctx, `DELETE FROM goose_db_version WHERE version_id = $1`, bin+5); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE schema_compatibility SET oldest_binary = $1`, bin); err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, schemas.ArtifactPacksFrom-1); err == nil || !strings.Contains(err.Error(), "finalized") {
		t.Fatalf("down after finalizing: %v; want a refusal", err)
	}
}
