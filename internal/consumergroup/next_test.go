package consumergroup

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// next joins a partition's queued polls, in order, while they fit in
// MaxPollRecords, and always takes at least the oldest poll whole.
func TestNextJoinsQueuedPollsUpToMaxPollRecords(t *testing.T) {
	recs := make([]*kgo.Record, 12)
	for i := range recs {
		recs[i] = &kgo.Record{Offset: int64(i)}
	}
	c := &Consumer{cfg: Config{MaxPollRecords: 5}}
	p := &partition{batches: [][]*kgo.Record{recs[0:2], recs[2:3], recs[3:6], recs[6:7], recs[7:8], recs[8:12]}, queued: 12}
	// 2+1 fit, +3 would not; 3+1+1 fit; 4 alone; then nothing.
	for _, want := range [][2]int64{{0, 2}, {3, 7}, {8, 11}} {
		got := c.next(p)
		if len(got) != int(want[1]-want[0]+1) || got[0].Offset != want[0] || got[len(got)-1].Offset != want[1] {
			t.Fatalf("next = %d records from %d, want offsets %d..%d", len(got), got[0].Offset, want[0], want[1])
		}
		for i := 1; i < len(got); i++ {
			if got[i].Offset != got[i-1].Offset+1 {
				t.Fatalf("next = records out of order: %d after %d", got[i].Offset, got[i-1].Offset)
			}
		}
	}
	if got := c.next(p); got != nil || p.queued != 0 {
		t.Fatalf("next of an empty queue = %d records, queued %d", len(got), p.queued)
	}
	// A poll larger than MaxPollRecords is one batch, not split.
	p = &partition{batches: [][]*kgo.Record{recs[0:9], recs[9:10]}, queued: 10}
	if got := c.next(p); len(got) != 9 {
		t.Fatalf("next = %d records, want the first poll's 9", len(got))
	}
}
