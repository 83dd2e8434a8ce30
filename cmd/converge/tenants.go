package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/schemas"
)

// TenantsCmd manages tenants and their API tokens (package tenant).
type TenantsCmd struct {
	Add     TenantsAddCmd     `cmd:"" help:"Add a tenant and print its first API token (shown once)."`
	List    TenantsListCmd    `cmd:"" help:"List tenants."`
	Rotate  TenantsRotateCmd  `cmd:"" help:"Revoke every token of a tenant and print a new one (shown once)."`
	Disable TenantsDisableCmd `cmd:"" help:"Disable a tenant: its tokens stop working (within 2 seconds); its tasks stay."`
	Enable  TenantsEnableCmd  `cmd:"" help:"Enable a disabled tenant again (its tokens that were not rotated out work again)."`
	Quota   TenantsQuotaCmd   `cmd:"" help:"Set a tenant's remaining tasks (--none: no quota)."`
}

// TenantsEnableCmd is `converge tenants enable NAME`.
type TenantsEnableCmd struct {
	OperatorDB
	Name string `arg:"" help:"Tenant name."`
}

// Run enables the tenant.
func (c *TenantsEnableCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := tenant.Enable(env.ctx, pool, c.Name); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "tenant %s enabled\n", c.Name)
	return nil
}

// TenantsQuotaCmd is `converge tenants quota NAME (N | --none)`.
type TenantsQuotaCmd struct {
	OperatorDB
	Name      string `arg:"" help:"Tenant name."`
	Remaining *int64 `arg:"" optional:"" help:"Tasks the tenant may still create."`
	None      bool   `help:"Remove the quota (unlimited)."`
}

// Run sets or removes the quota.
func (c *TenantsQuotaCmd) Run(env *runEnv) error {
	if (c.Remaining == nil) == !c.None {
		return errors.New("give the remaining tasks, or --none for no quota")
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := tenant.SetQuota(env.ctx, pool, c.Name, c.Remaining); err != nil {
		return err
	}
	if c.None {
		fmt.Fprintf(os.Stderr, "tenant %s: no quota\n", c.Name)
	} else {
		fmt.Fprintf(os.Stderr, "tenant %s: %d tasks left\n", c.Name, *c.Remaining)
	}
	return nil
}

// OperatorDB is how the operator commands (tenants, outbox, inbox, dlq)
// reach PostgreSQL:
// CONVERGE_DATABASE_URL, else the database of a `converge dev` whose data
// directory is --data-dir (it writes its URL there).
type OperatorDB struct {
	DatabaseURL string `name:"database-url" env:"CONVERGE_DATABASE_URL" help:"PostgreSQL URL (default: the converge dev stack of --data-dir)."`
	DataDir     string `env:"CONVERGE_DATA_DIR" default:".converge" help:"Data directory of a running converge dev."`
}

func (d OperatorDB) open(ctx context.Context) (*pgxpool.Pool, error) {
	url, err := d.url()
	if err != nil {
		return nil, err
	}
	return openPool(ctx, url, "admin")
}

// openToMigrate is open without the schema check, for a command that
// migrates first.
func (d OperatorDB) openToMigrate(ctx context.Context) (*pgxpool.Pool, error) {
	url, err := d.url()
	if err != nil {
		return nil, err
	}
	return connectDB(ctx, url, "admin")
}

func (d OperatorDB) url() (string, error) {
	if d.DatabaseURL != "" {
		return d.DatabaseURL, nil
	}
	b, err := os.ReadFile(filepath.Join(d.DataDir, devDatabaseURLFile))
	if err != nil {
		return "", fmt.Errorf("no database: set CONVERGE_DATABASE_URL, or run converge dev with data directory %s (%v)", d.DataDir, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// TenantsAddCmd is `converge tenants add NAME [--quota N] [--admin]`.
type TenantsAddCmd struct {
	OperatorDB
	Name  string `arg:"" help:"Tenant name (lower case letters, digits, _ and -; at most 63)."`
	Quota *int64 `help:"Tasks the tenant may create (default: no quota)."`
	Admin bool   `help:"The tenant's tokens may use the admin endpoints and read every task."`
}

// Run adds the tenant and prints its token on a line of its own.
func (c *TenantsAddCmd) Run(env *runEnv) error {
	pool, err := c.openToMigrate(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := schemas.Migrate(env.ctx, pool); err != nil {
		return err
	}
	if _, err := schemas.Check(env.ctx, pool); err != nil {
		return err
	}
	t, tok, err := tenant.Add(env.ctx, pool, c.Name, c.Admin, c.Quota)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "tenant %s added (id %s); its API token, shown only now:\n", t.Name, t.ID)
	fmt.Println(tok)
	return nil
}

// TenantsListCmd is `converge tenants list`.
type TenantsListCmd struct {
	OperatorDB
}

// Run prints one line per tenant (never a token).
func (c *TenantsListCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ts, err := tenant.List(env.ctx, pool)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tID\tADMIN\tSTATE\tQUOTA LEFT\tTOKENS\tCREATED")
	for _, t := range ts {
		state, quota := "active", "-"
		if t.DisabledAt != nil {
			state = "disabled"
		}
		if t.Remaining != nil {
			quota = fmt.Sprint(*t.Remaining)
		}
		fmt.Fprintf(tw, "%s\t%s\t%v\t%s\t%s\t%d\t%s\n", t.Name, t.ID, t.Admin, state, quota, t.Credentials, t.CreatedAt.Format("2006-01-02T15:04:05Z"))
	}
	return tw.Flush()
}

// TenantsRotateCmd is `converge tenants rotate NAME`.
type TenantsRotateCmd struct {
	OperatorDB
	Name string `arg:"" help:"Tenant name."`
}

// Run revokes the tenant's tokens and prints the new one on a line of its
// own.
func (c *TenantsRotateCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	tok, err := tenant.Rotate(env.ctx, pool, c.Name)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "tenant %s: every earlier token revoked; the new one, shown only now:\n", c.Name)
	fmt.Println(tok)
	return nil
}

// TenantsDisableCmd is `converge tenants disable NAME`.
type TenantsDisableCmd struct {
	OperatorDB
	Name string `arg:"" help:"Tenant name."`
}

// Run disables the tenant.
func (c *TenantsDisableCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := tenant.Disable(env.ctx, pool, c.Name); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "tenant %s disabled\n", c.Name)
	return nil
}

// The files `converge dev` writes into its data directory (mode 0600): its
// database URL, and the tokens of its tenants dev and admin.
const (
	devDatabaseURLFile = "database.url"
	devTokenDir        = "tokens"
)

// devTenants are the tenants `converge dev` makes sure exist: "dev" for
// clients (submit, loadgen, the examples) and "admin" for the admin
// endpoints.
var devTenants = []struct {
	name  string
	admin bool
}{{"dev", false}, {"admin", true}}

// ensureDevTenants makes sure the dev stack's tenants exist and that their
// tokens are in dataDir/tokens/<name>.token (0600): a token file that still
// authenticates is kept; otherwise the tenant is added, or its tokens are
// rotated when it exists (a lost file). It returns the tokens by name.
func ensureDevTenants(ctx context.Context, pool *pgxpool.Pool, dataDir string) (map[string]string, error) {
	dir := filepath.Join(dataDir, devTokenDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, dt := range devTenants {
		path := filepath.Join(dir, dt.name+".token")
		if b, err := os.ReadFile(path); err == nil {
			tok := strings.TrimSpace(string(b))
			if _, err := tenant.Lookup(ctx, pool, tok); err == nil {
				out[dt.name] = tok
				continue
			}
		}
		_, tok, err := tenant.Add(ctx, pool, dt.name, dt.admin, nil)
		if errors.Is(err, tenant.ErrNameTaken) {
			tok, err = tenant.Rotate(ctx, pool, dt.name)
		}
		if err != nil {
			return nil, fmt.Errorf("dev tenant %s: %w", dt.name, err)
		}
		if err := os.WriteFile(path, []byte(tok+"\n"), 0o600); err != nil {
			return nil, err
		}
		out[dt.name] = tok
	}
	return out, nil
}

// clientToken is the API token of submit and loadgen: --token /
// CONVERGE_TOKEN, else the dev tenant's token of a converge dev whose data
// directory is dataDir; an error says where it looked when there is none.
func clientToken(token, dataDir string) (string, error) {
	if token != "" {
		return token, nil
	}
	path := filepath.Join(dataDir, devTokenDir, "dev.token")
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("no API token: pass --token or set CONVERGE_TOKEN (a tenant's token: converge tenants add), or run next to a converge dev (its dev token %s: %v)", path, err)
	}
	return strings.TrimSpace(string(b)), nil
}
