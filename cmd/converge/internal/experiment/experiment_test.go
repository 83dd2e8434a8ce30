package experiment_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/experiment"
	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// testOutage is the outage of database-outage and kafka-outage here: half
// the shipped experiment.OutageFor (30 s), to keep `make test` short; still
// longer than the consumers' session timeout (10 s, internal/consumergroup).
const testOutage = 15 * time.Second

// TestExperiments runs every experiment of `converge experiment run all`
// against the real pipeline, each on its own database and embedded broker
// (experiment.NewBroker, as the command starts it), with the outages
// shortened to testOutage.
func TestExperiments(t *testing.T) {
	t.Parallel()
	for _, e := range experiment.List() {
		t.Run(e.Name, func(t *testing.T) {
			t.Parallel()
			db := testenv.NewDB(t)
			log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			k, err := experiment.NewBroker(t.TempDir(), log.With("component", "devbroker"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(k.Close)
			redisURL, _ := testenv.Redis(t)
			env := experiment.Env{DatabaseURL: db.URL, Brokers: k.ListenAddrs(), Broker: k, RedisURL: redisURL, ArtifactDir: t.TempDir(),
				SlotName: "s_" + db.Name, PublicationName: "p_" + db.Name, Outage: testOutage}
			out := t.TempDir()
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
