package worker

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/taskevent"
)

// Stable error codes the worker records (inbox_message.result_json
// "error_code", task.terminal_error_code, effect_ledger.error_code). Never
// rename one.
const (
	// CodeInvalidEvent, CodePayloadHashMismatch, CodeEventIDMismatch,
	// CodeKeyMismatch: the record breaks the task-events contract
	// (taskevent.CheckRecord).
	CodeInvalidEvent        = taskevent.CodeInvalidEvent
	CodePayloadHashMismatch = taskevent.CodePayloadHashMismatch
	CodeEventIDMismatch     = taskevent.CodeEventIDMismatch
	CodeKeyMismatch         = taskevent.CodeKeyMismatch
	// CodeEventTypeMismatch: the event-type header says TaskCreated, the value
	// another type.
	CodeEventTypeMismatch = "EVENT_TYPE_MISMATCH"
	// CodeTaskNotFound: the event names a task that does not exist, or
	// whose creating transaction stayed invisible for VisibilityTimeout
	// (see ErrNotYetVisible).
	CodeTaskNotFound = "TASK_NOT_FOUND"
	// CodeTaskInputNotFound: the task has no task_input row.
	CodeTaskInputNotFound = "TASK_INPUT_NOT_FOUND"
	// CodeTaskVersionConflict: the task is queued at another version than the
	// event's, or in a state the worker does not resume (compensating).
	CodeTaskVersionConflict = "TASK_VERSION_CONFLICT"
	// CodeEffectRequestMismatch: the ledger holds the effect's token with
	// another request hash or size than this run computed.
	CodeEffectRequestMismatch = "EFFECT_REQUEST_MISMATCH"
	// CodeArtifactVerificationFailed: the artifact read back does not match
	// the expected task id, attempt, size or SHA-256 (seed 7.1).
	CodeArtifactVerificationFailed = "ARTIFACT_VERIFICATION_FAILED"
	// CodeArtifactTokenInvalid: the artifact store refuses the token (the
	// task id has characters a token cannot hold).
	CodeArtifactTokenInvalid = "ARTIFACT_TOKEN_INVALID"
	// CodeRetriesExhausted: a retryable error persisted through MaxAttempts
	// attempts; the record was dead-lettered (class retryable).
	CodeRetriesExhausted = "RETRIES_EXHAUSTED"
	// CodeInjectedProcessingError: fault.WorkerProcessError fired (a poison
	// message made on purpose).
	CodeInjectedProcessingError = "INJECTED_PROCESSING_ERROR"
	// CodeUnclassified: a deterministic error without a code of its own.
	CodeUnclassified = taskevent.CodeUnclassified
)

// DeterministicError is a processing error that recurs on every attempt
// (seed 13.5): the record is recorded as failed and skipped, never retried.
type DeterministicError struct {
	// Code is one of the Code* constants.
	Code string
	Err  error
}

func (e *DeterministicError) Error() string { return e.Code + ": " + e.Err.Error() }
func (e *DeterministicError) Unwrap() error { return e.Err }

// ErrNotYetVisible is wrapped by a deterministic error whose cause may be
// only that the event's transaction is not yet visible to this session
// (TASK_NOT_FOUND). An event on the topic proves its transaction committed:
// the relay decodes a transaction once its commit record is flushed, but
// PostgreSQL makes its rows visible to other sessions only when the
// committing backend leaves the proc array — later, and with a synchronous
// standby only after the standby confirmed (issue 9). Such an error is
// retried in place with backoff until Config.VisibilityTimeout has passed
// since the record was produced (or first failed, whichever is earlier), and
// only then dead-lettered; the retries do not count against MaxAttempts.
var ErrNotYetVisible = errors.New("not visible (yet) to this session")

// errConcurrentChange: a compare-and-set found the row changed by someone
// else (another delivery, the reconciler); the attempt is retried and
// re-reads the current state.
var errConcurrentChange = errors.New("concurrent change")

// Retryable is the worker's single retry classifier: it reports whether a
// record whose processing failed with err must be retried in place (same
// record, after a backoff, partition order preserved) rather than recorded
// as a deterministic failure and skipped.
//
// Deterministic (false): *DeterministicError (one wrapping ErrNotYetVisible
// is retried until VisibilityTimeout, see processRecord), *canon.Error,
// taskevent.ErrInvalidEvent, artifact.ErrInvalidToken, and PostgreSQL errors
// of class 22 (data exception) and 23 (integrity constraint violation),
// which depend on the record's data. Everything else is retryable: network
// and connection errors, context deadlines, other PostgreSQL errors
// (serialization failures, deadlocks, shutdowns, a missing migration), store
// I/O errors and timeouts, injected faults, concurrent changes — an
// infrastructure problem blocks the partition until it is fixed instead of
// failing every record that meets it.
func Retryable(err error) bool {
	if err == nil {
		return false
	}
	var de *DeterministicError
	var ce *canon.Error
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &de), errors.As(err, &ce),
		errors.Is(err, taskevent.ErrInvalidEvent), errors.Is(err, artifact.ErrInvalidToken):
		return false
	case errors.As(err, &pe):
		return !(len(pe.Code) == 5 && (pe.Code[:2] == "22" || pe.Code[:2] == "23"))
	}
	return true
}

// ErrorCode returns the stable code recorded for a deterministic error:
// the DeterministicError or canon.Error code, INVALID_EVENT,
// ARTIFACT_TOKEN_INVALID, "SQLSTATE_<code>" for a PostgreSQL error, else
// UNCLASSIFIED.
func ErrorCode(err error) string {
	var de *DeterministicError
	var ce *canon.Error
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &de):
		return de.Code
	case errors.As(err, &ce):
		return ce.Code
	case errors.Is(err, taskevent.ErrInvalidEvent):
		return CodeInvalidEvent
	case errors.Is(err, artifact.ErrInvalidToken):
		return CodeArtifactTokenInvalid
	case errors.As(err, &pe):
		return "SQLSTATE_" + pe.Code
	}
	return CodeUnclassified
}
