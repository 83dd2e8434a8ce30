package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/internal/outbox"
)

// OutboxCmd inspects and decides on parked outbox rows (issue 13, seed
// 4.1): rows the relay could not publish for a reason retrying cannot fix.
type OutboxCmd struct {
	List      OutboxListCmd      `cmd:"" help:"List parked outbox rows, oldest park first."`
	Show      OutboxShowCmd      `cmd:"" help:"Show one outbox row (any state) as JSON."`
	Republish OutboxRepublishCmd `cmd:"" help:"Produce a parked row again with its original message id and headers; on the broker's acknowledgement mark it published (who and why are kept). With --unpublished: the rows the slot did not deliver, as the reconciler does."`
	Discard   OutboxDiscardCmd   `cmd:"" help:"Decide that a parked row is never published (who and why are kept)."`
}

// OutboxListCmd is `converge outbox list [--all] [--code CODE] [--limit N]`.
type OutboxListCmd struct {
	OperatorDB
	All   bool   `help:"Also the rows already republished or discarded."`
	Code  string `help:"Only rows whose last error code is this (e.g. MESSAGE_TOO_LARGE)."`
	Limit int    `default:"100" help:"At most this many."`
}

// Run prints one line per parked row.
func (c *OutboxListCmd) Run(env *runEnv) error {
	if c.Limit < 1 {
		return errors.New("--limit must be at least 1")
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := outbox.ListParked(env.ctx, pool, outbox.ParkedFilter{All: c.All, Code: c.Code, Limit: c.Limit})
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "OUTBOX ID\tTYPE\tTASK\tVERSION\tATTEMPTS\tCODE\tPARKED AT\tDECISION")
	for _, r := range rows {
		decision := "-"
		if r.Decision != "" {
			decision = r.Decision + " by " + r.DecidedBy
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", r.ID, r.Type, r.TaskID, r.Version, r.Attempts, r.LastErrorCode,
			r.ParkedAt.UTC().Format(time.RFC3339), decision)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rows) == 0 {
		fmt.Println("no parked outbox rows")
	}
	return nil
}

// OutboxShowCmd is `converge outbox show ID`.
type OutboxShowCmd struct {
	OperatorDB
	ID string `arg:"" help:"Outbox id (the event id)."`
}

// Run prints the row as indented JSON (the payload as its size in bytes).
func (c *OutboxShowCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := outbox.Get(env.ctx, pool, c.ID)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(s)
}

// OutboxRepublishCmd is `converge outbox republish ID --reason TEXT [--by
// WHO]` (a parked row) or `converge outbox republish --unpublished
// [--older-than D] [--limit N]` (the rows the slot did not deliver).
type OutboxRepublishCmd struct {
	OperatorDB
	KafkaBrokers []string      `name:"kafka-brokers" env:"CONVERGE_KAFKA_BROKERS" sep:"," help:"Kafka bootstrap brokers, comma-separated."`
	Topic        string        `env:"CONVERGE_TOPIC" default:"converge.task-events.v1" help:"Task-events topic."`
	ID           string        `arg:"" optional:"" help:"Outbox id of a parked row (or --unpublished)."`
	Reason       string        `help:"With an ID: why (recorded; required)."`
	By           string        `help:"With an ID: who asks (recorded). Defaults to the OS user."`
	Unpublished  bool          `help:"Instead of an ID: republish the rows neither published nor parked created more than --older-than ago, oldest first, and mark them published (the reconciler's republication, on demand; no decision is recorded)."`
	OlderThan    time.Duration `name:"older-than" default:"5m" help:"With --unpublished: only rows created more than this long ago (the reconciler's default; a younger row is likely still on its way through the relay)."`
	Limit        int           `default:"100" help:"With --unpublished: at most this many rows."`
}

// Run republishes and prints one line per row (id, outcome; for a failed
// row also the error). It exits 1 when a record was refused (the attempt
// is recorded on its row).
func (c *OutboxRepublishCmd) Run(env *runEnv) error {
	switch {
	case (c.ID == "") == !c.Unpublished:
		return errors.New("give an outbox ID of a parked row, or --unpublished")
	case c.Unpublished && (c.Reason != "" || c.By != ""):
		return errors.New("--reason and --by record a decision on a parked row; --unpublished rows need none and record none")
	case c.Unpublished && (c.OlderThan <= 0 || c.Limit < 1):
		return errors.New("--older-than must be positive and --limit at least 1")
	case !c.Unpublished && strings.TrimSpace(c.Reason) == "":
		return fmt.Errorf("--reason is required with an ID: %w", outbox.ErrReasonRequired)
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := need("CONVERGE_KAFKA_BROKERS", firstOr(c.KafkaBrokers)); err != nil {
		return err
	}
	producer, err := cdc.NewRepublishProducer(c.KafkaBrokers)
	if err != nil {
		return err
	}
	defer producer.Close()
	if c.Unpublished {
		return c.republishUnpublished(env, producer, pool)
	}
	if err := cdc.Republish(env.ctx, producer, pool, c.Topic, c.ID, osUserOr(c.By), c.Reason); err != nil {
		if errors.Is(err, kerr.MessageTooLarge) {
			return fmt.Errorf("%w (a record over converge's 1 MiB producer limit cannot be republished; discard it: converge outbox discard %s --reason ...)", err, c.ID)
		}
		return err
	}
	fmt.Printf("%s\t%s\n", c.ID, outbox.DecisionRepublished)
	return nil
}

// republishUnpublished runs cdc.RepublishUnpublished (the reconciler's
// routine) once, from a new outbox.Backlog: it reads every retained outbox
// row's created_xid once, through outbox_event_created_xid_idx.
func (c *OutboxRepublishCmd) republishUnpublished(env *runEnv, producer *kgo.Client, pool *pgxpool.Pool) error {
	var backlog outbox.Backlog
	rep, err := cdc.RepublishUnpublished(env.ctx, producer, pool, &backlog, c.Topic, c.OlderThan, c.Limit)
	for _, id := range rep.Republished {
		fmt.Printf("%s\t%s\n", id, "republished")
	}
	for _, f := range rep.Failed {
		state := "failed"
		if f.Parked {
			state = "parked" // refused for good: `converge outbox show|discard`
		}
		fmt.Printf("%s\t%s\t%v\n", f.ID, state, f.Err)
	}
	if err != nil {
		return err
	}
	if len(rep.Republished)+len(rep.Failed) == 0 {
		fmt.Printf("no outbox rows unpublished (and not parked) for more than %s\n", c.OlderThan)
	}
	if len(rep.Failed) > 0 {
		return exitCode(1)
	}
	return nil
}

// OutboxDiscardCmd is `converge outbox discard ID --reason TEXT [--by WHO]`.
type OutboxDiscardCmd struct {
	OperatorDB
	ID     string `arg:"" help:"Outbox id of a parked row."`
	Reason string `required:"" help:"Why it is never published (recorded)."`
	By     string `help:"Who decides (recorded). Defaults to the OS user."`
}

// Run records the decision and prints one line (id, outcome). Nothing is
// published; the task the event was about is left as it is.
func (c *OutboxDiscardCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := outbox.Decide(env.ctx, pool, c.ID, outbox.DecisionDiscarded, osUserOr(c.By), c.Reason); err != nil {
		return err
	}
	fmt.Printf("%s\t%s\n", c.ID, outbox.DecisionDiscarded)
	return nil
}
