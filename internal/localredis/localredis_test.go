package localredis_test

import (
	"context"
	"os/exec"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/internal/localredis"
	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// With a Password every command without it is refused; URL carries it.
func TestPassword(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		if testenv.InCI() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	ctx := context.Background()
	s, err := localredis.Start(ctx, localredis.Config{Port: testenv.FreePort(t), Dir: t.TempDir(), Password: "pw_0123456789abcdef"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	anon := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer anon.Close()
	if err := anon.Set(ctx, "k", "v", 0).Err(); err == nil {
		t.Fatal("SET without the password accepted")
	}
	opt, err := redis.ParseURL(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	cl := redis.NewClient(opt)
	defer cl.Close()
	if err := cl.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("with the URL's password: %v", err)
	}
}
