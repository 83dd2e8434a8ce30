// Package taskevent is the Kafka contract of converge's task events (topic
// converge.task-events.v1, documented in docs/events.md and schemas/events).
//
// One event is written per task state change, as a row of outbox_event in the
// same transaction as the change. The record the CDC relay produces has:
//
//   - key: the task id (so all events of a task land on one partition, in
//     commit order);
//   - value: the RFC 8785 canonical JSON of Event (UTF-8, no whitespace);
//   - headers: HeaderEventID (= outbox_id, the message identity the inboxes
//     deduplicate on), HeaderEventType, HeaderAggregateVersion (decimal task
//     version after the change), HeaderPayloadSHA256 (lowercase hex SHA-256
//     of the value bytes), HeaderContentType ("application/json").
//
// Consumers must treat delivery as at-least-once: the same event id can
// arrive more than once, with the same value.
package taskevent

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	jsonv2 "github.com/go-json-experiment/json"

	"github.com/converge-run/converge/internal/canon"
)

// Event types (outbox_event.event_type).
const (
	TypeTaskCreated   = "TaskCreated"
	TypeTaskCompleted = "TaskCompleted"
	TypeTaskFailed    = "TaskFailed"
	// TypeTaskRedriveRequested is written by the reconciler for a task left
	// queued or running without progress; it carries the task's current
	// version (unchanged) and the worker handles it like TaskCreated.
	TypeTaskRedriveRequested = "TaskRedriveRequested"
	// TypeTaskCancelled is written by the API when a queued task is
	// cancelled (POST /v1/tasks/{id}/cancel, a version-guarded change).
	TypeTaskCancelled = "TaskCancelled"
)

// DeadLetterTopic returns the dead-letter topic of a task-events topic:
// topic + ".dlq".
func DeadLetterTopic(topic string) string { return topic + ".dlq" }

// SchemaVersion is the major version of the event schema; a breaking change
// bumps it and the topic name.
const SchemaVersion = 1

// DefaultTopic is the task-events topic name.
const DefaultTopic = "converge.task-events.v1"

// Header names of every task-event record.
const (
	HeaderEventID          = "event-id"
	HeaderEventType        = "event-type"
	HeaderAggregateVersion = "aggregate-version"
	HeaderPayloadSHA256    = "payload-sha256"
	HeaderContentType      = "content-type"
	// HeaderTenantID is the tenant of the task (issue 12), for routing by
	// tenant without parsing the value; empty for a task of before tenants.
	HeaderTenantID = "tenant-id"
)

// Task status values (task.status).
const (
	StatusQueued       = "queued"
	StatusRunning      = "running"
	StatusCompleted    = "completed"
	StatusFailed       = "failed"
	StatusCompensating = "compensating"
	StatusCompensated  = "compensated"
	StatusCancelled    = "cancelled"
)

// TerminalStatuses are the final statuses: completed, failed, compensated
// and cancelled. Read it, never change it.
var TerminalStatuses = []string{StatusCompleted, StatusFailed, StatusCompensated, StatusCancelled}

// Terminal reports whether status is final (TerminalStatuses).
func Terminal(status string) bool {
	return slices.Contains(TerminalStatuses, status)
}

// Task is the task snapshot every event carries and the Redis task view
// stores. Versions are below 2^53 (a CHECK constraint guarantees it), so they
// survive JSON and Lua doubles.
type Task struct {
	TaskID string `json:"task_id"`
	// TenantID is the tenant that owns the task (internal/tenant); empty for
	// tasks created before tenants existed (migration 00005), and then
	// omitted from the JSON.
	TenantID          string     `json:"tenant_id,omitempty"`
	Status            string     `json:"status"`
	Version           int64      `json:"version"`
	Attempt           int        `json:"attempt"`
	OutputFormat      string     `json:"output_format"`
	InputSHA256       string     `json:"input_sha256"`
	InputSize         int64      `json:"input_size"`
	ArtifactSHA256    *string    `json:"artifact_sha256"`
	ArtifactSize      *int64     `json:"artifact_size"`
	TerminalErrorCode *string    `json:"terminal_error_code"`
	CreatedAt         time.Time  `json:"created_at"`
	UpdatedAt         time.Time  `json:"updated_at"`
	CompletedAt       *time.Time `json:"completed_at"`
}

// Event is the value of a task-events record.
type Event struct {
	EventID       string    `json:"event_id"`
	EventType     string    `json:"event_type"`
	SchemaVersion int       `json:"schema_version"`
	TaskID        string    `json:"task_id"`
	TaskVersion   int64     `json:"task_version"`
	OccurredAt    time.Time `json:"occurred_at"`
	Task          Task      `json:"task"`
}

// Encode returns the canonical value bytes of e (RFC 8785) and their
// SHA-256 (lowercase hex). The error names the event type; it is returned for
// values the contract refuses: integers beyond ±(2^53-1) (the number policy
// of internal/canon), invalid UTF-8, times outside the years 0000–9999.
func Encode(e *Event) ([]byte, string, error) {
	if out, ok := appendCanonical(make([]byte, 0, 768), e); ok {
		return out, sha256Hex(out), nil
	}
	return encodeGeneric(e)
}

// encodeGeneric is Encode by encoding/json and canon.Transform: the
// reference the fast path is tested against, and the path for the values
// the fast path leaves to it.
func encodeGeneric(e *Event) ([]byte, string, error) {
	raw, err := json.Marshal(e)
	if err != nil {
		return nil, "", fmt.Errorf("encode %s event: %w", e.EventType, err)
	}
	return Canonical(raw)
}

// Canonical returns the RFC 8785 form of a JSON payload (as stored in
// outbox_event.payload) and its SHA-256: the record value and the
// HeaderPayloadSHA256 value.
func Canonical(payload []byte) ([]byte, string, error) {
	v, err := canon.Transform(payload)
	if err != nil {
		return nil, "", fmt.Errorf("canonicalize event payload: %w", err)
	}
	return v, canon.SHA256Hex(v), nil
}

// ErrInvalidEvent wraps every decoding failure of Decode.
var ErrInvalidEvent = errors.New("invalid task event")

// Decode parses a record value. It checks the fields every consumer relies
// on; it does not check the payload hash (see VerifyHash). Parsing is strict
// where the contract is (I-JSON, RFC 7493): valid UTF-8, member names matched
// exactly (case-sensitive) and never duplicated; members it does not know are
// ignored, so a minor version may add some.
func Decode(value []byte) (*Event, error) {
	var e Event
	if err := jsonv2.Unmarshal(value, &e); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidEvent, err)
	}
	switch {
	case e.EventID == "":
		return nil, fmt.Errorf("%w: event_id missing", ErrInvalidEvent)
	case e.TaskID == "" || e.Task.TaskID != e.TaskID:
		return nil, fmt.Errorf("%w: task_id missing or inconsistent", ErrInvalidEvent)
	case e.SchemaVersion != SchemaVersion:
		return nil, fmt.Errorf("%w: schema_version %d, want %d", ErrInvalidEvent, e.SchemaVersion, SchemaVersion)
	case e.TaskVersion != e.Task.Version || e.TaskVersion < 0:
		return nil, fmt.Errorf("%w: task_version inconsistent", ErrInvalidEvent)
	}
	return &e, nil
}

// NumHeaders is the number of headers of every task-event record.
const NumHeaders = 6

// Headers returns the record headers for an event as key/value pairs in a
// fixed order: the one definition of the header contract (the relay and
// every test build their records from it). An array, so that the relay's
// hot path does not allocate for it. tenantID is the task's tenant (the
// value's task.tenant_id), empty for a task of before tenants.
func Headers(eventID, eventType string, version int64, payloadSHA256, tenantID string) [NumHeaders][2]string {
	return [NumHeaders][2]string{
		{HeaderEventID, eventID},
		{HeaderEventType, eventType},
		{HeaderAggregateVersion, strconv.FormatInt(version, 10)},
		{HeaderPayloadSHA256, payloadSHA256},
		{HeaderContentType, "application/json"},
		{HeaderTenantID, tenantID},
	}
}

// Stable codes of records that break the contract (ContractError.Code).
const (
	// CodeInvalidEvent: the value is not a task event (Decode).
	CodeInvalidEvent = "INVALID_EVENT"
	// CodePayloadHashMismatch: the payload-sha256 header is missing or is
	// not the SHA-256 of the value.
	CodePayloadHashMismatch = "PAYLOAD_HASH_MISMATCH"
	// CodeEventIDMismatch: the event-id header is missing or differs from
	// the value's event_id.
	CodeEventIDMismatch = "EVENT_ID_MISMATCH"
	// CodeKeyMismatch: the record key is not the event's task id.
	CodeKeyMismatch = "KEY_MISMATCH"
)

// ContractError is a record that breaks the contract of this package: it is
// never processed (the same record fails the same way every time).
type ContractError struct {
	// Code is one of the Code* constants above.
	Code string
	Err  error
}

func (e *ContractError) Error() string { return e.Code + ": " + e.Err.Error() }
func (e *ContractError) Unwrap() error { return e.Err }

// CheckRecord checks a task-events record against the contract, as every
// consumer must before it trusts the value (seed 13.4: a payload that does
// not match its identity is not processed): the payload-sha256 header is
// present and is the SHA-256 of the value, the value decodes (Decode), the
// event-id header is the value's event_id and the key is its task id. The
// error is a *ContractError (wrapping ErrInvalidEvent for a value that does
// not decode). headers maps header names to values (the last of repeated
// names).
func CheckRecord(key, value []byte, headers map[string]string) (*Event, error) {
	if sum := canon.SHA256Hex(value); headers[HeaderPayloadSHA256] != sum {
		return nil, &ContractError{Code: CodePayloadHashMismatch,
			Err: fmt.Errorf("header %q, value hashes to %s", headers[HeaderPayloadSHA256], sum)}
	}
	ev, err := Decode(value)
	if err != nil {
		return nil, &ContractError{Code: CodeInvalidEvent, Err: err}
	}
	if id := headers[HeaderEventID]; id != ev.EventID {
		return nil, &ContractError{Code: CodeEventIDMismatch, Err: fmt.Errorf("header %q, value %q", id, ev.EventID)}
	}
	if string(key) != ev.TaskID {
		return nil, &ContractError{Code: CodeKeyMismatch, Err: fmt.Errorf("key %q, task %q", key, ev.TaskID)}
	}
	return ev, nil
}
