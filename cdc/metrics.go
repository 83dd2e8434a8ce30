package cdc

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the converge_relay_* collectors (listed in doc.go).
type metrics struct {
	published            *prometheus.CounterVec
	produceErrors        prometheus.Counter
	hashMismatches       prometheus.Counter
	commitToAck          prometheus.Histogram
	confirmedLSN         prometheus.Gauge
	slotLag              prometheus.Gauge
	txnsInFlight         prometheus.Gauge
	recordsInFlight      prometheus.Gauge
	transactionsRecorded prometheus.Counter
	rowsAlreadyPublished prometheus.Counter

	outboxRowsInvisible prometheus.Counter
	outboxRowsGone      prometheus.Counter
	statusUpdatesOut    prometheus.Counter

	lastAckedLSN      prometheus.Gauge
	slotRetained      prometheus.Gauge
	slotWALStatus     *prometheus.GaugeVec
	slotSampleErrors  prometheus.Counter
	heartbeatsEmitted prometheus.Counter
	heartbeatErrors   prometheus.Counter
	heartbeatRTT      prometheus.Gauge
	heartbeatLastSeen prometheus.Gauge

	rowsParked *prometheus.CounterVec
	restarts   *prometheus.CounterVec
	streaming  prometheus.Gauge

	pubMismatch   *prometheus.GaugeVec
	pubMismatches *prometheus.CounterVec
}

// restartReasons are the values of converge_relay_restarts_total's reason
// label, all exported from the start.
var restartReasons = []string{reasonProduce, reasonKafka, reasonSlotActive, reasonDatabase, reasonOther}

const (
	reasonProduce    = "produce"     // a record failed for a retryable reason (broker down, timeout)
	reasonKafka      = "kafka"       // the broker unreachable when a session opens (topic check)
	reasonSlotActive = "slot_active" // another process streams from the slot
	reasonDatabase   = "database"    // PostgreSQL: connection, replication stream, an UPDATE
	reasonOther      = "other"
)

// walStatuses are the values of pg_replication_slots.wal_status
// (PostgreSQL 13+), each a series of converge_relay_slot_wal_status.
var walStatuses = []string{"reserved", "extended", "unreserved", "lost"}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_relay_events_published_total",
			Help: "Outbox events acknowledged by Kafka (acks=all), by event type. Republications after a restart count again.",
		}, []string{"event_type"}),
		produceErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_produce_errors_total",
			Help: "Records whose produce failed for good (non-retryable error or delivery timeout): a record the broker refuses is parked; any other failure restarts the relay's session from the slot.",
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
			Help: "pg_current_wal_lsn() - confirmed_flush_lsn of the replication slot, in bytes (sampled every SlotSampleInterval).",
		}),
		slotRetained: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_slot_retained_wal_bytes",
			Help: "pg_current_wal_lsn() - restart_lsn of the replication slot: WAL the server keeps for it, in bytes (sampled every SlotSampleInterval).",
		}),
		slotWALStatus: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "converge_relay_slot_wal_status",
			Help: "1 for the replication slot's current wal_status (reserved, extended, unreserved, lost), 0 for the others.",
		}, []string{"status"}),
		slotSampleErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_slot_sample_errors_total",
			Help: "Failed reads of pg_replication_slots for the slot metrics.",
		}),
		lastAckedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_last_acked_lsn",
			Help: "Highest commit LSN (as a number) up to which every transaction's outbox events are acknowledged by Kafka and recorded: the LSN the next status update confirms.",
		}),
		heartbeatsEmitted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_heartbeats_emitted_total",
			Help: "Heartbeats written into the WAL with pg_logical_emit_message.",
		}),
		heartbeatErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_heartbeat_errors_total",
			Help: "Heartbeats that could not be written (the relay goes on; the slot then only advances with outbox traffic).",
		}),
		heartbeatRTT: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_heartbeat_rtt_seconds",
			Help: "Time from writing the last received heartbeat into the WAL until the relay decoded it from the slot, in seconds.",
		}),
		heartbeatLastSeen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_heartbeat_last_received_timestamp_seconds",
			Help: "Unix time at which the relay last decoded one of its heartbeats from the slot.",
		}),
		txnsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_transactions_in_flight",
			Help: "Decoded transactions the slot has not been advanced past yet.",
		}),
		recordsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_records_in_flight",
			Help: "Records produced and not yet acknowledged by Kafka (or parked).",
		}),
		transactionsRecorded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_outbox_transactions_recorded_total",
			Help: "Transactions whose outbox rows the relay recorded as published (outbox_published_transaction, one row per transaction; transactions recorded by an earlier run are not counted).",
		}),
		rowsAlreadyPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_outbox_rows_already_published_total",
			Help: "Outbox rows the slot streamed again (after a restart, mostly one of PostgreSQL) whose transaction committed below the progress this slot's relay recorded (relay_progress): produced and recorded by an earlier session, not produced again.",
		}),
		outboxRowsInvisible: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_outbox_rows_not_yet_visible_total",
			Help: "Times a flush found an outbox row to park not yet visible to other sessions (its commit not yet visible, e.g. waiting for a synchronous standby); the row is parked at a later flush and the slot waits for it.",
		}),
		outboxRowsGone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_outbox_rows_gone_total",
			Help: "Outbox rows to park found deleted after their commit before they could be parked.",
		}),
		statusUpdatesOut: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_relay_status_updates_total",
			Help: "Standby status updates sent to PostgreSQL.",
		}),
		rowsParked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_relay_outbox_rows_parked_total",
			Help: "Outbox rows the relay parked (outbox_event.parked_at) because they cannot be published (the broker refuses the record, the row cannot be decoded), by error code; the stream goes on past them.",
		}, []string{"code"}),
		restarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_relay_restarts_total",
			Help: "Times the relay's session failed and was restarted from the slot after a backoff, by reason (produce, kafka, slot_active, database, other).",
		}, []string{"reason"}),
		streaming: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "converge_relay_streaming",
			Help: "1 while the relay streams from its slot, 0 while it connects or waits to restart.",
		}),
		pubMismatch: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "converge_relay_publication_mismatch",
			Help: "1 for the reason (missing, not_covered, no_insert, columns) while the last publication check or the outbox's last Relation message found that outbox inserts are not delivered, 0 otherwise; while 1 the relay does not stream and the slot does not advance.",
		}, []string{"reason"}),
		pubMismatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "converge_relay_publication_mismatches_total",
			Help: "Times a publication check or an outbox Relation message found a mismatch (missing, not_covered, no_insert, columns) after finding none (or another reason) before.",
		}, []string{"reason"}),
	}
	for _, c := range []prometheus.Collector{m.rowsParked, m.restarts, m.streaming, m.published, m.produceErrors, m.hashMismatches, m.commitToAck,
		m.confirmedLSN, m.slotLag, m.txnsInFlight, m.recordsInFlight, m.transactionsRecorded, m.rowsAlreadyPublished, m.outboxRowsInvisible, m.outboxRowsGone, m.statusUpdatesOut,
		m.lastAckedLSN, m.slotRetained, m.slotWALStatus, m.slotSampleErrors, m.heartbeatsEmitted, m.heartbeatErrors,
		m.heartbeatRTT, m.heartbeatLastSeen, m.pubMismatch, m.pubMismatches} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register relay metrics: %w", err)
		}
	}
	for _, st := range walStatuses {
		m.slotWALStatus.WithLabelValues(st) // export all statuses, 0 until sampled
	}
	for _, r := range restartReasons {
		m.restarts.WithLabelValues(r)
	}
	for _, r := range mismatchReasons {
		m.pubMismatch.WithLabelValues(r) // 0 until a check finds a mismatch
		m.pubMismatches.WithLabelValues(r)
	}
	return m, nil
}
