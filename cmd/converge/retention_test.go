package main

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// converge dev takes the reconciler's retention windows from the same
// variables as converge reconciler, and refuses the same bad values before
// it starts anything.
func TestDevTakesTheRetentionWindows(t *testing.T) {
	t.Setenv("CONVERGE_OUTBOX_RETENTION", "2h")
	t.Setenv("CONVERGE_TASK_RETENTION", "48h")
	for _, args := range [][]string{{"dev"}, {"reconciler"}} {
		cli := parseCLI(t, args...)
		r := cli.Dev.Retention
		if args[0] == "reconciler" {
			r = cli.Reconciler.Retention
		}
		if r.OutboxRetention != 2*time.Hour || r.TaskRetention != 48*time.Hour {
			t.Fatalf("%v: retention %+v, want the environment's 2h and 48h", args, r)
		}
	}

	env := &runEnv{ctx: context.Background(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	c := DevCmd{Retention: Retention{OutboxRetention: 30 * time.Minute, TaskRetention: 720 * time.Hour}, DataDir: t.TempDir()}
	if err := c.Run(env); err == nil || !strings.Contains(err.Error(), "CONVERGE_OUTBOX_RETENTION") {
		t.Fatalf("dev with a 30m outbox retention: %v, want it refused", err)
	}
}
