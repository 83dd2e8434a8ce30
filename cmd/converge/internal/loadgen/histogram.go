package loadgen

import (
	"math"
	"slices"
	"sync"
	"time"
)

// Histogram records durations exactly (every sample is kept) and answers
// quantiles by sorting. A million samples are 8 MB, enough for any run of
// loadgen; there is no bucketing error to reason about. It is safe for
// concurrent use.
type Histogram struct {
	mu      sync.Mutex
	samples []time.Duration
	sorted  bool
}

// Record adds one sample.
func (h *Histogram) Record(d time.Duration) {
	h.mu.Lock()
	h.samples = append(h.samples, d)
	h.sorted = false
	h.mu.Unlock()
}

// Count returns the number of samples.
func (h *Histogram) Count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.samples)
}

// Quantile returns the sample at quantile q in [0, 1] by the nearest-rank
// method (the smallest sample with at least q of the samples at or below
// it), or 0 when there are no samples.
func (h *Histogram) Quantile(q float64) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.quantileLocked(q)
}

func (h *Histogram) quantileLocked(q float64) time.Duration {
	n := len(h.samples)
	if n == 0 {
		return 0
	}
	if !h.sorted {
		slices.Sort(h.samples)
		h.sorted = true
	}
	rank := int(math.Ceil(q * float64(n)))
	rank = min(max(rank, 1), n)
	return h.samples[rank-1]
}

// Summary returns count, mean, p50, p90, p99 and max in milliseconds.
func (h *Histogram) Summary() Summary {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := len(h.samples)
	if n == 0 {
		return Summary{}
	}
	var sum time.Duration
	for _, d := range h.samples {
		sum += d
	}
	return Summary{
		Count: n,
		Mean:  ms(sum / time.Duration(n)),
		P50:   ms(h.quantileLocked(0.50)),
		P90:   ms(h.quantileLocked(0.90)),
		P99:   ms(h.quantileLocked(0.99)),
		Max:   ms(h.quantileLocked(1)),
	}
}

// Summary is a latency distribution in milliseconds.
type Summary struct {
	Count int     `json:"count"`
	Mean  float64 `json:"mean"`
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P99   float64 `json:"p99"`
	Max   float64 `json:"max"`
}

func ms(d time.Duration) float64 {
	return math.Round(float64(d)/float64(time.Microsecond)) / 1000
}
