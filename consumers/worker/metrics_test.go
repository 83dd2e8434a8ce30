package worker

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every outcome of converge_worker_messages_total is exported at 0 from
// the start: the ConvergeDeadLettersIncreasing alert takes increase() of
// outcome="dead_lettered", which would miss the first dead letter if the
// series appeared only with it (at 1).
func TestMessageOutcomesExportedFromStart(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	if _, err := newMetrics(reg); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "converge_worker_messages_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	for _, o := range []string{OutcomeProcessed, OutcomeDuplicate, OutcomeConflict, OutcomeIgnored, OutcomeFailed, OutcomeRetried, OutcomeDeadLettered, OutcomeCancelled, OutcomeLeaseHeld} {
		if v, ok := got[o]; !ok || v != 0 {
			t.Errorf("converge_worker_messages_total{outcome=%q} = %v (exported %v), want 0 from the start", o, v, ok)
		}
	}
}
