package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

// `converge dlq resolve` marks a dead letter resolved without Kafka and
// records who and why; a missing id or reason is refused before anything
// changes.
func TestDLQResolveCommand(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	id := parkDeadLetter(t, db)
	env := &runEnv{ctx: context.Background(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := (&DLQResolveCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: 0, Reason: "x"}).Run(env); err == nil {
		t.Error("resolve without an id succeeded")
	}
	if err := (&DLQResolveCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: id, Reason: "  "}).Run(env); err == nil {
		t.Error("resolve with a blank reason succeeded")
	}
	if err := (&DLQResolveCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: id + 1000, Reason: "x"}).Run(env); err == nil {
		t.Error("resolve of an unknown id succeeded")
	}
	if err := (&DLQResolveCmd{OperatorDB: OperatorDB{DatabaseURL: db.URL}, ID: id, Reason: "obsolete record", By: "ops"}).Run(env); err != nil {
		t.Fatal(err)
	}
	var state, by, reason string
	if err := db.Pool.QueryRow(context.Background(), `SELECT state, last_replay_by, last_replay_reason FROM dead_letter WHERE dead_letter_id = $1`, id).
		Scan(&state, &by, &reason); err != nil {
		t.Fatal(err)
	}
	if state != "resolved" || by != "ops" || reason != "obsolete record" {
		t.Errorf("dead letter %s by %q reason %q, want resolved by ops", state, by, reason)
	}
}
