package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

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
	Republish OutboxRepublishCmd `cmd:"" help:"Produce a parked row again with its original message id and headers; on the broker's acknowledgement mark it published (who and why are kept)."`
	Discard   OutboxDiscardCmd   `cmd:"" help:"Decide that a parked row is never published (who and why are kept)."`
}

// OutboxListCmd is `converge outbox list [--all] [--limit N]`.
type OutboxListCmd struct {
	OperatorDB
	All   bool `help:"Also the rows already republished or discarded."`
	Limit int  `default:"100" help:"At most this many."`
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
	rows, err := outbox.ListParked(env.ctx, pool, !c.All, c.Limit)
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

// OutboxRepublishCmd is `converge outbox republish ID --reason TEXT [--by WHO]`.
type OutboxRepublishCmd struct {
	OperatorDB
	KafkaBrokers []string `name:"kafka-brokers" env:"CONVERGE_KAFKA_BROKERS" sep:"," help:"Kafka bootstrap brokers, comma-separated."`
	Topic        string   `env:"CONVERGE_TOPIC" default:"converge.task-events.v1" help:"Task-events topic."`
	ID           string   `arg:"" help:"Outbox id of a parked row."`
	Reason       string   `required:"" help:"Why (recorded)."`
	By           string   `help:"Who asks (recorded). Defaults to the OS user."`
}

// Run republishes the row and prints one line (id, outcome); it exits 1
// when the broker refused it again (the attempt is recorded on the row).
func (c *OutboxRepublishCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := need("CONVERGE_KAFKA_BROKERS", firstOr(c.KafkaBrokers)); err != nil {
		return err
	}
	// The producer limits of the relay and the workers (franz-go's
	// defaults, 1 MiB): a record larger than they send is refused here too,
	// so a republished record never reaches consumers that could not
	// dead-letter it.
	producer, err := kgo.NewClient(kgo.SeedBrokers(c.KafkaBrokers...), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordDeliveryTimeout(30*time.Second))
	if err != nil {
		return err
	}
	defer producer.Close()
	if err := cdc.Republish(env.ctx, producer, pool, c.Topic, c.ID, osUserOr(c.By), c.Reason); err != nil {
		if errors.Is(err, kerr.MessageTooLarge) {
			return fmt.Errorf("%w (a record over converge's 1 MiB producer limit cannot be republished; discard it: converge outbox discard %s --reason ...)", err, c.ID)
		}
		return err
	}
	fmt.Printf("%s\t%s\n", c.ID, outbox.DecisionRepublished)
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
