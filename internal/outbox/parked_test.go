package outbox_test

import (
	"context"
	"slices"
	"testing"

	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/testenv"
)

// ListParked returns the undecided parked rows oldest park first; Code
// keeps one last error code, All adds the decided ones, Limit bounds the
// answer; unparked rows are never listed.
func TestListParkedFilter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	for _, r := range []struct{ id, code string }{{"p-1", "MESSAGE_TOO_LARGE"}, {"p-2", "INVALID_RECORD"}, {"p-3", "MESSAGE_TOO_LARGE"}} {
		insertRow(t, db.Pool, r.id, false)
		if ok, err := outbox.Park(ctx, db.Pool, r.id, r.code, "refused"); err != nil || !ok {
			t.Fatalf("Park %s = %v, %v", r.id, ok, err)
		}
	}
	insertRow(t, db.Pool, "unparked", false)
	if err := outbox.Decide(ctx, db.Pool, "p-1", outbox.DecisionDiscarded, "ops", "not needed"); err != nil {
		t.Fatal(err)
	}
	ids := func(f outbox.ParkedFilter) []string {
		t.Helper()
		rows, err := outbox.ListParked(ctx, db.Pool, f)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, r := range rows {
			out = append(out, r.ID)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		f    outbox.ParkedFilter
		want []string
	}{
		{"undecided", outbox.ParkedFilter{}, []string{"p-2", "p-3"}},
		{"code", outbox.ParkedFilter{Code: "MESSAGE_TOO_LARGE"}, []string{"p-3"}},
		{"code and all", outbox.ParkedFilter{Code: "MESSAGE_TOO_LARGE", All: true}, []string{"p-1", "p-3"}},
		{"all", outbox.ParkedFilter{All: true}, []string{"p-1", "p-2", "p-3"}},
		{"limit", outbox.ParkedFilter{All: true, Limit: 1}, []string{"p-1"}},
		{"unknown code", outbox.ParkedFilter{Code: "NO_SUCH_CODE", All: true}, nil},
	} {
		if got := ids(tc.f); !slices.Equal(got, tc.want) {
			t.Errorf("%s: ListParked = %v, want %v", tc.name, got, tc.want)
		}
	}
}
