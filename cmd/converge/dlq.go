package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/user"
	"text/tabwriter"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/deadletter"
)

// DLQCmd inspects and replays dead letters (package deadletter).
type DLQCmd struct {
	List    DLQListCmd    `cmd:"" help:"List dead letters, oldest first."`
	Show    DLQShowCmd    `cmd:"" help:"Show one dead letter as JSON."`
	Replay  DLQReplayCmd  `cmd:"" help:"Re-publish the original record of dead letters after a fix (the row keeps who, when, why of the last request)."`
	Resolve DLQResolveCmd `cmd:"" help:"Mark a dead letter resolved without publishing anything (the row keeps who, when, why)."`
}

// DLQListCmd is `converge dlq list`.
type DLQListCmd struct {
	OperatorDB
	Code  string `help:"Only dead letters with this error code."`
	State string `help:"Only dead letters in this state (parked, replayed, resolved, refused)."`
	Limit int    `default:"100" help:"At most this many."`
}

// Run prints one line per dead letter.
func (c *DLQListCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	f := deadletter.Filter{Code: c.Code, Limit: c.Limit}
	if c.State != "" {
		f.States = []string{c.State}
	}
	list, err := deadletter.NewStore(pool).List(env.ctx, f)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tREPLAYS\tCODE\tCLASS\tATTEMPTS\tTASK\tORIGIN\tLAST FAILURE")
	for _, d := range list {
		task := "-"
		if d.TaskID != nil {
			task = *d.TaskID
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\t%d\t%s\t%s/%d/%d\t%s\n", d.ID, d.State, d.ReplayCount, d.ErrorCode, d.ErrorClass,
			d.Attempts, task, d.OriginTopic, d.OriginPartition, d.OriginOffset, d.LastFailureAt.Format("2006-01-02T15:04:05Z07:00"))
	}
	return tw.Flush()
}

// DLQShowCmd is `converge dlq show ID`.
type DLQShowCmd struct {
	OperatorDB
	ID int64 `arg:"" help:"Dead letter id."`
}

// Run prints the dead letter as indented JSON (key, value and header
// values base64-encoded).
func (c *DLQShowCmd) Run(env *runEnv) error {
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	d, err := deadletter.NewStore(pool).Get(env.ctx, c.ID)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(d)
}

// DLQReplayCmd is `converge dlq replay ID|--all [--code CODE] --reason TEXT [--by WHO]`.
type DLQReplayCmd struct {
	OperatorDB
	KafkaBrokers []string `name:"kafka-brokers" env:"CONVERGE_KAFKA_BROKERS" sep:"," help:"Kafka bootstrap brokers, comma-separated."`
	ID           int64    `arg:"" optional:"" help:"Dead letter id (or --all)."`
	All          bool     `help:"Replay every parked dead letter (of --code when given)."`
	Code         string   `help:"With --all: only dead letters with this error code."`
	Reason       string   `required:"" help:"Why (recorded with the replay)."`
	By           string   `help:"Who asks (recorded). Defaults to the OS user."`
	MaxReplays   int      `env:"CONVERGE_DLQ_MAX_REPLAYS" default:"3" help:"Replays allowed per task, summed over all its dead letters; the next request marks the dead letter refused."`
}

// Run replays and prints one line per dead letter (id, outcome, message);
// it exits 1 when a replay was refused or failed. The outcomes are printed
// and logged, not exported: this short-lived process serves no metrics, so
// converge_deadletter_replays_total counts only the API's replays.
func (c *DLQReplayCmd) Run(env *runEnv) error {
	if (c.ID == 0) == !c.All {
		return errors.New("give a dead letter ID or --all")
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := need("CONVERGE_KAFKA_BROKERS", firstOr(c.KafkaBrokers)); err != nil {
		return err
	}
	producer, err := kgo.NewClient(kgo.SeedBrokers(c.KafkaBrokers...))
	if err != nil {
		return err
	}
	defer producer.Close()
	svc, err := deadletter.New(deadletter.Config{Pool: pool, Producer: producer, MaxReplays: c.MaxReplays, Logger: env.log})
	if err != nil {
		return err
	}
	req := deadletter.Request{Reason: c.Reason, By: osUserOr(c.By)}
	var results []deadletter.Result
	if c.All {
		results, err = svc.ReplayAll(env.ctx, c.Code, 0, req)
	} else {
		var r deadletter.Result
		r, err = svc.Replay(env.ctx, c.ID, req)
		results = append(results, r)
	}
	bad := err != nil
	for _, r := range results {
		if r.Outcome == "" {
			continue
		}
		fmt.Printf("%d\t%s\t%s\n", r.ID, r.Outcome, r.Message)
		bad = bad || r.Outcome == deadletter.OutcomeRefused || r.Outcome == deadletter.OutcomeError
	}
	if err != nil {
		return err
	}
	if c.All && len(results) == 0 {
		fmt.Println("no parked dead letters")
	}
	if bad {
		return exitCode(1)
	}
	return nil
}

// DLQResolveCmd is `converge dlq resolve ID --reason TEXT [--by WHO]`.
type DLQResolveCmd struct {
	OperatorDB
	ID     int64  `arg:"" help:"Dead letter id."`
	Reason string `required:"" help:"Why no replay is needed (recorded)."`
	By     string `help:"Who decides (recorded). Defaults to the OS user."`
}

// Run resolves the dead letter and prints one line (id, outcome, message).
// It needs no Kafka brokers: nothing is published.
func (c *DLQResolveCmd) Run(env *runEnv) error {
	if c.ID < 1 {
		return errors.New("give a dead letter ID (a positive integer)")
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	svc, err := deadletter.New(deadletter.Config{Pool: pool, Logger: env.log})
	if err != nil {
		return err
	}
	r, err := svc.Resolve(env.ctx, c.ID, deadletter.Request{Reason: c.Reason, By: osUserOr(c.By)})
	if err != nil {
		return err
	}
	fmt.Printf("%d\t%s\t%s\n", r.ID, r.Outcome, r.Message)
	return nil
}

// osUserOr returns by, or the OS user's name when by is empty.
func osUserOr(by string) string {
	if by == "" {
		if u, err := user.Current(); err == nil {
			return u.Username
		}
	}
	return by
}

func firstOr(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}
