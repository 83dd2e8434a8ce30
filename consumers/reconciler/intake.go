package reconciler

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/backoff"
	"github.com/converge-run/converge/internal/clientid"
	"github.com/converge-run/converge/internal/consumergroup"
)

// runIntake consumes the dead-letter topic (consumer group
// DeadLetterGroup) into the dead_letter table: each record is inserted
// with ON CONFLICT DO NOTHING on its origin (topic, partition, offset), and
// a record's offset is committed only after its insert succeeded (the
// consumer-group rules are internal/consumergroup's); a failed insert is
// retried with backoff, so nothing is skipped.
func (r *Reconciler) runIntake(ctx context.Context) error {
	store := deadletter.NewStore(r.pool)
	c, err := consumergroup.New(consumergroup.Config{
		Brokers: r.cfg.Brokers, Group: r.cfg.DeadLetterGroup, Topics: []string{r.cfg.DeadLetterTopic},
		ClientID: clientid.Process("converge-reconciler"), // one id per process: see internal/devbroker
		Logger:   r.log, KafkaOpts: r.cfg.KafkaOpts,
	}, consumergroup.HandlerFunc(func(ctx context.Context, b consumergroup.Batch) int {
		for i, rec := range b.Records {
			if !r.recordDeadLetter(ctx, store, rec) {
				return i // ctx ended: this record and the rest stay uncommitted
			}
		}
		return len(b.Records)
	}))
	if err != nil {
		return fmt.Errorf("reconciler: dead-letter intake: %w", err)
	}
	r.log.InfoContext(ctx, "dead-letter intake started", slog.String("topic", r.cfg.DeadLetterTopic), slog.String("group", r.cfg.DeadLetterGroup))
	err = c.Run(ctx)
	r.log.Info("dead-letter intake stopped")
	return err
}

// Backoff of a failed dead-letter insert.
const (
	intakeBackoffMin = 100 * time.Millisecond
	intakeBackoffMax = 5 * time.Second
)

// recordDeadLetter inserts one dead letter, retrying with backoff until it
// succeeds; false when ctx ended first.
func (r *Reconciler) recordDeadLetter(ctx context.Context, store *deadletter.Store, rec *kgo.Record) bool {
	d := deadletter.FromRecord(rec)
	for n := 0; ; n++ {
		ictx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		inserted, err := store.Insert(ictx, d)
		cancel()
		if err == nil {
			if inserted {
				r.m.actions.WithLabelValues(ActionDeadLetterRecorded).Inc()
				r.log.WarnContext(ctx, "dead letter recorded", slog.String("origin_topic", d.OriginTopic),
					slog.Int("origin_partition", int(d.OriginPartition)), slog.Int64("origin_offset", d.OriginOffset),
					slog.String("error_code", d.ErrorCode))
			}
			return true
		}
		r.log.WarnContext(ctx, "record dead letter; retrying", slog.Any("err", err))
		if !backoff.Sleep(ctx, intakeBackoffMin, intakeBackoffMax, n) {
			return false
		}
	}
}
