// Package kafkatopic creates converge's topics when they are missing.
package kafkatopic

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Ensure creates each topic with partitions partitions and the broker's
// default replication factor when it does not exist yet. Existing topics are
// left as they are (their partition count is not changed).
func Ensure(ctx context.Context, cl *kgo.Client, partitions int32, topics ...string) error {
	adm := kadm.NewClient(cl)
	resp, err := adm.CreateTopics(ctx, partitions, -1, nil, topics...)
	if err != nil {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	for _, r := range resp.Sorted() {
		if r.Err != nil && !errors.Is(r.Err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", r.Topic, r.Err)
		}
	}
	return nil
}

// RefusedRecord reports whether err is the refusal of one record itself
// by the producer or the broker (too large, invalid), which no retry
// changes, and its Kafka error name. The relay parks such a row; the
// worker dead-letters such a record without its value.
func RefusedRecord(err error) (code string, ok bool) {
	for _, ke := range []*kerr.Error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidRecord,
		kerr.CorruptMessage, kerr.InvalidTimestamp, kerr.UnsupportedForMessageFormat} {
		if errors.Is(err, ke) {
			return ke.Message, true
		}
	}
	return "", false
}

// ReadToEnd calls fn for every record of topic from the start of each
// partition up to that partition's end offset (high watermark) when it is
// called, in offset order per partition. brokers are the seed brokers; it
// reads with a client of its own. It returns ctx's error when the end is not
// reached before ctx ends, and the first fetch error. A partition whose last
// offset below its end holds no record (a transaction marker, nothing a
// converge producer writes) is not reached either.
func ReadToEnd(ctx context.Context, brokers []string, topic string, fn func(*kgo.Record)) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return err
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return fmt.Errorf("end offsets of %s: %w", topic, err)
	}
	want := map[int32]int64{}
	var listErr error
	ends.Each(func(o kadm.ListedOffset) {
		if o.Err != nil && listErr == nil {
			listErr = o.Err
		}
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
		}
	})
	if listErr != nil {
		return fmt.Errorf("end offsets of %s: %w", topic, listErr)
	}
	for remaining := len(want); remaining > 0; {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return fmt.Errorf("read %s to its end offsets: %w", topic, ctx.Err())
		}
		if errs := fs.Errors(); len(errs) > 0 {
			return fmt.Errorf("read %s: partition %d: %w", topic, errs[0].Partition, errs[0].Err)
		}
		fs.EachRecord(func(r *kgo.Record) {
			end, ok := want[r.Partition]
			if !ok || r.Offset >= end {
				return
			}
			fn(r)
			if r.Offset == end-1 {
				remaining--
			}
		})
	}
	return nil
}
