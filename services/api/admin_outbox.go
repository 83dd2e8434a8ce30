package api

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/internal/outbox"
)

// Problem codes of the outbox admin endpoints (parked outbox rows, seed
// 4.1; issue 13).
const (
	CodeOutboxRowNotFound          = "OUTBOX_ROW_NOT_FOUND"
	CodeOutboxRowNotParked         = "OUTBOX_ROW_NOT_PARKED"
	CodeOutboxRowAlreadyDecided    = "OUTBOX_ROW_ALREADY_DECIDED"
	CodeOutboxReasonRequired       = "OUTBOX_REASON_REQUIRED"
	CodeOutboxRepublishUnavailable = "OUTBOX_REPUBLISH_UNAVAILABLE"
	CodeOutboxRepublishFailed      = "OUTBOX_REPUBLISH_FAILED"
	CodeOutboxRecordTooLarge       = "OUTBOX_RECORD_TOO_LARGE"

	outboxCollectionPattern = "/v1/admin/outbox"
	defaultOutboxListLimit  = 100
	maximumOutboxListLimit  = 1000
	maximumOutboxIDBytes    = 255
	outboxRepublishTimeout  = time.Minute
)

func init() {
	kinds[CodeOutboxRowNotFound] = problemKind{http.StatusNotFound, "Outbox row not found"}
	kinds[CodeOutboxRowNotParked] = problemKind{http.StatusConflict, "Outbox row is not parked"}
	kinds[CodeOutboxRowAlreadyDecided] = problemKind{http.StatusConflict, "Parked outbox row already decided"}
	kinds[CodeOutboxReasonRequired] = problemKind{http.StatusUnprocessableEntity, "A decision on a parked outbox row needs a reason"}
	kinds[CodeOutboxRepublishUnavailable] = problemKind{http.StatusServiceUnavailable, "Outbox republication not configured"}
	kinds[CodeOutboxRepublishFailed] = problemKind{http.StatusServiceUnavailable, "Republished outbox record not acknowledged"}
	kinds[CodeOutboxRecordTooLarge] = problemKind{http.StatusUnprocessableEntity, "Outbox record too large to republish"}
}

func (s *Server) registerAdminOutbox() {
	s.mux.HandleFunc("GET "+outboxCollectionPattern+"/parked", s.handleListParkedOutbox)
	s.mux.HandleFunc("GET "+outboxCollectionPattern+"/{id}", s.handleGetOutboxRow)
	s.mux.HandleFunc("POST "+outboxCollectionPattern+"/{id}/republish", s.handleRepublishOutboxRow)
	s.mux.HandleFunc("POST "+outboxCollectionPattern+"/{id}/discard", s.handleDiscardOutboxRow)
}

// outboxErr maps the errors of package outbox and of cdc.Republish to
// problems.
func outboxErr(err error) error {
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		return &Error{Code: CodeOutboxRowNotFound, Detail: "no outbox row with this id", Err: err}
	case errors.Is(err, outbox.ErrNotParked):
		return &Error{Code: CodeOutboxRowNotParked,
			Detail: "the row is not parked (published, or still the relay's to publish): there is nothing to decide", Err: err}
	case errors.Is(err, outbox.ErrDecided):
		return &Error{Code: CodeOutboxRowAlreadyDecided, Detail: clip(err.Error(), 300) + "; a parked row is decided once", Err: err}
	case errors.Is(err, outbox.ErrReasonRequired):
		return &Error{Code: CodeOutboxReasonRequired, Detail: `the JSON body needs a non-empty "reason" (recorded on the row with who decides)`, Err: err}
	case errors.Is(err, cdc.ErrRepublishFailed) && errors.Is(err, kerr.MessageTooLarge):
		return &Error{Code: CodeOutboxRecordTooLarge,
			Detail: "the record is over converge's 1 MiB producer limit (the relay's and the workers'), so it cannot be republished; the attempt is recorded on the row, which stays parked: discard it", Err: err}
	case errors.Is(err, cdc.ErrRepublishFailed):
		return &Error{Code: CodeOutboxRepublishFailed,
			Detail: "the broker did not acknowledge the republished record; the attempt is recorded on the row (last_error_code), which stays parked and undecided: ask again", Err: err}
	}
	return err
}

// outboxID returns the {id} path value, or answers 404 OUTBOX_ROW_NOT_FOUND
// for one no row can have (empty, over 255 bytes, not UTF-8, a NUL byte:
// PostgreSQL text refuses the last two) without asking the database.
func (s *Server) outboxID(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("id")
	if id == "" || len(id) > maximumOutboxIDBytes || !utf8.ValidString(id) || strings.IndexByte(id, 0) >= 0 {
		s.writeError(w, r, newError(CodeOutboxRowNotFound, "no outbox row with id %q", clip(strings.ToValidUTF8(id, "?"), 40)))
		return "", false
	}
	return id, true
}

// handleListParkedOutbox is GET /v1/admin/outbox/parked[?code=&all=&limit=]:
// {"outbox_rows": [...]} oldest park first (outbox.ListParked): the rows
// no one decided on, with all=true also the decided ones; code keeps one
// last_error_code; limit in [1, 1000], default 100.
func (s *Server) handleListParkedOutbox(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := outbox.ParkedFilter{Code: q.Get("code"), Limit: defaultOutboxListLimit}
	switch a := q.Get("all"); a {
	case "", "false":
	case "true":
		f.All = true
	default:
		s.writeError(w, r, newError(CodeInvalidAdminRequest, "all must be true or false, not %q", clip(a, 40)))
		return
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maximumOutboxListLimit {
			s.writeError(w, r, newError(CodeInvalidAdminRequest, "limit must be an integer in [1, %d]", maximumOutboxListLimit))
			return
		}
		f.Limit = n
	}
	rows, err := outbox.ListParked(r.Context(), s.cfg.Pool, f)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if rows == nil {
		rows = []outbox.Stored{}
	}
	s.writeAdminJSON(w, r, http.StatusOK, map[string]any{"outbox_rows": rows})
}

// handleGetOutboxRow is GET /v1/admin/outbox/{id}: the row in any state
// (outbox.Stored: the payload as its size and SHA-256).
func (s *Server) handleGetOutboxRow(w http.ResponseWriter, r *http.Request) {
	id, ok := s.outboxID(w, r)
	if !ok {
		return
	}
	row, err := outbox.Get(r.Context(), s.cfg.Pool, id)
	if err != nil {
		s.writeError(w, r, outboxErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, row)
}

// handleRepublishOutboxRow is POST /v1/admin/outbox/{id}/republish with
// {"reason": "..."}: cdc.Republish produces the parked row's original
// record (same key, value, headers, event id) with Config.OutboxProducer
// to Config.Topic and, on the broker's acknowledgement, records the
// decision republished (published_at, decided_by "tenant:<name>" of the
// admin credential, decided_at, decision_reason); 200 with the row. A
// refusal is recorded on the row, which stays parked: 422
// OUTBOX_RECORD_TOO_LARGE or 503 OUTBOX_REPUBLISH_FAILED. It runs apart
// from the client's connection (a client that goes away does not cut the
// produce from its recording), bounded by outboxRepublishTimeout.
func (s *Server) handleRepublishOutboxRow(w http.ResponseWriter, r *http.Request) {
	s.handleOutboxDecision(w, r, outbox.DecisionRepublished)
}

// handleDiscardOutboxRow is POST /v1/admin/outbox/{id}/discard with
// {"reason": "..."}: the parked row is decided discarded (never
// published; who, when and why recorded as for a republish); 200 with the
// row. It needs no Kafka brokers.
func (s *Server) handleDiscardOutboxRow(w http.ResponseWriter, r *http.Request) {
	s.handleOutboxDecision(w, r, outbox.DecisionDiscarded)
}

// handleOutboxDecision reads and checks the id and the body of a republish
// or discard request, then decides.
func (s *Server) handleOutboxDecision(w http.ResponseWriter, r *http.Request, decision string) {
	id, ok := s.outboxID(w, r)
	if !ok {
		return
	}
	reason, ok := s.readReason(w, r)
	if !ok {
		return
	}
	if strings.TrimSpace(reason) == "" {
		s.writeError(w, r, outboxErr(outbox.ErrReasonRequired))
		return
	}
	by := actor(r)
	var err error
	switch decision {
	case outbox.DecisionRepublished:
		if s.cfg.OutboxProducer == nil {
			s.writeError(w, r, newError(CodeOutboxRepublishUnavailable,
				"this API instance has no Kafka brokers configured (CONVERGE_KAFKA_BROKERS), so it cannot republish; listing, showing and discarding work"))
			return
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), outboxRepublishTimeout)
		err = cdc.Republish(ctx, s.cfg.OutboxProducer, s.cfg.Pool, s.cfg.Topic, id, by, reason)
		cancel()
	default:
		err = outbox.Decide(r.Context(), s.cfg.Pool, id, decision, by, reason)
	}
	if err != nil {
		s.writeError(w, r, outboxErr(err))
		return
	}
	s.log.InfoContext(r.Context(), "parked outbox row decided", slog.String("outbox_id", id), slog.String("decision", decision),
		slog.String("by", by), slog.String("reason", clip(reason, 200)))
	row, err := outbox.Get(r.Context(), s.cfg.Pool, id)
	if err != nil {
		s.writeError(w, r, outboxErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, row)
}
