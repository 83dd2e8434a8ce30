package deadletter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/projections/taskview"
)

// Dead-letter states (dead_letter.state).
const (
	StateParked   = "parked"
	StateReplayed = "replayed"
	StateResolved = "resolved"
	StateRefused  = "refused"
)

// Replay outcomes, the outcome label of converge_deadletter_replays_total.
const (
	// OutcomeReplayed: the original record was re-published (and its task
	// re-opened when it had failed because of this dead letter).
	OutcomeReplayed = "replayed"
	// OutcomeNoop: the task is terminal for another reason, or the dead
	// letter was already resolved; nothing was published.
	OutcomeNoop = "noop"
	// OutcomeRefused: MaxReplays reached, or the dead letter was refused
	// before; nothing was published.
	OutcomeRefused = "refused"
	// OutcomeError: the replay failed (database or broker); nothing changed.
	OutcomeError = "error"
)

// OutcomeResolved is the outcome of Resolve: a person marked the dead
// letter resolved without publishing. It is not a replay outcome (not
// counted in converge_deadletter_replays_total).
const OutcomeResolved = "resolved"

// DefaultMaxReplays is the default Config.MaxReplays.
const DefaultMaxReplays = 3

// ErrNotFound: no dead letter has the id.
var ErrNotFound = errors.New("dead letter not found")

// Header is a Kafka record header as stored in dead_letter.record_headers.
type Header struct {
	Key   string `json:"key"`
	Value []byte `json:"value"`
}

// DeadLetter is a dead_letter row.
type DeadLetter struct {
	ID                int64      `json:"id"`
	OriginTopic       string     `json:"origin_topic"`
	OriginPartition   int32      `json:"origin_partition"`
	OriginOffset      int64      `json:"origin_offset"`
	ConsumerGroup     string     `json:"consumer_group"`
	Key               []byte     `json:"key"`
	Value             []byte     `json:"value"`
	Headers           []Header   `json:"headers"`
	MessageID         *string    `json:"message_id"`
	TaskID            *string    `json:"task_id"`
	ErrorClass        string     `json:"error_class"`
	ErrorCode         string     `json:"error_code"`
	ErrorMessage      string     `json:"error_message"`
	Attempts          int        `json:"attempts"`
	ProcessorVersion  string     `json:"processor_version"`
	FirstFailureAt    time.Time  `json:"first_failure_at"`
	LastFailureAt     time.Time  `json:"last_failure_at"`
	DLQPartition      int32      `json:"dlq_partition"`
	DLQOffset         int64      `json:"dlq_offset"`
	State             string     `json:"state"`
	ReplayCount       int        `json:"replay_count"`
	LastReplayAt      *time.Time `json:"last_replay_at"`
	LastReplayBy      *string    `json:"last_replay_by"`
	LastReplayReason  *string    `json:"last_replay_reason"`
	LastReplayOutcome *string    `json:"last_replay_outcome"`
	RecordedAt        time.Time  `json:"recorded_at"`
	UpdatedAt         time.Time  `json:"updated_at"`
}

// CodeHeadersMissing is the error code recorded for a record of the
// dead-letter topic that lacks the worker's dlq-* origin headers: its own
// position is recorded as its origin, so it is never dropped.
const CodeHeadersMissing = "DLQ_HEADERS_MISSING"

// FromRecord builds the dead letter of a record consumed from the
// dead-letter topic: origin, error and times from the dlq-* headers (see
// worker.DeadLetterRecord), the original headers without them, message id
// from the event-id header and task id from the key.
func FromRecord(r *kgo.Record) DeadLetter {
	d := DeadLetter{Key: r.Key, Value: r.Value, DLQPartition: r.Partition, DLQOffset: r.Offset, Headers: []Header{}}
	h := map[string]string{}
	for _, kv := range r.Headers {
		if strings.HasPrefix(kv.Key, taskevent.HeaderDLQPrefix) {
			h[kv.Key] = string(kv.Value)
			continue
		}
		d.Headers = append(d.Headers, Header{Key: kv.Key, Value: kv.Value})
		if kv.Key == taskevent.HeaderEventID && len(kv.Value) > 0 {
			id := string(kv.Value)
			d.MessageID = &id
		}
	}
	if len(r.Key) > 0 {
		k := string(r.Key)
		d.TaskID = &k
	}
	part, perr := strconv.ParseInt(h[taskevent.HeaderDLQOriginalPart], 10, 32)
	off, oerr := strconv.ParseInt(h[taskevent.HeaderDLQOriginalOffset], 10, 64)
	if h[taskevent.HeaderDLQOriginalTopic] == "" || perr != nil || oerr != nil || part < 0 || off < 0 {
		d.OriginTopic, d.OriginPartition, d.OriginOffset = r.Topic, r.Partition, r.Offset
		d.ErrorClass, d.ErrorCode, d.ErrorMessage = taskevent.ClassDeterministic, CodeHeadersMissing, "record without dlq-* origin headers"
		d.Attempts, d.ProcessorVersion = 1, "unknown"
		d.FirstFailureAt, d.LastFailureAt = r.Timestamp.UTC(), r.Timestamp.UTC()
		return d
	}
	d.OriginTopic, d.OriginPartition, d.OriginOffset = h[taskevent.HeaderDLQOriginalTopic], int32(part), off
	d.ConsumerGroup = h[taskevent.HeaderDLQConsumerGroup]
	d.ErrorClass = h[taskevent.HeaderDLQErrorClass]
	if d.ErrorClass != taskevent.ClassRetryable {
		d.ErrorClass = taskevent.ClassDeterministic
	}
	d.ErrorCode = h[taskevent.HeaderDLQErrorCode]
	if d.ErrorCode == "" {
		d.ErrorCode = taskevent.CodeUnclassified
	}
	d.ErrorMessage = h[taskevent.HeaderDLQErrorMessage]
	if omitted := h[taskevent.HeaderDLQValueOmitted]; omitted != "" {
		// The dead-letter topic refused the original value (too large):
		// say so where `converge dlq show` shows it.
		d.ErrorMessage += " [value not kept: " + omitted + "]"
	}
	d.Attempts, _ = strconv.Atoi(h[taskevent.HeaderDLQAttempts])
	d.Attempts = max(d.Attempts, 1)
	d.ProcessorVersion = h[taskevent.HeaderDLQProcessorVersion]
	if d.ProcessorVersion == "" {
		d.ProcessorVersion = "unknown"
	}
	d.FirstFailureAt = parseTime(h[taskevent.HeaderDLQFirstFailureAt], r.Timestamp)
	d.LastFailureAt = parseTime(h[taskevent.HeaderDLQLastFailureAt], r.Timestamp)
	return d
}

func parseTime(s string, def time.Time) time.Time {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t.UTC()
	}
	return def.UTC()
}

// Config configures a Service.
type Config struct {
	// Pool is the PostgreSQL pool. Required.
	Pool *pgxpool.Pool
	// Producer publishes replayed records. Required for Replay (which
	// returns ErrNoProducer without it); List and Get work without it.
	Producer *kgo.Client
	// MaxReplays is how many times one TASK may be replayed, summed over
	// all its dead letters (a replay that fails again makes new ones: the
	// original record's and the TaskRedriveRequested event's); the next
	// request marks the dead letter refused. Dead letters without a task id
	// are counted per message id. Defaults to DefaultMaxReplays (3).
	MaxReplays int
	// DefaultGroup is the worker's consumer group (inbox consumer_name)
	// used for dead letters that do not name one. Defaults to
	// taskevent.DefaultWorkerGroup.
	DefaultGroup string
	// Cache, when set, is invalidated for a re-opened task after the
	// commit. Optional: the TaskRedriveRequested event written with the
	// re-open makes the projector write the queued view anyway.
	Cache *taskview.Cache
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives converge_deadletter_replays_total (reused when
	// already registered there). Defaults to a new registry, whose counts
	// nobody scrapes: `converge dlq replay` runs that way (it prints each
	// outcome instead); the API's service registers on the API's registry.
	Registerer prometheus.Registerer
	// ProduceTimeout bounds the broker's acknowledgement of a replayed
	// record. Defaults to 30s.
	ProduceTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.MaxReplays <= 0 {
		c.MaxReplays = DefaultMaxReplays
	}
	if c.DefaultGroup == "" {
		c.DefaultGroup = taskevent.DefaultWorkerGroup
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.ProduceTimeout <= 0 {
		c.ProduceTimeout = 30 * time.Second
	}
}

// Validate reports a missing field.
func (c *Config) Validate() error {
	if c.Pool == nil {
		return errors.New("deadletter: Pool is required")
	}
	return nil
}

// Service lists, shows, replays and resolves dead letters; `converge dlq`
// and the admin API both use it.
type Service struct {
	cfg     Config
	store   *Store
	replays *prometheus.CounterVec
}

// New validates cfg and returns a Service.
func New(cfg Config) (*Service, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	replays := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "converge_deadletter_replays_total",
		Help: "Dead-letter replay requests, by outcome (replayed, noop, refused, error).",
	}, []string{"outcome"})
	if err := cfg.Registerer.Register(replays); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("deadletter metrics: %w", err)
		}
		replays = are.ExistingCollector.(*prometheus.CounterVec)
	}
	for _, o := range []string{OutcomeReplayed, OutcomeNoop, OutcomeRefused, OutcomeError} {
		replays.WithLabelValues(o)
	}
	return &Service{cfg: cfg, store: NewStore(cfg.Pool), replays: replays}, nil
}

// Store returns the service's store.
func (s *Service) Store() *Store { return s.store }

// List returns dead letters matching f, oldest first.
func (s *Service) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	return s.store.List(ctx, f)
}

// Get returns one dead letter or ErrNotFound.
func (s *Service) Get(ctx context.Context, id int64) (DeadLetter, error) { return s.store.Get(ctx, id) }

// Request is who asks for a replay or resolve and why; both are recorded.
type Request struct {
	Reason string `json:"reason"`
	By     string `json:"by"`
}

// ErrReasonRequired: a replay or resolve request without a reason.
var ErrReasonRequired = errors.New("a replay or resolve needs a reason")

// Result is the answer to one replay request.
type Result struct {
	ID      int64  `json:"id"`
	Outcome string `json:"outcome"`
	// State is the dead letter's state afterwards.
	State string `json:"state"`
	// ReplayCount after the request.
	ReplayCount int `json:"replay_count"`
	// TaskReopened: the task had failed because of this dead letter and
	// was moved back to queued.
	TaskReopened bool `json:"task_reopened"`
	// Message explains the outcome for a person.
	Message string `json:"message"`
}

// ErrNoProducer: Replay was asked of a Service without a Kafka producer
// (Config.Producer); nothing changed.
var ErrNoProducer = errors.New("no Kafka producer configured: a replay cannot re-publish (set the Kafka brokers)")

// ErrPublish: the broker did not acknowledge the re-published record in
// time; the transaction was rolled back and nothing changed (the record
// may still have reached the topic: the inbox absorbs a duplicate).
var ErrPublish = errors.New("re-publish failed")

// Replay handles one replay request for dead letter id (see the package
// doc). It returns ErrReasonRequired, ErrNoProducer, ErrNotFound, ErrPublish
// or a database error (outcome error, nothing changed); refused and no-op
// answers are Results, not errors.
func (s *Service) Replay(ctx context.Context, id int64, req Request) (Result, error) {
	if strings.TrimSpace(req.Reason) == "" {
		return Result{ID: id}, ErrReasonRequired
	}
	if s.cfg.Producer == nil {
		return Result{ID: id}, ErrNoProducer
	}
	if req.By == "" {
		req.By = "unknown"
	}
	res, reopened, err := s.replay(ctx, id, req)
	if err != nil {
		if !errors.Is(err, ErrNotFound) {
			s.replays.WithLabelValues(OutcomeError).Inc()
		}
		return res, err
	}
	s.replays.WithLabelValues(res.Outcome).Inc()
	if reopened != "" && s.cfg.Cache != nil {
		if err := s.cfg.Cache.Invalidate(ctx, reopened); err != nil {
			s.cfg.Logger.WarnContext(ctx, "invalidate task view after re-open", slog.String("task_id", reopened), slog.Any("err", err))
		}
	}
	s.cfg.Logger.InfoContext(ctx, "dead letter replay", slog.Int64("id", id), slog.String("outcome", res.Outcome),
		slog.String("by", req.By), slog.String("reason", req.Reason), slog.String("message", res.Message))
	return res, nil
}

func (s *Service) replay(ctx context.Context, id int64, req Request) (Result, string, error) {
	res := Result{ID: id}
	var reopened string
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		res, reopened = Result{ID: id}, ""
		replays, err := lockTaskDeadLetters(ctx, tx, id)
		if err != nil {
			return err
		}
		d, err := get(ctx, tx, id, "FOR UPDATE")
		if err != nil {
			return err
		}
		res.State, res.ReplayCount = d.State, d.ReplayCount
		if d.State == StateResolved {
			res.Outcome, res.Message = OutcomeNoop, "dead letter already resolved; nothing to replay"
			return nil
		}
		group := d.ConsumerGroup
		if group == "" {
			group = s.cfg.DefaultGroup
		}
		// Locks in the order every worker transaction takes (inbox, task,
		// effect, outbox), so a replay and a delivery never deadlock.
		if d.MessageID != nil {
			if _, err := inbox.LockIfExists(ctx, tx, group, *d.MessageID); err != nil {
				return err
			}
		}
		var cur *taskevent.Task
		if d.TaskID != nil {
			t, found, err := task.Lock(ctx, tx, *d.TaskID)
			if err != nil {
				return err
			}
			if found {
				cur = &t
			}
		}
		// The task decides first, whatever the dead letter's state: a task
		// completed (by another route) or failed for another reason leaves
		// nothing to replay, and the dead letter is resolved — a refused one
		// too, so that it stops waiting for a person.
		failedHere := cur != nil && cur.Status == taskevent.StatusFailed && cur.TerminalErrorCode != nil && *cur.TerminalErrorCode == d.ErrorCode
		if cur != nil && taskevent.Terminal(cur.Status) && !failedHere {
			res.Outcome, res.State = OutcomeNoop, StateResolved
			res.Message = terminalMessage(*d.TaskID, *cur)
			return recordReplay(ctx, tx, id, StateResolved, 0, req.By, req.Reason, res.Message)
		}
		subject := limitSubject(d)
		if len(d.Value) == 0 {
			// Nothing to replay: the worker dead-lettered the record without
			// its value (too large for the dead-letter topic), or it had
			// none. Publishing it would only produce an empty record.
			res.Outcome = OutcomeRefused
			res.Message = "the dead letter keeps no value (" + d.ErrorMessage + "); nothing published: fix the task another way, or `converge dlq resolve`"
			return nil
		}
		if d.State == StateRefused {
			res.Outcome = OutcomeRefused
			res.Message = fmt.Sprintf("dead letter refused earlier (%s replayed %d times over all its dead letters, limit %d); nothing published: a person must decide (fix and complete the task, or `converge dlq resolve`)",
				subject, replays, s.cfg.MaxReplays)
			return nil
		}
		if d.State == StateReplayed {
			// Replayed before (a concurrent request may just have done it):
			// its redelivery is in flight or done; one that failed again is
			// parked as a new dead letter, which is the one to replay.
			res.Outcome = OutcomeNoop
			res.Message = fmt.Sprintf("dead letter already replayed (%d times); nothing published: a redelivery that failed again is parked as a new dead letter", d.ReplayCount)
			return recordReplay(ctx, tx, id, StateReplayed, 0, req.By, req.Reason, res.Message)
		}
		if replays >= s.cfg.MaxReplays {
			res.Outcome, res.State = OutcomeRefused, StateRefused
			res.Message = fmt.Sprintf("%s replayed %d times already over all its dead letters (limit %d): refused, nothing published", subject, replays, s.cfg.MaxReplays)
			return recordReplay(ctx, tx, id, StateRefused, 0, req.By, req.Reason, res.Message)
		}
		if failedHere {
			c, err := task.ReopenIfFailed(ctx, tx, *d.TaskID, cur.Version)
			if err != nil {
				return err
			}
			if !c.Applied {
				return fmt.Errorf("task %s changed while locked", *d.TaskID)
			}
			// The TaskRedriveRequested event of the re-opening (seed 4: in
			// the transaction of the change): the projector writes the
			// queued view from it, the worker drives the task from it like
			// from TaskCreated.
			if _, err := outbox.Insert(ctx, tx, taskevent.TypeTaskRedriveRequested, c.Task); err != nil {
				return err
			}
			res.TaskReopened, reopened = true, *d.TaskID
		}
		if d.MessageID != nil {
			if _, err := inbox.ResetFailed(ctx, tx, group, *d.MessageID); err != nil {
				return err
			}
		}
		rec := &kgo.Record{Topic: d.OriginTopic, Key: d.Key, Value: d.Value}
		for _, h := range d.Headers {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		pctx, cancel := context.WithTimeout(ctx, s.cfg.ProduceTimeout)
		err = s.cfg.Producer.ProduceSync(pctx, rec).FirstErr()
		cancel()
		if err != nil {
			return fmt.Errorf("%w: dead letter %d to %s: %w", ErrPublish, id, d.OriginTopic, err)
		}
		res.Outcome, res.State, res.ReplayCount = OutcomeReplayed, StateReplayed, d.ReplayCount+1
		res.Message = fmt.Sprintf("original record re-published to %s (replay %d of %d of %s)", d.OriginTopic, replays+1, s.cfg.MaxReplays, limitSubject(d))
		if res.TaskReopened {
			res.Message += fmt.Sprintf("; task %s re-opened (failed -> queued, TaskRedriveRequested written)", *d.TaskID)
		}
		return recordReplay(ctx, tx, id, StateReplayed, 1, req.By, req.Reason, res.Message)
	})
	if err != nil {
		return Result{ID: id, Outcome: OutcomeError}, "", err
	}
	return res, reopened, nil
}

// limitSubject names what MaxReplays counts for d: its task, or its
// message when the record named no task.
func limitSubject(d DeadLetter) string {
	switch {
	case d.TaskID != nil:
		return "task " + *d.TaskID
	case d.MessageID != nil:
		return "message " + *d.MessageID
	}
	return fmt.Sprintf("dead letter %d", d.ID)
}

// terminalMessage explains why a dead letter of a task that is terminal for
// another reason than the dead letter has nothing to replay.
func terminalMessage(taskID string, t taskevent.Task) string {
	if t.Status == taskevent.StatusCompleted {
		return fmt.Sprintf("task %s is already completed; nothing to replay", taskID)
	}
	if t.TerminalErrorCode != nil {
		return fmt.Sprintf("task %s %s with %s, not because of this dead letter; nothing to replay", taskID, t.Status, *t.TerminalErrorCode)
	}
	return fmt.Sprintf("task %s is already %s, not because of this dead letter; nothing to replay", taskID, t.Status)
}

// Resolve marks dead letter id resolved without publishing anything: a
// person decided that it needs no replay (the task was fixed another way,
// the record is obsolete, a refused dead letter was dealt with). The
// request's who/why and the time are recorded in the row (last_replay_*,
// which hold the last request, replay or resolve) and logged. It returns
// ErrReasonRequired, ErrNotFound or a database error; resolving a resolved
// dead letter is a no-op Result. It needs no Kafka producer. The dead
// letter's replay_count is kept: it still counts towards MaxReplays.
func (s *Service) Resolve(ctx context.Context, id int64, req Request) (Result, error) {
	if strings.TrimSpace(req.Reason) == "" {
		return Result{ID: id}, ErrReasonRequired
	}
	if req.By == "" {
		req.By = "unknown"
	}
	var res Result
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		d, err := get(ctx, tx, id, "FOR UPDATE")
		if err != nil {
			return err
		}
		res = Result{ID: id, State: d.State, ReplayCount: d.ReplayCount}
		if d.State == StateResolved {
			res.Outcome, res.Message = OutcomeNoop, "dead letter already resolved; nothing changed"
			return nil
		}
		res.Outcome, res.State = OutcomeResolved, StateResolved
		res.Message = fmt.Sprintf("dead letter resolved by hand (was %s); nothing published", d.State)
		return recordReplay(ctx, tx, id, StateResolved, 0, req.By, req.Reason, res.Message)
	})
	if err != nil {
		return Result{ID: id, Outcome: OutcomeError}, err
	}
	s.cfg.Logger.InfoContext(ctx, "dead letter resolve", slog.Int64("id", id), slog.String("outcome", res.Outcome),
		slog.String("by", req.By), slog.String("reason", req.Reason), slog.String("message", res.Message))
	return res, nil
}

// ReplayAll replays every parked dead letter (of code, when
// not empty), at most limit of them (default 1000), oldest first, and
// returns one Result per dead letter; it stops at the first error.
func (s *Service) ReplayAll(ctx context.Context, code string, limit int, req Request) ([]Result, error) {
	if strings.TrimSpace(req.Reason) == "" {
		return nil, ErrReasonRequired
	}
	if limit <= 0 {
		limit = 1000
	}
	ids, err := s.store.replayable(ctx, code, limit)
	if err != nil {
		return nil, err
	}
	out := make([]Result, 0, len(ids))
	for _, id := range ids {
		r, err := s.Replay(ctx, id, req)
		if err != nil {
			return out, err
		}
		out = append(out, r)
	}
	return out, nil
}
