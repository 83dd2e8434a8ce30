package testenv_test

import (
	"context"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestHarness(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM task").Scan(&n); err != nil {
		t.Fatal(err)
	}
	_, rc := testenv.Redis(t)
	if err := rc.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	k := testenv.NewKafka(t)
	if len(k.Brokers) == 0 {
		t.Fatal("no brokers")
	}
}
