package main

import (
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/converge-run/converge/internal/inbox"
)

// InboxCmd inspects the consumers' inboxes.
type InboxCmd struct {
	Conflicts InboxConflictsCmd `cmd:"" help:"List inbox conflicts (a message id that arrived with another payload hash: never processed; seed 13.4), newest first."`
}

// InboxConflictsCmd is `converge inbox conflicts [--limit N]`.
type InboxConflictsCmd struct {
	OperatorDB
	Limit int `default:"100" help:"At most this many."`
}

// Run prints one line per conflict.
func (c *InboxConflictsCmd) Run(env *runEnv) error {
	if c.Limit < 1 {
		return errors.New("--limit must be at least 1")
	}
	pool, err := c.open(env.ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	cs, err := inbox.ListConflicts(env.ctx, pool, c.Limit)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEEN AT\tCONSUMER\tMESSAGE ID\tPAYLOAD SHA256\tREGISTERED SHA256\tORIGIN")
	for _, x := range cs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s/%d/%d\n", x.SeenAt.UTC().Format(time.RFC3339), x.Consumer, x.MessageID,
			x.PayloadSHA256, x.StoredSHA256, x.Topic, x.Partition, x.Offset)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(cs) == 0 {
		fmt.Println("no inbox conflicts")
	}
	return nil
}
