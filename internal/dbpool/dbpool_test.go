package dbpool

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

func TestUse(t *testing.T) {
	given := &pgxpool.Pool{}
	p, owned, err := Use(given, "", "worker")
	if p != given || owned || err != nil {
		t.Fatalf("Use(given) = %p, %v, %v; want the given pool, not owned", p, owned, err)
	}
	if _, _, err := Use(nil, "postgres://%zz", "worker"); err == nil || !strings.HasPrefix(err.Error(), "worker: open database pool:") {
		t.Fatalf("Use(nil, bad url) err = %v, want it prefixed with the component", err)
	}
}
