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
