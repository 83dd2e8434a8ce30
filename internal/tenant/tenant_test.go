package tenant

import (
	"context"
	"crypto/subtle"
	"errors"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestTokenForm(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for range 100 {
		tok, err := NewToken()
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`^[A-Za-z0-9_-]{32,}$`).MatchString(tok) || !WellFormed(tok) || seen[tok] {
			t.Fatalf("token %q: want >= 32 URL-safe characters, well formed, new", tok)
		}
		seen[tok] = true
	}
	for _, bad := range []string{"", "cvg_", "Bearer x", "cvg_" + "!" + string(make([]byte, 42)), "xyz_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"} {
		if WellFormed(bad) {
			t.Errorf("WellFormed(%q) = true", bad)
		}
	}
}

// Add, Lookup, Rotate, Disable against PostgreSQL: only the hash is
// stored; a rotated token stops authenticating, the new one works; a
// disabled tenant's tokens stop; names are unique and checked.
func TestLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	ten, tok, err := Add(ctx, db.Pool, "team-a", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var stored int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM api_credential WHERE position($1::bytea IN token_sha256) > 0`, []byte(tok)).Scan(&stored); err != nil || stored != 0 {
		t.Fatalf("token stored in clear? %d, %v", stored, err)
	}
	p, err := Lookup(ctx, db.Pool, tok)
	if err != nil || p.TenantID != ten.ID || p.Name != "team-a" || p.Admin || p.HasQuota {
		t.Fatalf("Lookup = %+v, %v", p, err)
	}
	if _, _, err := Add(ctx, db.Pool, "team-a", true, nil); !errors.Is(err, ErrNameTaken) {
		t.Errorf("second Add = %v, want ErrNameTaken", err)
	}
	for _, bad := range []string{"", "Team", "-x", "a b", "ä"} {
		if _, _, err := Add(ctx, db.Pool, bad, false, nil); !errors.Is(err, ErrInvalidName) {
			t.Errorf("Add(%q) = %v, want ErrInvalidName", bad, err)
		}
	}
	newTok, err := Rotate(ctx, db.Pool, "team-a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Lookup(ctx, db.Pool, tok); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("rotated-out token: %v, want ErrUnauthenticated", err)
	}
	if p, err := Lookup(ctx, db.Pool, newTok); err != nil || p.TenantID != ten.ID {
		t.Errorf("new token: %+v, %v", p, err)
	}
	if _, err := Rotate(ctx, db.Pool, "nobody"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Rotate(nobody) = %v", err)
	}
	if err := Disable(ctx, db.Pool, "team-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := Lookup(ctx, db.Pool, newTok); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("disabled tenant's token: %v, want ErrUnauthenticated", err)
	}
	if _, err := Rotate(ctx, db.Pool, "team-a"); !errors.Is(err, ErrDisabled) {
		t.Errorf("Rotate of a disabled tenant = %v, want ErrDisabled", err)
	}
	if err := Enable(ctx, db.Pool, "team-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := Lookup(ctx, db.Pool, newTok); err != nil {
		t.Errorf("re-enabled tenant's token: %v", err)
	}
	five := int64(5)
	if err := SetQuota(ctx, db.Pool, "team-a", &five); err != nil {
		t.Fatal(err)
	}
	if p, err := Lookup(ctx, db.Pool, newTok); err != nil || !p.HasQuota {
		t.Errorf("after SetQuota: %+v %v", p, err)
	}
	if err := SetQuota(ctx, db.Pool, "team-a", nil); err != nil {
		t.Fatal(err)
	}
	if p, _ := Lookup(ctx, db.Pool, newTok); p.HasQuota {
		t.Error("quota still there after SetQuota(nil)")
	}
	if err := SetQuota(ctx, db.Pool, "nobody", &five); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetQuota(nobody) = %v", err)
	}
	if err := Disable(ctx, db.Pool, "team-a"); err != nil {
		t.Fatal(err)
	}
	if err := Disable(ctx, db.Pool, "nobody"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Disable(nobody) = %v", err)
	}
	q := int64(3)
	if _, _, err := Add(ctx, db.Pool, "team-b", true, &q); err != nil {
		t.Fatal(err)
	}
	ts, err := List(ctx, db.Pool)
	if err != nil || len(ts) != 2 {
		t.Fatalf("List = %+v, %v", ts, err)
	}
	if ts[0].Name != "team-a" || ts[0].DisabledAt == nil || ts[0].Credentials != 1 || ts[1].Name != "team-b" || !ts[1].Admin || ts[1].Remaining == nil || *ts[1].Remaining != 3 {
		t.Errorf("List = %+v", ts)
	}
	unknown, _ := NewToken()
	if _, err := Lookup(ctx, db.Pool, unknown); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("unknown token: %v", err)
	}
}

// The stored hash is compared with crypto/subtle's constant-time
// comparison.
func TestLookupComparesInConstantTime(t *testing.T) {
	ctx := context.Background()
	db := testenv.NewDB(t)
	_, tok, err := Add(ctx, db.Pool, "ct", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	compare = func(x, y []byte) int { calls.Add(1); return subtle.ConstantTimeCompare(x, y) }
	t.Cleanup(func() { compare = subtle.ConstantTimeCompare })
	if _, err := Lookup(ctx, db.Pool, tok); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 1 {
		t.Errorf("constant-time comparisons: %d, want 1", calls.Load())
	}
}

// An Authenticator remembers a success for its TTL only.
func TestAuthenticatorCache(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	_, tok, err := Add(ctx, db.Pool, "cached", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := NewAuthenticator(db.Pool, time.Minute)
	now := time.Now()
	a.now = func() time.Time { return now }
	if _, err := a.Authenticate(ctx, tok); err != nil {
		t.Fatal(err)
	}
	if err := Disable(ctx, db.Pool, "cached"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Authenticate(ctx, tok); err != nil {
		t.Errorf("within the TTL: %v, want the cached success", err)
	}
	now = now.Add(time.Minute)
	if _, err := a.Authenticate(ctx, tok); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("after the TTL: %v, want ErrUnauthenticated", err)
	}
}

// Seed 2.2: 50 concurrent transactions consuming a quota of 10 — exactly
// 10 commit, remaining ends at 0, the other 40 get ErrQuotaExhausted.
func TestQuotaRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	q := int64(10)
	ten, _, err := Add(ctx, db.Pool, "limited", false, &q)
	if err != nil {
		t.Fatal(err)
	}
	var ok, exhausted atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 50 {
		wg.Go(func() {
			<-start
			err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				b := &pgx.Batch{}
				QueueConsumeQuota(b, ten.ID)
				return tx.SendBatch(ctx, b).Close()
			})
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, ErrQuotaExhausted):
				exhausted.Add(1)
			default:
				t.Error(err)
			}
		})
	}
	close(start)
	wg.Wait()
	var remaining int64
	if err := db.Pool.QueryRow(ctx, `SELECT remaining FROM quota WHERE tenant_id = $1`, ten.ID).Scan(&remaining); err != nil {
		t.Fatal(err)
	}
	if ok.Load() != 10 || exhausted.Load() != 40 || remaining != 0 {
		t.Errorf("committed %d, exhausted %d, remaining %d; want 10, 40, 0", ok.Load(), exhausted.Load(), remaining)
	}
}
