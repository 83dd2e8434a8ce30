package cdc

import (
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
)

// Defaults of Config.
const (
	DefaultSlotName           = "converge_outbox"
	DefaultPublicationName    = "converge_outbox"
	DefaultPartitions         = 4
	DefaultStatusInterval     = time.Second
	DefaultReceiveTimeout     = time.Second
	DefaultFlushInterval      = 100 * time.Millisecond
	DefaultFlushMaxRecords    = 1000
	DefaultMaxBufferedRecords = 10000
	DefaultDeliveryTimeout    = time.Minute
	DefaultShutdownTimeout    = 10 * time.Second
	DefaultRestartBackoffMin  = 500 * time.Millisecond
	DefaultRestartBackoffMax  = 10 * time.Second
	DefaultHeartbeatInterval  = 10 * time.Second
	DefaultSlotSampleInterval = 10 * time.Second
)

// HeartbeatPrefix is the prefix of the relay's heartbeat messages
// (pg_logical_emit_message). Their content is the JSON object
// {"slot": <SlotName>, "emitted_at": <RFC 3339 time>}.
const HeartbeatPrefix = "converge-heartbeat"

// Config configures a Relay. The zero value is invalid only for DatabaseURL
// and Brokers; every other field has a default.
type Config struct {
	// DatabaseURL is the PostgreSQL URL (or keyword/value DSN) of the
	// database holding outbox_event. The relay opens a normal connection
	// pool (setup, the records of published transactions) and one replication connection
	// (the same URL with replication=database). The role needs the
	// REPLICATION attribute and CREATE on the database (for the
	// publication). Required.
	DatabaseURL string
	// Brokers are the Kafka seed brokers (host:port). Required.
	Brokers []string
	// Topic receives the task events. Defaults to taskevent.DefaultTopic.
	Topic string
	// Partitions is the partition count used when the relay creates Topic
	// at start (an existing topic is left as it is). Defaults to 4.
	Partitions int32
	// SlotName is the permanent logical replication slot (pgoutput) the
	// relay owns; [a-z0-9_], at most 63 characters. Slots are cluster-wide:
	// use one name per database and outbox shard. Defaults to
	// "converge_outbox".
	SlotName string
	// PublicationName is the publication on public.outbox_event (inserts
	// only); [a-z0-9_], at most 63 characters. Defaults to
	// "converge_outbox".
	PublicationName string
	// StatusInterval is the longest time between two standby status
	// updates; the server's keepalive requests are answered at once.
	// Keep it well below the server's wal_sender_timeout (default 60s).
	// Defaults to 1s.
	StatusInterval time.Duration
	// ReceiveTimeout is the longest a single receive from the replication
	// connection waits before the loop flushes and sends due status
	// updates. Defaults to 1s.
	ReceiveTimeout time.Duration
	// FlushInterval is the longest a transaction whose records Kafka
	// acknowledged waits for its record in outbox_published_transaction
	// (and so for the slot to move past it). Defaults to 100ms.
	FlushInterval time.Duration
	// FlushMaxRecords flushes earlier once this many transactions (and
	// rows to park) wait for the marker; it is also the most transactions
	// one INSERT records. Defaults to 1000.
	FlushMaxRecords int
	// MaxBufferedRecords bounds the records produced and not yet
	// acknowledged by Kafka (also passed as kgo.MaxBufferedRecords), and,
	// separately, the decoded transactions the slot has not passed yet:
	// decoding blocks when either is reached, so memory stays bounded
	// whatever the size of a transaction and the speed of the recording
	// INSERT. Defaults to 10000.
	MaxBufferedRecords int
	// DeliveryTimeout is how long a record may stay unacknowledged
	// (retries included) before its produce fails (kgo.RecordDeliveryTimeout):
	// the failure is recorded on the row and the session restarts from the
	// slot after RestartBackoffMin..Max. Defaults to 1m.
	DeliveryTimeout time.Duration
	// RestartBackoffMin and RestartBackoffMax bound the wait before Run
	// opens a new session after one failed (exponential with jitter,
	// package backoff; back to the minimum after a session that streamed
	// for a minute). Default to 500ms and 10s: a session's open is one
	// PostgreSQL connection and one Kafka metadata request, cheap enough to
	// try every 10 s through a long outage, and the relay streams again at
	// most 10 s after its dependencies are back.
	RestartBackoffMin, RestartBackoffMax time.Duration
	// ShutdownTimeout bounds the wait for in-flight records, the last
	// record of published transactions and the final status update after ctx is
	// cancelled. Defaults to 10s.
	ShutdownTimeout time.Duration
	// HeartbeatInterval is how often the relay writes a heartbeat into the
	// WAL (pg_logical_emit_message(true, HeartbeatPrefix, ...), a tiny
	// transaction of its own) so that the slot advances while the outbox
	// is idle and other tables generate WAL: without it an idle outbox
	// retains all WAL written since the last outbox commit. The heartbeat
	// needs PostgreSQL 14 or later (pgoutput's messages option). Defaults
	// to 10s; a negative value disables heartbeats.
	HeartbeatInterval time.Duration
	// SlotSampleInterval is how often the relay reads its slot from
	// pg_replication_slots for the converge_relay_slot_* metrics (lag,
	// retained WAL, wal_status) and checks its publication, while it
	// streams and while it waits for a mismatch to be fixed. Defaults to
	// 10s.
	SlotSampleInterval time.Duration
	// Logger receives the relay's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the converge_relay_* metrics. Defaults to a new,
	// private prometheus.Registry (metrics are then not exported).
	Registerer prometheus.Registerer
	// Faults arms the fault points fault.RelayBeforeMarkPublished and
	// fault.RelayAfterAckBeforeConfirm. Defaults to nil (no faults).
	Faults *fault.Set
	// RepairPublication makes the relay, when it opens a session (at
	// start, and right after a check found a mismatch while it streamed),
	// alter a publication that no longer covers public.outbox_event (or
	// no longer publishes inserts) back instead of waiting for a person to
	// fix it (the mismatch is still counted and logged). For `converge
	// dev`, whose embedded PostgreSQL an operator cannot reach while it is
	// stopped; production keeps the strict check (a person decides).
	// Defaults to false.
	RepairPublication bool
	// KafkaOpts are appended to the relay's franz-go client options (after
	// its own, so they win). Meant for tests; do not disable idempotency
	// or change the partitioner. Defaults to none.
	KafkaOpts []kgo.Opt
}

var identRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = taskevent.DefaultTopic
	}
	if c.Partitions == 0 {
		c.Partitions = DefaultPartitions
	}
	if c.SlotName == "" {
		c.SlotName = DefaultSlotName
	}
	if c.PublicationName == "" {
		c.PublicationName = DefaultPublicationName
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = DefaultStatusInterval
	}
	if c.ReceiveTimeout == 0 {
		c.ReceiveTimeout = DefaultReceiveTimeout
	}
	if c.FlushInterval == 0 {
		c.FlushInterval = DefaultFlushInterval
	}
	if c.FlushMaxRecords == 0 {
		c.FlushMaxRecords = DefaultFlushMaxRecords
	}
	if c.MaxBufferedRecords == 0 {
		c.MaxBufferedRecords = DefaultMaxBufferedRecords
	}
	if c.DeliveryTimeout == 0 {
		c.DeliveryTimeout = DefaultDeliveryTimeout
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.RestartBackoffMin == 0 {
		c.RestartBackoffMin = DefaultRestartBackoffMin
	}
	if c.RestartBackoffMax == 0 {
		c.RestartBackoffMax = DefaultRestartBackoffMax
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.SlotSampleInterval == 0 {
		c.SlotSampleInterval = DefaultSlotSampleInterval
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
}

// Validate reports every invalid field of c (after defaults are applied by
// New; called on a raw Config it also reports missing defaults).
func (c *Config) Validate() error {
	var errs []error
	if c.DatabaseURL == "" {
		errs = append(errs, errors.New("DatabaseURL is required"))
	} else if _, err := pgconn.ParseConfig(c.DatabaseURL); err != nil {
		errs = append(errs, fmt.Errorf("DatabaseURL: %w", err))
	}
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("Brokers is required"))
	}
	if c.Topic == "" {
		errs = append(errs, errors.New("Topic is empty"))
	}
	if c.Partitions <= 0 {
		errs = append(errs, fmt.Errorf("Partitions %d: must be positive", c.Partitions))
	}
	if !identRE.MatchString(c.SlotName) {
		errs = append(errs, fmt.Errorf("SlotName %q: want [a-z0-9_]{1,63}", c.SlotName))
	}
	if !identRE.MatchString(c.PublicationName) {
		errs = append(errs, fmt.Errorf("PublicationName %q: want [a-z0-9_]{1,63}", c.PublicationName))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"StatusInterval", c.StatusInterval},
		{"ReceiveTimeout", c.ReceiveTimeout},
		{"FlushInterval", c.FlushInterval},
		{"DeliveryTimeout", c.DeliveryTimeout},
		{"ShutdownTimeout", c.ShutdownTimeout},
		{"SlotSampleInterval", c.SlotSampleInterval},
		{"RestartBackoffMin", c.RestartBackoffMin},
		{"RestartBackoffMax", c.RestartBackoffMax},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s %s: must be positive", d.name, d.v))
		}
	}
	if c.RestartBackoffMax < c.RestartBackoffMin {
		errs = append(errs, fmt.Errorf("RestartBackoffMax %s: below RestartBackoffMin %s", c.RestartBackoffMax, c.RestartBackoffMin))
	}
	if c.FlushMaxRecords <= 0 {
		errs = append(errs, fmt.Errorf("FlushMaxRecords %d: must be positive", c.FlushMaxRecords))
	}
	if c.MaxBufferedRecords <= 0 {
		errs = append(errs, fmt.Errorf("MaxBufferedRecords %d: must be positive", c.MaxBufferedRecords))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cdc config: %w", err)
	}
	return nil
}
