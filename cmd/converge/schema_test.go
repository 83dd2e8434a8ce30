package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/schemas"
)

// TestComponentsRefuseASchemaThatDoesNotServeThem: every component and
// operator command that uses the database stops at once, with the schema
// check's error, on a database one migration behind this binary
// (ErrSchemaBehind) and on one whose oldest served binary is newer than it
// (ErrBinaryTooOld); `converge tenants add` migrates the database behind
// and then works, and `converge migrate` fails on the newer one as they do.
func TestComponentsRefuseASchemaThatDoesNotServeThem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := &runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	commands := func(url string) map[string]interface{ Run(*runEnv) error } {
		svc := Services{DatabaseURL: url, KafkaBrokers: []string{"127.0.0.1:1"}, RedisURL: "redis://127.0.0.1:1/0"}
		return map[string]interface{ Run(*runEnv) error }{
			"api":        &APICmd{Services: svc},
			"relay":      &RelayCmd{Services: svc},
			"worker":     &WorkerCmd{Services: svc},
			"reconciler": &ReconcilerCmd{Services: svc},
			"dlq list":   &DLQListCmd{OperatorDB: OperatorDB{DatabaseURL: url}},
		}
	}
	bin := schemas.BinaryVersion()

	behind := testenv.NewDB(t)
	p := behind.Migrations(t)
	if _, err := p.DownTo(ctx, bin-1); err != nil {
		t.Fatal(err)
	}
	for name, c := range commands(behind.URL) {
		if err := c.Run(env); !errors.Is(err, schemas.ErrSchemaBehind) {
			t.Errorf("converge %s on a database at migration %d: %v, want ErrSchemaBehind", name, bin-1, err)
		}
	}
	if err := (&TenantsAddCmd{OperatorDB: OperatorDB{DatabaseURL: behind.URL}, Name: "late"}).Run(env); err != nil {
		t.Fatalf("converge tenants add on a database behind: %v", err)
	}
	if v, err := schemas.Check(ctx, behind.Pool); err != nil || v.Database != bin {
		t.Fatalf("after tenants add: %+v, %v; want migrated to %d", v, err, bin)
	}

	newer := testenv.NewDB(t)
	if _, err := newer.Pool.Exec(ctx, `UPDATE schema_compatibility SET oldest_binary = $1`, bin+1); err != nil {
		t.Fatal(err)
	}
	for name, c := range commands(newer.URL) {
		if err := c.Run(env); !errors.Is(err, schemas.ErrBinaryTooOld) {
			t.Errorf("converge %s on a schema that serves binaries from %d: %v, want ErrBinaryTooOld", name, bin+1, err)
		}
	}
	// converge dev stops before it writes into its data directory.
	dataDir := t.TempDir()
	if _, err := prepareDevDatabase(ctx, newer.URL, dataDir); !errors.Is(err, schemas.ErrBinaryTooOld) {
		t.Errorf("converge dev's database preparation on a schema that no longer serves it: %v, want ErrBinaryTooOld", err)
	}
	if names, err := os.ReadDir(dataDir); err != nil || len(names) != 0 {
		t.Errorf("converge dev's data directory after the refusal: %v (%v), want empty", names, err)
	}
	// converge migrate has nothing to apply there, and fails as the
	// components do.
	if err := (&MigrateCmd{DatabaseURL: newer.URL}).Run(env); !errors.Is(err, schemas.ErrBinaryTooOld) {
		t.Fatalf("converge migrate on a schema that no longer serves it: %v, want ErrBinaryTooOld", err)
	}
}

// TestWorkersWritePacksOnlyAfterFinalize: on a migrated database, which
// still serves the previous release, components write one file per
// artifact (what that release reads); `converge migrate --finalize` raises
// the floor to this binary, after which they write pack files, and the
// files written before still read.
func TestWorkersWritePacksOnlyAfterFinalize(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := &runEnv{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	db := testenv.NewDB(t)
	dir := t.TempDir()
	first := func(token string) []byte {
		t.Helper()
		raw, err := os.ReadFile(filepath.Join(dir, "objects", token+".obj"))
		if err != nil {
			t.Fatal(err)
		}
		return raw[:min(len(raw), 8)]
	}

	before, err := openArtifacts(dir, env, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if before.WritesPacks() {
		t.Fatal("a store opened before finalizing writes packs")
	}
	if _, err := before.Put("tok-before", "task-1", 1, []byte(`{"a":1}`)); err != nil {
		t.Fatal(err)
	}
	if got := first("tok-before"); got[0] != '{' {
		t.Fatalf("before finalizing, an object file starts %q, want the Meta's JSON line", got)
	}

	if err := (&MigrateCmd{DatabaseURL: db.URL, Finalize: true}).Run(env); err != nil {
		t.Fatalf("converge migrate --finalize: %v", err)
	}
	if v, err := schemas.Check(ctx, db.Pool); err != nil || v.OldestBinary != schemas.BinaryVersion() {
		t.Fatalf("after finalizing: %+v, %v; want the floor at this binary", v, err)
	}
	after, err := openArtifacts(dir, env, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if !after.WritesPacks() {
		t.Fatal("a store opened after finalizing writes one file per object")
	}
	if _, err := after.Put("tok-after", "task-2", 1, []byte(`{"b":2}`)); err != nil {
		t.Fatal(err)
	}
	if got := first("tok-after"); string(got) != "CVPACK1\n" {
		t.Fatalf("after finalizing, an object file starts %q, want a pack", got)
	}
	if obs, err := after.Observe("tok-before"); err != nil || obs.Size != 7 || obs.SHA256 != obs.Meta.SHA256 {
		t.Fatalf("the object written before finalizing: %+v, %v", obs, err)
	}
}
