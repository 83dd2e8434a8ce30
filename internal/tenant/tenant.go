package tenant

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/dbpool"
)

var (
	// ErrInvalidName: a tenant name must match NamePattern.
	ErrInvalidName = errors.New("invalid tenant name")
	// ErrNameTaken: a tenant of this name exists.
	ErrNameTaken = errors.New("tenant name taken")
	// ErrNotFound: no tenant has this name.
	ErrNotFound = errors.New("tenant not found")
	// ErrDisabled: the tenant is disabled; its tokens cannot be rotated (a
	// new token would never authenticate).
	ErrDisabled = errors.New("tenant disabled")
	// ErrUnauthenticated: the token is malformed, unknown, revoked, or its
	// tenant is disabled. Callers answer all of these alike (401), so that
	// the answer is no oracle.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrQuotaExhausted: the tenant's quota has no task left; the create
	// transaction was aborted (nothing of it is written).
	ErrQuotaExhausted = errors.New("quota exhausted")
)

// NamePattern is the form of a tenant name (the tenant table's CHECK).
const NamePattern = `^[a-z0-9][a-z0-9_-]{0,62}$`

var nameRE = regexp.MustCompile(NamePattern)

// TokenPrefix starts every API token, so that secret scanners and people
// recognise one. A token is TokenPrefix and 43 characters of unpadded
// base64url (RFC 4648 section 5) of 32 random bytes: 47 URL-safe characters.
const TokenPrefix = "cvg_"

// tokenLen is the length of a token.
const tokenLen = len(TokenPrefix) + 43

// NewToken returns a new random API token (see TokenPrefix).
func NewToken() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("token: %w", err)
	}
	return TokenPrefix + base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// WellFormed reports whether token has the form NewToken gives.
func WellFormed(token string) bool {
	if len(token) != tokenLen || !strings.HasPrefix(token, TokenPrefix) {
		return false
	}
	_, err := base64.RawURLEncoding.Strict().DecodeString(token[len(TokenPrefix):])
	return err == nil
}

// Hash is what is stored of a token: its SHA-256.
func Hash(token string) [32]byte { return sha256.Sum256([]byte(token)) }

// compare is the comparison of a stored hash with a computed one; a
// variable so that a test can see it is the constant-time one.
var compare = subtle.ConstantTimeCompare

// Tenant is a row of the tenant table with its quota and credentials.
type Tenant struct {
	ID         string
	Name       string
	Admin      bool
	DisabledAt *time.Time
	CreatedAt  time.Time
	// Remaining is the quota's remaining tasks; nil without a quota.
	Remaining *int64
	// Credentials is the number of tokens not revoked.
	Credentials int
}

// Principal is an authenticated caller: the tenant a valid token belongs
// to.
type Principal struct {
	TenantID string
	Name     string
	Admin    bool
	// HasQuota: creates must consume the tenant's quota (QueueConsumeQuota).
	HasQuota bool
}

// Add creates tenant name, with a quota of quota tasks when quota is not
// nil, and its first API token, in one transaction; it returns the tenant
// and the token (shown once: only its hash is stored).
func Add(ctx context.Context, db *pgxpool.Pool, name string, admin bool, quota *int64) (Tenant, string, error) {
	if !nameRE.MatchString(name) {
		return Tenant{}, "", fmt.Errorf("%w %q: want %s", ErrInvalidName, name, NamePattern)
	}
	if quota != nil && *quota < 0 {
		return Tenant{}, "", fmt.Errorf("tenant %s: quota %d must not be negative", name, *quota)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Tenant{}, "", err
	}
	token, err := NewToken()
	if err != nil {
		return Tenant{}, "", err
	}
	var t Tenant
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `INSERT INTO tenant (tenant_id, name, is_admin) VALUES ($1, $2, $3) RETURNING created_at`,
			id.String(), name, admin).Scan(&t.CreatedAt)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "23505" {
			return fmt.Errorf("%w: %s", ErrNameTaken, name)
		}
		if err != nil {
			return fmt.Errorf("insert tenant %s: %w", name, err)
		}
		if err := insertCredential(ctx, tx, name, id.String(), token); err != nil {
			return err
		}
		if quota != nil {
			if _, err := tx.Exec(ctx, `INSERT INTO quota (tenant_id, remaining) VALUES ($1, $2)`, id.String(), *quota); err != nil {
				return fmt.Errorf("insert quota of tenant %s: %w", name, err)
			}
		}
		return nil
	})
	if err != nil {
		return Tenant{}, "", err
	}
	t.ID, t.Name, t.Admin, t.Remaining, t.Credentials = id.String(), name, admin, quota, 1
	t.CreatedAt = t.CreatedAt.UTC()
	return t, token, nil
}

const sqlList = `
SELECT t.tenant_id, t.name, t.is_admin, t.disabled_at, t.created_at, q.remaining,
  (SELECT count(*) FROM api_credential c WHERE c.tenant_id = t.tenant_id AND c.revoked_at IS NULL)
FROM tenant t LEFT JOIN quota q ON q.tenant_id = t.tenant_id`

func scanTenant(row pgx.Row) (Tenant, error) {
	var t Tenant
	err := row.Scan(&t.ID, &t.Name, &t.Admin, &t.DisabledAt, &t.CreatedAt, &t.Remaining, &t.Credentials)
	t.CreatedAt = t.CreatedAt.UTC()
	return t, err
}

// List returns every tenant, by name.
func List(ctx context.Context, db dbpool.Querier) ([]Tenant, error) {
	rows, err := db.Query(ctx, sqlList+` ORDER BY t.name`)
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	ts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	return ts, nil
}

// Get returns tenant name, or ErrNotFound.
func Get(ctx context.Context, db dbpool.Querier, name string) (Tenant, error) {
	t, err := scanTenant(db.QueryRow(ctx, sqlList+` WHERE t.name = $1`, name))
	if errors.Is(err, pgx.ErrNoRows) {
		return Tenant{}, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	return t, err
}

// insertCredential stores token's hash as a credential of tenantID.
func insertCredential(ctx context.Context, tx pgx.Tx, name, tenantID, token string) error {
	h := Hash(token)
	if _, err := tx.Exec(ctx, `INSERT INTO api_credential (token_sha256, tenant_id) VALUES ($1, $2)`, h[:], tenantID); err != nil {
		return fmt.Errorf("insert credential of tenant %s: %w", name, err)
	}
	return nil
}

// Rotate revokes every token of tenant name and returns a new one, in one
// transaction: the old tokens stop working at its commit (an
// Authenticator's cache keeps accepting them for at most its TTL).
func Rotate(ctx context.Context, db *pgxpool.Pool, name string) (string, error) {
	token, err := NewToken()
	if err != nil {
		return "", err
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var id string
		var disabled bool
		err := tx.QueryRow(ctx, `SELECT tenant_id, disabled_at IS NOT NULL FROM tenant WHERE name = $1 FOR UPDATE`, name).Scan(&id, &disabled)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %s", ErrNotFound, name)
		}
		if err != nil {
			return err
		}
		if disabled {
			return fmt.Errorf("%w: %s", ErrDisabled, name)
		}
		if _, err := tx.Exec(ctx, `UPDATE api_credential SET revoked_at = now() WHERE tenant_id = $1 AND revoked_at IS NULL`, id); err != nil {
			return fmt.Errorf("revoke credentials of tenant %s: %w", name, err)
		}
		if err := insertCredential(ctx, tx, name, id, token); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	return token, nil
}

// Disable disables tenant name: its tokens stop authenticating (after at
// most an Authenticator's TTL); its tasks stay. Disabling a disabled tenant
// changes nothing.
func Disable(ctx context.Context, db dbpool.Querier, name string) error {
	tag, err := db.Exec(ctx, `UPDATE tenant SET disabled_at = COALESCE(disabled_at, now()) WHERE name = $1`, name)
	if err != nil {
		return fmt.Errorf("disable tenant %s: %w", name, err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	return nil
}

// Enable re-enables tenant name (its tokens that are not revoked work
// again). Enabling an active tenant changes nothing.
func Enable(ctx context.Context, db dbpool.Querier, name string) error {
	tag, err := db.Exec(ctx, `UPDATE tenant SET disabled_at = NULL WHERE name = $1`, name)
	if err != nil {
		return fmt.Errorf("enable tenant %s: %w", name, err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	return nil
}

// SetQuota sets tenant name's remaining tasks to *remaining, or removes its
// quota (unlimited) when remaining is nil. A create in flight that already
// took one keeps it: the quota row is updated under its lock, as creates
// take from it.
func SetQuota(ctx context.Context, db *pgxpool.Pool, name string, remaining *int64) error {
	if remaining != nil && *remaining < 0 {
		return fmt.Errorf("tenant %s: quota %d must not be negative", name, *remaining)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var id string
		err := tx.QueryRow(ctx, `SELECT tenant_id FROM tenant WHERE name = $1`, name).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %s", ErrNotFound, name)
		}
		if err != nil {
			return err
		}
		if remaining == nil {
			_, err = tx.Exec(ctx, `DELETE FROM quota WHERE tenant_id = $1`, id)
		} else {
			_, err = tx.Exec(ctx, `INSERT INTO quota (tenant_id, remaining) VALUES ($1, $2)
ON CONFLICT (tenant_id) DO UPDATE SET remaining = EXCLUDED.remaining`, id, *remaining)
		}
		if err != nil {
			return fmt.Errorf("set quota of tenant %s: %w", name, err)
		}
		return nil
	})
}

// Lookup authenticates token against the database: the principal of its
// tenant, or ErrUnauthenticated (malformed, unknown, revoked, disabled).
// The row is found by the token's hash (an index lookup, which reveals
// nothing about the token: an attacker cannot choose hash prefixes), and
// the stored hash is then compared with the computed one in constant time.
func Lookup(ctx context.Context, db dbpool.Querier, token string) (Principal, error) {
	if !WellFormed(token) {
		return Principal{}, ErrUnauthenticated
	}
	h := Hash(token)
	var stored []byte
	var p Principal
	err := db.QueryRow(ctx, `
SELECT c.token_sha256, t.tenant_id, t.name, t.is_admin, EXISTS (SELECT 1 FROM quota q WHERE q.tenant_id = t.tenant_id)
FROM api_credential c JOIN tenant t ON t.tenant_id = c.tenant_id
WHERE c.token_sha256 = $1 AND c.revoked_at IS NULL AND t.disabled_at IS NULL`, h[:]).
		Scan(&stored, &p.TenantID, &p.Name, &p.Admin, &p.HasQuota)
	if errors.Is(err, pgx.ErrNoRows) {
		return Principal{}, ErrUnauthenticated
	}
	if err != nil {
		return Principal{}, fmt.Errorf("authenticate: %w", err)
	}
	if compare(stored, h[:]) != 1 {
		return Principal{}, ErrUnauthenticated
	}
	return p, nil
}

// sqlConsumeQuota takes one task from the tenant's quota (seed 2.2: a
// conditional UPDATE, never read-then-write) and fails (division by zero)
// when none is left, which makes PostgreSQL skip the rest of the pipelined
// create transaction, its COMMIT included. Concurrent creates of one tenant
// queue on the quota row's lock; each re-checks remaining >= 1 on the row
// version it finally updates (READ COMMITTED's re-evaluation), so exactly
// remaining of them succeed.
const sqlConsumeQuota = `
WITH taken AS (
  UPDATE quota SET remaining = remaining - 1
  WHERE tenant_id = $1 AND remaining >= 1
  RETURNING 1)
SELECT 1 / (SELECT count(*)::int FROM taken)`

// QueueConsumeQuota queues the consumption of one task of tenantID's quota
// on b (the create transaction, after its idempotency record was inserted:
// a replayed request consumes nothing). When the batch is read, a quota with
// nothing left is ErrQuotaExhausted, and the transaction is aborted.
func QueueConsumeQuota(b *pgx.Batch, tenantID string) {
	q := b.Queue(sqlConsumeQuota, tenantID)
	q.Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "22012" {
			return fmt.Errorf("tenant %s: %w", tenantID, ErrQuotaExhausted)
		}
		return err
	}
}

// CreateScope is the idempotency scope of task creation by tenantID (seed
// 3: keys are scoped; the same key in two tenants is two intents).
func CreateScope(tenantID string) string { return "tenant:" + tenantID + ":create-document-task" }
