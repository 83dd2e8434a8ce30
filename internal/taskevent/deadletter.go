package taskevent

import (
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// The dead-letter record contract (DESIGN.md "Kafka contract"): a record
// parked on DeadLetterTopic(topic) is the original record — key, value and
// headers unchanged — plus the dlq-* headers below. The worker writes it
// (DeadLetterRecord); the reconciler's intake and the dead-letter service
// read it (package deadletter). Any dlq-* header already on the record is
// removed first, so re-dead-lettering replaces these headers instead of
// appending them.
const (
	HeaderDLQPrefix           = "dlq-"
	HeaderDLQOriginalTopic    = "dlq-original-topic"
	HeaderDLQOriginalPart     = "dlq-original-partition"
	HeaderDLQOriginalOffset   = "dlq-original-offset"
	HeaderDLQConsumerGroup    = "dlq-consumer-group"
	HeaderDLQErrorClass       = "dlq-error-class"
	HeaderDLQErrorCode        = "dlq-error-code"
	HeaderDLQErrorMessage     = "dlq-error-message"
	HeaderDLQAttempts         = "dlq-attempts"
	HeaderDLQProcessorVersion = "dlq-processor-version"
	HeaderDLQFirstFailureAt   = "dlq-first-failure-at"
	HeaderDLQLastFailureAt    = "dlq-last-failure-at"
	// HeaderDLQValueOmitted is set (to "<code>: <n> bytes") on a dead
	// letter whose original value the dead-letter topic refused (too
	// large): it carries the key and headers, an empty value, and this
	// header; the original stays at its origin offset until the topic's
	// retention removes it.
	HeaderDLQValueOmitted = "dlq-value-omitted"
)

// Error classes (header dlq-error-class, dead_letter.error_class).
const (
	// ClassDeterministic: the error recurs on every attempt; dead-lettered
	// at the first failure.
	ClassDeterministic = "deterministic"
	// ClassRetryable: a retryable error persisted through the consumer's
	// attempts.
	ClassRetryable = "retryable"
)

// CodeUnclassified is the error code of a deterministic error without a code
// of its own (and of a dead letter whose dlq-error-code header is missing).
const CodeUnclassified = "UNCLASSIFIED"

// DefaultWorkerGroup is the worker's consumer group (and inbox
// consumer_name) unless configured otherwise; a dead letter without a
// dlq-consumer-group header is taken to come from it.
const DefaultWorkerGroup = "converge-worker"

// MaxDLQErrorMessage bounds the dlq-error-message header (bytes).
const MaxDLQErrorMessage = 1024

// DeadLetter describes why a record is parked.
type DeadLetter struct {
	Topic            string // the dead-letter topic
	Group            string // the consumer group that gave up on it
	Class            string // ClassDeterministic or ClassRetryable
	Code             string // stable error code
	Message          string // error text, clipped to MaxDLQErrorMessage bytes
	Attempts         int
	ProcessorVersion string
	First, Last      time.Time // first and last failure
}

// DeadLetterRecord returns the record to produce to the dead-letter topic for
// r: same key, value and headers (minus any "dlq-" header), plus the dlq-*
// headers describing d. A dlq-first-failure-at already on r that is earlier
// than d.First is kept as the first failure.
func DeadLetterRecord(r *kgo.Record, d DeadLetter) *kgo.Record {
	out := &kgo.Record{Topic: d.Topic, Key: r.Key, Value: r.Value}
	first := d.First
	for _, h := range r.Headers {
		if strings.HasPrefix(h.Key, HeaderDLQPrefix) {
			if h.Key == HeaderDLQFirstFailureAt {
				if t, err := time.Parse(time.RFC3339Nano, string(h.Value)); err == nil && t.Before(first) {
					first = t
				}
			}
			continue
		}
		out.Headers = append(out.Headers, h)
	}
	message := d.Message
	if len(message) > MaxDLQErrorMessage {
		message = message[:MaxDLQErrorMessage]
	}
	for _, kv := range [][2]string{
		{HeaderDLQOriginalTopic, r.Topic},
		{HeaderDLQOriginalPart, strconv.Itoa(int(r.Partition))},
		{HeaderDLQOriginalOffset, strconv.FormatInt(r.Offset, 10)},
		{HeaderDLQConsumerGroup, d.Group},
		{HeaderDLQErrorClass, d.Class},
		{HeaderDLQErrorCode, d.Code},
		{HeaderDLQErrorMessage, message},
		{HeaderDLQAttempts, strconv.Itoa(d.Attempts)},
		{HeaderDLQProcessorVersion, d.ProcessorVersion},
		{HeaderDLQFirstFailureAt, first.UTC().Format(time.RFC3339Nano)},
		{HeaderDLQLastFailureAt, d.Last.UTC().Format(time.RFC3339Nano)},
	} {
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: kv[0], Value: []byte(kv[1])})
	}
	return out
}
