package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/dbpool"
)

// Park and the operator's decisions on parked rows (migration 00009; seed
// 4.1: attempts, last error category, a parked state after a limit, a human
// decision).

// Decisions recorded on a parked row.
const (
	DecisionRepublished = "republished"
	DecisionDiscarded   = "discarded"
)

var (
	// ErrNotFound: no outbox row has the id.
	ErrNotFound = errors.New("outbox row not found")
	// ErrNotParked: the row is not parked (published, or still the relay's).
	ErrNotParked = errors.New("outbox row is not parked")
	// ErrDecided: the parked row was already republished or discarded.
	ErrDecided = errors.New("parked outbox row already decided")
	// ErrReasonRequired: a decision needs a reason (and who decides).
	ErrReasonRequired = errors.New("a decision on a parked outbox row needs a reason and who decides")
)

// maxErrorText bounds last_error (the message of a broker's refusal can be
// long; the code says what it is).
const maxErrorText = 2000

func clip(s string) string {
	if len(s) > maxErrorText {
		return s[:maxErrorText]
	}
	return s
}

// Park records that the row id cannot be published (code: a stable error
// code such as MESSAGE_TOO_LARGE; message: the broker's or decoder's text)
// and counts the attempt. A parked row is settled for the relay: the slot
// moves past it. It reports whether it changed the row: false when the row
// is published or parked already, or not visible to this session yet
// (Classify tells which).
func Park(ctx context.Context, q dbpool.Querier, id, code, message string) (bool, error) {
	tag, err := q.Exec(ctx, `
UPDATE outbox_event
SET parked_at = now(), last_attempt_at = now(), publish_attempts = publish_attempts + 1,
    last_error_code = $2, last_error = $3
WHERE outbox_id = $1 AND `+sqlUnpublishedRow, id, code, clip(message))
	if err != nil {
		return false, fmt.Errorf("park outbox row %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// RecordFailure counts a failed publish attempt of the rows ids that are
// neither published nor parked (a retryable error: the relay tries again),
// with its code and message. It returns the rows it changed.
func RecordFailure(ctx context.Context, q dbpool.Querier, ids []string, code, message string) (int64, error) {
	tag, err := q.Exec(ctx, `
UPDATE outbox_event
SET last_attempt_at = now(), publish_attempts = publish_attempts + 1, last_error_code = $2, last_error = $3
WHERE outbox_id = ANY($1) AND `+sqlUnpublishedRow, ids, code, clip(message))
	if err != nil {
		return 0, fmt.Errorf("record failed publish attempt of %d outbox rows: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// RecordParkedFailure counts a failed republication of the parked,
// undecided row id (`converge outbox republish` refused again): the row
// stays parked, its attempts, last error and time are updated.
func RecordParkedFailure(ctx context.Context, q dbpool.Querier, id, code, message string) error {
	_, err := q.Exec(ctx, `
UPDATE outbox_event
SET last_attempt_at = now(), publish_attempts = publish_attempts + 1, last_error_code = $2, last_error = $3
WHERE outbox_id = $1 AND parked_at IS NOT NULL AND decision IS NULL`, id, code, clip(message))
	if err != nil {
		return fmt.Errorf("record failed republication of outbox row %s: %w", id, err)
	}
	return nil
}

// Stored is an outbox row as stored, with its publication state.
type Stored struct {
	ID            string     `json:"outbox_id"`
	TaskID        string     `json:"aggregate_id"`
	Version       int64      `json:"aggregate_version"`
	Type          string     `json:"event_type"`
	TenantID      string     `json:"tenant_id,omitempty"`
	Payload       []byte     `json:"-"`
	PayloadSize   int        `json:"payload_bytes"`
	PayloadSHA256 string     `json:"payload_sha256"`
	CreatedAt     time.Time  `json:"created_at"`
	PublishedAt   *time.Time `json:"published_at"`
	Attempts      int        `json:"publish_attempts"`
	LastErrorCode string     `json:"last_error_code,omitempty"`
	LastError     string     `json:"last_error,omitempty"`
	LastAttemptAt *time.Time `json:"last_attempt_at"`
	ParkedAt      *time.Time `json:"parked_at"`
	Decision      string     `json:"decision,omitempty"`
	DecidedAt     *time.Time `json:"decided_at"`
	DecidedBy     string     `json:"decided_by,omitempty"`
	Reason        string     `json:"decision_reason,omitempty"`
}

const storedColumns = `outbox_id, aggregate_id, aggregate_version, event_type, COALESCE(tenant_id, ''), payload, payload_sha256,
  created_at, outbox_published_at(outbox_event), outbox_publish_attempts(outbox_event), COALESCE(last_error_code, ''), COALESCE(last_error, ''), last_attempt_at,
  parked_at, COALESCE(decision, ''), decided_at, COALESCE(decided_by, ''), COALESCE(decision_reason, '')`

func scanStored(row pgx.Row) (Stored, error) {
	var s Stored
	var payload string
	err := row.Scan(&s.ID, &s.TaskID, &s.Version, &s.Type, &s.TenantID, &payload, &s.PayloadSHA256,
		&s.CreatedAt, &s.PublishedAt, &s.Attempts, &s.LastErrorCode, &s.LastError, &s.LastAttemptAt,
		&s.ParkedAt, &s.Decision, &s.DecidedAt, &s.DecidedBy, &s.Reason)
	s.Payload, s.PayloadSize = []byte(payload), len(payload)
	return s, err
}

// Get returns the row id, or ErrNotFound.
func Get(ctx context.Context, q dbpool.Querier, id string) (Stored, error) {
	s, err := scanStored(q.QueryRow(ctx, `SELECT `+storedColumns+` FROM outbox_event WHERE outbox_id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Stored{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if err != nil {
		return Stored{}, fmt.Errorf("read outbox row %s: %w", id, err)
	}
	return s, nil
}

// ParkedFilter selects the parked rows ListParked returns.
type ParkedFilter struct {
	// All includes the rows already decided (republished or discarded).
	// Defaults to false: only the rows no one decided on.
	All bool
	// Code, when not empty, keeps only the rows whose last_error_code is
	// Code (a stable code such as MESSAGE_TOO_LARGE; Park). Defaults to
	// every code.
	Code string
	// Limit is the most rows returned. Defaults to 100 (when 0 or less).
	Limit int
}

// ListParked returns the parked rows f selects, oldest park first
// (parked_at, then outbox_id), through outbox_event_parked_idx.
func ListParked(ctx context.Context, q dbpool.Querier, f ParkedFilter) ([]Stored, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := q.Query(ctx, `SELECT `+storedColumns+` FROM outbox_event
WHERE parked_at IS NOT NULL AND ($1 OR decision IS NULL) AND ($2 = '' OR last_error_code = $2)
ORDER BY parked_at, outbox_id LIMIT $3`, f.All, f.Code, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list parked outbox rows: %w", err)
	}
	defer rows.Close()
	var out []Stored
	for rows.Next() {
		s, err := scanStored(rows)
		if err != nil {
			return nil, fmt.Errorf("list parked outbox rows: %w", err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list parked outbox rows: %w", err)
	}
	return out, nil
}

// ParkedUndecided counts the parked rows no one decided on yet (the
// reconciler's gauge converge_outbox_parked_rows).
func ParkedUndecided(ctx context.Context, q dbpool.Querier) (int, error) {
	var n int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL AND decision IS NULL`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count parked outbox rows: %w", err)
	}
	return n, nil
}

// Decide records decision (DecisionRepublished: the caller produced the
// record and the broker acknowledged it, so published_at is set and the
// attempt counted; DecisionDiscarded: never published) on the parked,
// undecided row id, with who decided and why. ErrReasonRequired for a blank
// by or reason; ErrNotFound, ErrNotParked or ErrDecided otherwise.
func Decide(ctx context.Context, q dbpool.Querier, id, decision, by, reason string) error {
	if strings.TrimSpace(reason) == "" || strings.TrimSpace(by) == "" {
		return ErrReasonRequired
	}
	if decision != DecisionRepublished && decision != DecisionDiscarded {
		return fmt.Errorf("outbox decision %q: want %s or %s", decision, DecisionRepublished, DecisionDiscarded)
	}
	tag, err := q.Exec(ctx, `
UPDATE outbox_event
SET decision = $2, decided_at = now(), decided_by = $3, decision_reason = $4,
    published_at = CASE WHEN $2 = 'republished' THEN now() END,
    publish_attempts = publish_attempts + CASE WHEN $2 = 'republished' THEN 1 ELSE 0 END
WHERE outbox_id = $1 AND parked_at IS NOT NULL AND decision IS NULL`, id, decision, by, reason)
	if err != nil {
		return fmt.Errorf("record %s of outbox row %s: %w", decision, id, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	s, err := Get(ctx, q, id)
	if err != nil {
		return err
	}
	if s.ParkedAt == nil {
		return fmt.Errorf("%w: %s", ErrNotParked, id)
	}
	return fmt.Errorf("%w: %s was %s by %s at %s", ErrDecided, id, s.Decision, s.DecidedBy, s.DecidedAt.UTC().Format(time.RFC3339))
}
