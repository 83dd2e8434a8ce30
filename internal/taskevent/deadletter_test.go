package taskevent

import (
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Re-dead-lettering replaces the dlq-* headers and keeps the earliest first
// failure.
func TestDeadLetterRecordReplacesHeaders(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	r := &kgo.Record{Topic: "t", Partition: 2, Offset: 7, Key: []byte("k"), Value: []byte("v"),
		Headers: []kgo.RecordHeader{{Key: "event-id", Value: []byte("e1")}}}
	once := DeadLetterRecord(r, DeadLetter{Topic: "t.dlq", Group: "g", Class: ClassDeterministic, Code: "C1", Message: "boom", Attempts: 1, ProcessorVersion: "p1", First: t0, Last: t0})
	once.Topic, once.Partition, once.Offset = "t", 3, 9 // consumed again from t
	twice := DeadLetterRecord(once, DeadLetter{Topic: "t.dlq", Group: "g", Class: ClassRetryable, Code: "C2", Message: strings.Repeat("x", 5000), Attempts: 4, ProcessorVersion: "p2", First: t0.Add(time.Hour), Last: t0.Add(2 * time.Hour)})
	if len(twice.Headers) != len(once.Headers) {
		t.Fatalf("headers grew from %d to %d", len(once.Headers), len(twice.Headers))
	}
	for k, v := range map[string]string{"event-id": "e1", HeaderDLQErrorCode: "C2", HeaderDLQOriginalPart: "3", HeaderDLQOriginalOffset: "9",
		HeaderDLQAttempts: "4", HeaderDLQFirstFailureAt: t0.Format(time.RFC3339Nano)} {
		if got, n := dlqHeader(twice, k); got != v || n != 1 {
			t.Errorf("%s = %q (%d), want %q", k, got, n, v)
		}
	}
	if m, _ := dlqHeader(twice, HeaderDLQErrorMessage); len(m) != MaxDLQErrorMessage {
		t.Errorf("message of %d bytes, want %d", len(m), MaxDLQErrorMessage)
	}
}

func dlqHeader(r *kgo.Record, key string) (string, int) {
	var v string
	n := 0
	for _, h := range r.Headers {
		if h.Key == key {
			v, n = string(h.Value), n+1
		}
	}
	return v, n
}
