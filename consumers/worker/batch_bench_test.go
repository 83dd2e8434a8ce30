package worker

import (
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
)

// BenchmarkRunOfIgnoredRecords: runOf passing over a partition batch of
// 256 events the worker ignores (TaskCompleted, which shares the topic),
// as processBatch does at every record that does not start a run. Reports
// ns and allocations per batch scanned.
//
//	go test -run '^$' -bench RunOfIgnoredRecords -benchmem ./consumers/worker
func BenchmarkRunOfIgnoredRecords(b *testing.B) {
	w := &Worker{cfg: Config{MaxBatchRecords: 64}}
	recs := make([]*kgo.Record, 256)
	for i := range recs {
		r := &kgo.Record{Key: []byte(fmt.Sprintf("task-%03d", i))}
		for _, h := range taskevent.Headers(fmt.Sprintf("event-%03d", i), taskevent.TypeTaskCompleted, 2, "ab", "t") {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
		}
		recs[i] = r
	}
	b.ReportAllocs()
	for b.Loop() {
		if run, _ := w.runOf(recs); len(run) != 0 {
			b.Fatalf("%d jobs", len(run))
		}
	}
}
