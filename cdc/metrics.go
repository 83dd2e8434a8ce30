package cdc

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the converge_relay_* collectors (listed in doc.go).
type metrics struct {
	published        *prometheus.CounterVec
	produceErrors    prometheus.Counter
	hashMismatches   prometheus.Counter
	commitToAck      prometheus.Histogram
	confirmedLSN     prometheus.Gauge
	slotLag          prometheus.Gauge
	txnsInFlight     prometheus.Gauge
	recordsInFlight  prometheus.Gauge
	publishedMarked  prometheus.Counter
	statusUpdatesOut prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_relay_events_published_total",
			Help: "Outbox events acknowledged by Kafka (acks=all), by event type. Republications after a restart count again.",
		}, []string{"event_type"}),
		produceErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_produce_errors_total",
			Help: "Records whose produce failed for good (non-retryable error or delivery timeout); each stops the relay.",
		}),
		hashMismatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_payload_hash_mismatches_total",
			Help: "Outbox rows whose payload_sha256 column differs from the SHA-256 of the canonical payload (relayed anyway, with the column value as header).",
		}),
		commitToAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "converge_relay_commit_to_ack_seconds",
			Help:    "Time from a transaction's commit (pgoutput Begin commit time) until Kafka acknowledged its last outbox record.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}),
		confirmedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_confirmed_lsn",
			Help: "LSN (as a number) last reported to PostgreSQL as written/flushed/applied: the replication slot's confirmed position.",
		}),
		slotLag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_slot_lag_bytes",
			Help: "Bytes of WAL between the server's WAL end (last seen on the stream) and the confirmed LSN.",
		}),
		txnsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_transactions_in_flight",
			Help: "Decoded transactions the slot has not been advanced past yet.",
		}),
		recordsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_records_in_flight",
			Help: "Records produced and not yet both acknowledged by Kafka and marked published.",
		}),
		publishedMarked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_outbox_rows_marked_published_total",
			Help: "Outbox rows whose published_at the relay set (rows already marked by an earlier run are not counted).",
		}),
		statusUpdatesOut: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_status_updates_total",
			Help: "Standby status updates sent to PostgreSQL.",
		}),
	}
	for _, c := range []prometheus.Collector{m.published, m.produceErrors, m.hashMismatches, m.commitToAck,
		m.confirmedLSN, m.slotLag, m.txnsInFlight, m.recordsInFlight, m.publishedMarked, m.statusUpdatesOut} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register relay metrics: %w", err)
		}
	}
	return m, nil
}
