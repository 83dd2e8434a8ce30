package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/internal/testenv"
)

// The tenants commands against PostgreSQL: add (with a quota), quota,
// disable, enable, rotate, list; unknown names and bad arguments fail.
func TestTenantsCommands(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	env := &runEnv{ctx: context.Background(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	d := OperatorDB{DatabaseURL: db.URL}
	q := int64(2)
	if err := (&TenantsAddCmd{OperatorDB: d, Name: "cli-team", Quota: &q}).Run(env); err != nil {
		t.Fatal(err)
	}
	get := func() tenant.Tenant {
		t.Helper()
		tn, err := tenant.Get(env.ctx, db.Pool, "cli-team")
		if err != nil {
			t.Fatal(err)
		}
		return tn
	}
	if tn := get(); tn.Remaining == nil || *tn.Remaining != 2 || tn.Credentials != 1 {
		t.Fatalf("after add: %+v", tn)
	}
	ten := int64(10)
	if err := (&TenantsQuotaCmd{OperatorDB: d, Name: "cli-team", Remaining: &ten}).Run(env); err != nil || *get().Remaining != 10 {
		t.Fatalf("quota 10: %v %+v", err, get())
	}
	if err := (&TenantsQuotaCmd{OperatorDB: d, Name: "cli-team", None: true}).Run(env); err != nil || get().Remaining != nil {
		t.Fatalf("quota --none: %v %+v", err, get())
	}
	if err := (&TenantsQuotaCmd{OperatorDB: d, Name: "cli-team"}).Run(env); err == nil {
		t.Error("quota without a number or --none accepted")
	}
	if err := (&TenantsDisableCmd{OperatorDB: d, Name: "cli-team"}).Run(env); err != nil || get().DisabledAt == nil {
		t.Fatalf("disable: %v", err)
	}
	if err := (&TenantsRotateCmd{OperatorDB: d, Name: "cli-team"}).Run(env); err == nil {
		t.Error("rotate of a disabled tenant accepted")
	}
	if err := (&TenantsEnableCmd{OperatorDB: d, Name: "cli-team"}).Run(env); err != nil || get().DisabledAt != nil {
		t.Fatalf("enable: %v", err)
	}
	if err := (&TenantsRotateCmd{OperatorDB: d, Name: "cli-team"}).Run(env); err != nil || get().Credentials != 1 {
		t.Fatalf("rotate: %v %+v", err, get())
	}
	if err := (&TenantsListCmd{OperatorDB: d}).Run(env); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []interface{ Run(*runEnv) error }{
		&TenantsDisableCmd{OperatorDB: d, Name: "nobody"}, &TenantsEnableCmd{OperatorDB: d, Name: "nobody"},
		&TenantsRotateCmd{OperatorDB: d, Name: "nobody"}, &TenantsAddCmd{OperatorDB: d, Name: "Bad Name"},
		&TenantsListCmd{OperatorDB: OperatorDB{DataDir: t.TempDir()}},
	} {
		if err := cmd.Run(env); err == nil {
			t.Errorf("%T succeeded", cmd)
		}
	}
}
