package reconciler

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/deadletter"
)

// runIntake consumes the dead-letter topic (consumer group
// DeadLetterGroup) into the dead_letter table: each record is inserted
// with ON CONFLICT DO NOTHING on its origin (topic, partition, offset), and
// the offsets of a poll are committed only after every insert of the poll
// succeeded; a failed insert is retried with backoff, so nothing is
// skipped.
func (r *Reconciler) runIntake(ctx context.Context) error {
	opts := append([]kgo.Opt{
		kgo.SeedBrokers(r.cfg.Brokers...),
		kgo.ConsumerGroup(r.cfg.DeadLetterGroup),
		kgo.ConsumeTopics(r.cfg.DeadLetterTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
	}, r.cfg.KafkaOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("reconciler: dead-letter intake client: %w", err)
	}
	defer cl.Close()
	store := deadletter.NewStore(r.pool)
	r.log.InfoContext(ctx, "dead-letter intake started", slog.String("topic", r.cfg.DeadLetterTopic), slog.String("group", r.cfg.DeadLetterGroup))
	for {
		fetches := cl.PollRecords(ctx, 500)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			cl.AllowRebalance() // Close leaves the group: it needs rebalances allowed
			break
		}
		fetches.EachError(func(topic string, p int32, err error) {
			r.log.WarnContext(ctx, "dead-letter fetch error", slog.String("topic", topic), slog.Int("partition", int(p)), slog.Any("err", err))
		})
		ok := true
		fetches.EachRecord(func(rec *kgo.Record) {
			if ok && !r.recordDeadLetter(ctx, store, rec) {
				ok = false
			}
		})
		if !ok { // ctx ended mid-poll: nothing of this poll is committed
			cl.AllowRebalance()
			break
		}
		// Every record of the poll is recorded: commit them (rebalances are
		// blocked until AllowRebalance, so the poll's partitions are ours).
		if err := cl.CommitUncommittedOffsets(context.WithoutCancel(ctx)); err != nil {
			r.log.WarnContext(ctx, "dead-letter intake commit (records will be recorded again, once)", slog.Any("err", err))
		}
		cl.AllowRebalance()
	}
	r.log.Info("dead-letter intake stopped")
	return nil
}

// recordDeadLetter inserts one dead letter, retrying with backoff until it
// succeeds; false when ctx ended first.
func (r *Reconciler) recordDeadLetter(ctx context.Context, store *deadletter.Store, rec *kgo.Record) bool {
	d := deadletter.FromRecord(rec)
	wait := 100 * time.Millisecond
	for {
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
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
		wait = min(2*wait, 5*time.Second)
	}
}
