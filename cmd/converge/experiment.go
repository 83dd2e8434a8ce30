package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/experiment"
	"github.com/converge-run/converge/internal/freeport"
	"github.com/converge-run/converge/internal/localpg"
	"github.com/converge-run/converge/internal/localredis"
)

// ExperimentCmd runs the fault-injection experiments (cmd/converge/internal/experiment).
type ExperimentCmd struct {
	List ExperimentListCmd `cmd:"" help:"List the experiments."`
	Run  ExperimentRunCmd  `cmd:"" help:"Run experiments against the real pipeline on fresh embedded services."`
}

// ExperimentListCmd is `converge experiment list`.
type ExperimentListCmd struct{}

// Run prints name, seed section and title of each experiment.
func (ExperimentListCmd) Run(*runEnv) error {
	for _, e := range experiment.List() {
		fmt.Printf("%-28s %-22s %s\n", e.Name, "seed "+e.Seed, e.Title)
	}
	return nil
}

// ExperimentRunCmd is `converge experiment run NAME|all --out DIR`.
type ExperimentRunCmd struct {
	Name string `arg:"" help:"Experiment name (see 'converge experiment list') or 'all'."`
	Out  string `default:"experiments" help:"Directory for <name>.json (snapshot) and <name>.md (report)."`
	Keep bool   `help:"Keep the temporary data directory of the embedded services."`
	// Outage is experiment.Env.Outage.
	Outage time.Duration `default:"30s" help:"How long database-outage keeps PostgreSQL and kafka-outage keeps Kafka unreachable."`
}

// Run starts one PostgreSQL cluster and one redis-server in a temporary
// directory on free ports, then runs each experiment on a database and an
// embedded broker (experiment.NewBroker, its data in the temporary
// directory) of its own, and exits 1 when an invariant failed.
func (c *ExperimentRunCmd) Run(env *runEnv) error {
	if c.Outage <= 0 {
		return fmt.Errorf("--outage %s: want a positive duration", c.Outage)
	}
	var list []experiment.Experiment
	if c.Name == "all" {
		list = experiment.List()
	} else {
		e, ok := experiment.Lookup(c.Name)
		if !ok {
			return fmt.Errorf("unknown experiment %q (see 'converge experiment list')", c.Name)
		}
		list = []experiment.Experiment{e}
	}
	ctx := env.ctx
	tmp, err := os.MkdirTemp("", "converge-experiment-")
	if err != nil {
		return err
	}
	_ = os.Chmod(tmp, 0o755)
	if c.Keep {
		fmt.Println("data directory:", tmp)
	} else {
		defer os.RemoveAll(tmp)
	}
	quiet := slog.New(slog.DiscardHandler)
	pgPort, err := freeport.Pick()
	if err != nil {
		return err
	}
	pg, err := localpg.Start(ctx, localpg.Config{DataDir: filepath.Join(tmp, "pg"), Port: pgPort, Logger: quiet})
	if err != nil {
		return fmt.Errorf("embedded PostgreSQL: %w", err)
	}
	defer pg.Stop()
	redisPort, err := freeport.Pick()
	if err != nil {
		return err
	}
	rs, err := localredis.Start(ctx, localredis.Config{Port: redisPort, Dir: filepath.Join(tmp, "redis")})
	if err != nil {
		return fmt.Errorf("embedded Redis: %w", err)
	}
	defer rs.Stop()

	failed := 0
	for _, e := range list {
		db := "exp_" + strings.ReplaceAll(e.Name, "-", "_")
		if err := ensureDatabase(ctx, pg.URL("postgres"), db); err != nil {
			return err
		}
		kc, err := experiment.NewBroker(filepath.Join(tmp, "kafka", e.Name), env.log.With("experiment", e.Name, "component", "devbroker"))
		if err != nil {
			return fmt.Errorf("embedded Kafka broker: %w", err)
		}
		xenv := experiment.Env{DatabaseURL: pg.URL(db), Brokers: kc.ListenAddrs(), Broker: kc, Outage: c.Outage, RedisURL: rs.URL(),
			ArtifactDir: filepath.Join(tmp, "artifacts", e.Name), SlotName: "s_" + db, PublicationName: "p_" + db}
		rep, err := experiment.Run(ctx, e, xenv, c.Out, env.log.With("experiment", e.Name))
		kc.Close()
		verdict := "PASSED"
		if err != nil {
			verdict, failed = "FAILED", failed+1
		}
		dur := ""
		if rep != nil {
			dur = rep.Duration
		}
		fmt.Printf("%-28s %s  %s  (%s)\n", e.Name, verdict, filepath.Join(c.Out, e.Name+".md"), dur)
		if err != nil && !errors.Is(err, experiment.ErrInvariant) {
			fmt.Println("  ", err)
		}
		if rep != nil {
			for _, ch := range rep.Checks {
				if !ch.OK {
					fmt.Printf("   FAIL %s: %s\n", ch.Name, ch.Detail)
				}
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	if failed > 0 {
		fmt.Printf("%d of %d experiments failed\n", failed, len(list))
		return exitCode(1)
	}
	fmt.Printf("all %d experiments passed; reports in %s\n", len(list), c.Out)
	return nil
}
