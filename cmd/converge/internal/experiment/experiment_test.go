package experiment_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/converge-run/converge/cmd/converge/internal/experiment"
	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestExperiments runs every experiment of `converge experiment run all`
// against the real pipeline, each on its own database and broker.
func TestExperiments(t *testing.T) {
	t.Parallel()
	for _, e := range experiment.List() {
		t.Run(e.Name, func(t *testing.T) {
			t.Parallel()
			db := testenv.NewDB(t)
			k := testenv.NewKafka(t)
			redisURL, _ := testenv.Redis(t)
			env := experiment.Env{DatabaseURL: db.URL, Brokers: k.Brokers, RedisURL: redisURL, ArtifactDir: t.TempDir(),
				SlotName: "s_" + db.Name, PublicationName: "p_" + db.Name}
			out := t.TempDir()
			log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			rep, err := experiment.Run(context.Background(), e, env, out, log)
			if err != nil {
				t.Errorf("%v", err)
			}
			if rep != nil {
				for _, c := range rep.Checks {
					if !c.OK {
						t.Errorf("check %q failed: %s", c.Name, c.Detail)
					}
				}
				if len(rep.Checks) < 5 {
					t.Errorf("only %d checks", len(rep.Checks))
				}
			}
			for _, ext := range []string{".json", ".md"} {
				if _, err := os.Stat(filepath.Join(out, e.Name+ext)); err != nil {
					t.Errorf("report %s: %v", ext, err)
				}
			}
		})
	}
}
