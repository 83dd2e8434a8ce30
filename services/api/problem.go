package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/canon"
)

// Problem codes of the API. Each is the "code" member of a problem document
// and, lower-kebab-cased, the last segment of its "type" URI. Codes are
// stable: never rename one. The I-JSON codes of package canon
// (MALFORMED_JSON, INVALID_UTF8, DUPLICATE_MEMBER_NAME, LONE_SURROGATE,
// NUMBER_OUT_OF_RANGE, NUMBER_PRECISION_LOSS, NESTING_TOO_DEEP) are used
// as they are.
const (
	CodeUnsupportedMediaType    = "UNSUPPORTED_MEDIA_TYPE"
	CodeIdempotencyKeyMissing   = "IDEMPOTENCY_KEY_MISSING"
	CodeIdempotencyKeyInvalid   = "IDEMPOTENCY_KEY_INVALID"
	CodeBodyTooLarge            = "BODY_TOO_LARGE"
	CodeUnsupportedOutputFormat = "UNSUPPORTED_OUTPUT_FORMAT"
	CodeDocumentMissing         = "DOCUMENT_MISSING"
	CodeUnknownMember           = "UNKNOWN_MEMBER"
	CodeIdempotencyKeyReused    = "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST"
	CodeIdempotencyInProgress   = "IDEMPOTENCY_REQUEST_IN_PROGRESS"
	CodeTaskNotFound            = "TASK_NOT_FOUND"
	CodeArtifactNotReady        = "ARTIFACT_NOT_READY"
	CodeTaskFailed              = "TASK_FAILED"
	CodeArtifactUnavailable     = "ARTIFACT_UNAVAILABLE"
	CodeNotFound                = "NOT_FOUND"
	CodeMethodNotAllowed        = "METHOD_NOT_ALLOWED"
	CodeDatabaseUnavailable     = "DATABASE_UNAVAILABLE"
	CodeUnauthenticated         = "UNAUTHENTICATED"
	CodeForbidden               = "FORBIDDEN"
	CodeQuotaExhausted          = "QUOTA_EXHAUSTED"
	CodeRateLimited             = "RATE_LIMITED"
	CodePreconditionRequired    = "PRECONDITION_REQUIRED"
	CodeIfMatchInvalid          = "IF_MATCH_INVALID"
	CodeVersionMismatch         = "VERSION_MISMATCH"
	CodeTaskNotCancellable      = "TASK_NOT_CANCELLABLE"
	CodeTaskCancelled           = "TASK_CANCELLED"
	// CodeArtifactExpired: the task is past the task retention window and
	// its artifact was deleted (the task's rows follow in the same pass).
	CodeArtifactExpired = "ARTIFACT_EXPIRED"
	CodeOverloaded      = "OVERLOADED"
	CodeRequestTimeout  = "REQUEST_TIMEOUT"
	// CodeClientClosedRequest is recorded (status 499, nginx's convention)
	// when the client went away before the answer: its cancelled context,
	// not the database, ended the request. Nobody receives it.
	CodeClientClosedRequest = "CLIENT_CLOSED_REQUEST"
	CodeCacheUnavailable    = "CACHE_UNAVAILABLE"
	CodeInternal            = "INTERNAL"
)

const (
	problemTypeBase    = "https://converge.dev/problems/"
	problemContentType = "application/problem+json"
	retryAfterSeconds  = "1"
)

// problemKind is the HTTP status and title of a code.
type problemKind struct {
	status int
	title  string
}

// kinds maps every code the API emits (outside canon errors found inside a
// document, see problemFor) to its status and title.
var kinds = map[string]problemKind{
	CodeUnsupportedMediaType:      {http.StatusUnsupportedMediaType, "Content-Type must be application/json"},
	CodeIdempotencyKeyMissing:     {http.StatusBadRequest, "Idempotency-Key header missing"},
	CodeIdempotencyKeyInvalid:     {http.StatusBadRequest, "Idempotency-Key header invalid"},
	CodeBodyTooLarge:              {http.StatusRequestEntityTooLarge, "Request body too large"},
	canon.CodeMalformedJSON:       {http.StatusBadRequest, "Malformed JSON"},
	canon.CodeInvalidUTF8:         {http.StatusBadRequest, "Request body is not valid UTF-8"},
	canon.CodeDuplicateMemberName: {http.StatusBadRequest, "Duplicate member in the request object"},
	canon.CodeNestingTooDeep:      {http.StatusUnprocessableEntity, "Request nested too deeply"},
	CodeUnsupportedOutputFormat:   {http.StatusUnprocessableEntity, "Unsupported output format"},
	CodeDocumentMissing:           {http.StatusUnprocessableEntity, "Member \"document\" missing"},
	CodeUnknownMember:             {http.StatusUnprocessableEntity, "Unknown member in the request object"},
	CodeIdempotencyKeyReused:      {http.StatusUnprocessableEntity, "Idempotency-Key reused with a different request"},
	CodeIdempotencyInProgress:     {http.StatusConflict, "A request with this Idempotency-Key is in progress"},
	CodeTaskNotFound:              {http.StatusNotFound, "Task not found"},
	CodeArtifactNotReady:          {http.StatusConflict, "Artifact not ready"},
	CodeTaskFailed:                {http.StatusConflict, "Task failed: no artifact"},
	CodeArtifactUnavailable:       {http.StatusServiceUnavailable, "Artifact unavailable"},
	CodeNotFound:                  {http.StatusNotFound, "Not found"},
	CodeMethodNotAllowed:          {http.StatusMethodNotAllowed, "Method not allowed"},
	CodeDatabaseUnavailable:       {http.StatusServiceUnavailable, "Database unavailable"},
	CodeUnauthenticated:           {http.StatusUnauthorized, "Authentication required"},
	CodeForbidden:                 {http.StatusForbidden, "Forbidden"},
	CodeQuotaExhausted:            {http.StatusTooManyRequests, "Quota exhausted"},
	CodeRateLimited:               {http.StatusTooManyRequests, "Too many requests in process"},
	CodePreconditionRequired:      {http.StatusPreconditionRequired, "If-Match required"},
	CodeIfMatchInvalid:            {http.StatusBadRequest, "If-Match invalid"},
	CodeVersionMismatch:           {http.StatusPreconditionFailed, "Task version does not match"},
	CodeTaskNotCancellable:        {http.StatusConflict, "Task cannot be cancelled"},
	CodeTaskCancelled:             {http.StatusConflict, "Task cancelled: no artifact"},
	CodeArtifactExpired:           {http.StatusGone, "Artifact removed by retention"},
	CodeOverloaded:                {http.StatusServiceUnavailable, "Overloaded"},
	CodeRequestTimeout:            {http.StatusRequestTimeout, "Request body not received in time"},
	CodeClientClosedRequest:       {StatusClientClosedRequest, "Client closed the request"},
	CodeCacheUnavailable:          {http.StatusServiceUnavailable, "Cache unavailable"},
	CodeInternal:                  {http.StatusInternalServerError, "Internal error"},
}

// documentIJSONTitles are the titles of canon codes found inside the
// submitted document (valid JSON, not I-JSON: 422).
var documentIJSONTitles = map[string]string{
	canon.CodeDuplicateMemberName: "Duplicate member name in document",
	canon.CodeLoneSurrogate:       "Lone surrogate in document",
	canon.CodeNumberOutOfRange:    "Number out of range in document",
	canon.CodeNumberPrecisionLoss: "Number would lose precision in document",
	canon.CodeNestingTooDeep:      "Document nested too deeply",
}

// Error is an API error with a stable code (one of the Code* constants or a
// canon code). Handlers return it; problemFor turns it into a response.
type Error struct {
	Code   string
	Detail string
	// Extensions are extra members of the problem document (RFC 9457
	// section 3.2), for example "task_status".
	Extensions map[string]any
	// Err is the cause, logged but never shown to the client.
	Err error
}

func (e *Error) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s: %s: %v", e.Code, e.Detail, e.Err)
	}
	return e.Code + ": " + e.Detail
}

func (e *Error) Unwrap() error { return e.Err }

func newError(code, format string, args ...any) *Error {
	return &Error{Code: code, Detail: fmt.Sprintf(format, args...)}
}

// problem is an RFC 9457 problem document plus the response headers it
// needs.
type problem struct {
	Type       string
	Title      string
	Status     int
	Detail     string
	Code       string
	Extensions map[string]any
	RetryAfter bool
}

// problemFor is THE mapping from errors to HTTP status codes:
//
//   - *Error: the status of its code in kinds;
//   - *canon.Error (a problem inside the submitted document): 400 when the
//     text is not JSON (Syntax), else 422, with the canon code;
//   - *http.MaxBytesError: 413 BODY_TOO_LARGE;
//   - PostgreSQL unreachable, timing out, shutting down, overloaded, or a
//     serialization/deadlock/lock_timeout abort: 503 DATABASE_UNAVAILABLE with
//     Retry-After;
//   - anything else: 500 INTERNAL (a defect: no input may lead here).
func problemFor(err error) problem {
	var (
		ae *Error
		ce *canon.Error
		me *http.MaxBytesError
	)
	switch {
	case errors.As(err, &ae):
		k, ok := kinds[ae.Code]
		if !ok {
			k = kinds[CodeInternal]
		}
		p := problem{Title: k.title, Status: k.status, Detail: ae.Detail, Code: ae.Code, Extensions: ae.Extensions}
		if !ok {
			p.Code = CodeInternal
		}
		p.RetryAfter = p.Code == CodeIdempotencyInProgress || p.Code == CodeRateLimited || p.Status == http.StatusServiceUnavailable
		p.Type = problemType(p.Code)
		return p
	case errors.As(err, &ce):
		p := problem{Status: http.StatusUnprocessableEntity, Code: ce.Code, Detail: "document: " + ce.Error()}
		if ce.Syntax() {
			p.Status = http.StatusBadRequest
			p.Title = kinds[ce.Code].title
		} else if t, ok := documentIJSONTitles[ce.Code]; ok {
			p.Title = t
		} else {
			p.Title = "Document is not I-JSON"
		}
		p.Type = problemType(p.Code)
		return p
	case errors.As(err, &me):
		return problemFor(newError(CodeBodyTooLarge, "request body exceeds %d bytes", me.Limit))
	case lockNotAvailable(err):
		return problemFor(&Error{Code: CodeDatabaseUnavailable, Detail: "a lock held by another transaction was not released within the lock timeout; retry later", Err: err})
	case databaseUnavailable(err):
		return problemFor(&Error{Code: CodeDatabaseUnavailable, Detail: "the database did not answer; retry later", Err: err})
	default:
		return problemFor(&Error{Code: CodeInternal, Detail: "internal error", Err: err})
	}
}

// databaseUnavailable reports whether err means PostgreSQL could not serve
// the request for a transient reason (as opposed to a defect).
func databaseUnavailable(err error) bool {
	if err == nil {
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"), // connection exception
			strings.HasPrefix(pe.Code, "53"),                           // insufficient resources
			strings.HasPrefix(pe.Code, "57"),                           // operator intervention (shutdown, cancel)
			pe.Code == "40001", pe.Code == "40P01", pe.Code == "55P03": // serialization, deadlock, lock_timeout
			return true
		}
		return false
	}
	var (
		connErr *pgconn.ConnectError
		netErr  net.Error
	)
	return errors.As(err, &connErr) || errors.As(err, &netErr) || pgconn.Timeout(err) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		strings.Contains(err.Error(), "closed pool")
}

// problemType returns the type URI of code: problemTypeBase + lower-kebab.
func problemType(code string) string {
	return problemTypeBase + strings.ReplaceAll(strings.ToLower(code), "_", "-")
}

// writeProblem writes p as application/problem+json.
func writeProblem(w http.ResponseWriter, p problem) {
	doc := make(map[string]any, 5+len(p.Extensions))
	for k, v := range p.Extensions {
		doc[k] = v
	}
	doc["type"], doc["title"], doc["status"], doc["detail"], doc["code"] = p.Type, p.Title, p.Status, p.Detail, p.Code
	body, err := json.Marshal(doc)
	if err != nil { // extensions are plain values; cannot happen
		body = []byte(`{"type":"` + problemType(CodeInternal) + `","title":"Internal error","status":500,"code":"INTERNAL"}`)
		p.Status = http.StatusInternalServerError
	}
	h := w.Header()
	h.Set("Content-Type", problemContentType)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter {
		h.Set("Retry-After", retryAfterSeconds)
	}
	if p.Status == http.StatusUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="converge"`) // RFC 6750 section 3
	}
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}
