package api

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"

	jsonv2 "github.com/go-json-experiment/json"

	"github.com/converge-run/converge/consumers/deadletter"
)

// Problem codes of the admin endpoints.
const (
	CodeDeadLetterNotFound      = "DEAD_LETTER_NOT_FOUND"
	CodeDeadLettersUnavailable  = "DEAD_LETTERS_UNAVAILABLE"
	CodeReplayReasonRequired    = "REPLAY_REASON_REQUIRED"
	CodeInvalidAdminRequest     = "INVALID_ADMIN_REQUEST"
	CodeReplayPublishFailed     = "REPLAY_PUBLISH_FAILED"
	maxAdminBodyBytes           = 64 << 10
	defaultDeadLetterListLimit  = 100
	maximumDeadLetterListLimit  = 1000
	deadLetterCollectionPattern = "/v1/admin/dead-letters"
)

func init() {
	kinds[CodeDeadLetterNotFound] = problemKind{http.StatusNotFound, "Dead letter not found"}
	kinds[CodeDeadLettersUnavailable] = problemKind{http.StatusServiceUnavailable, "Dead-letter administration not configured"}
	kinds[CodeReplayReasonRequired] = problemKind{http.StatusUnprocessableEntity, "A replay needs a reason"}
	kinds[CodeInvalidAdminRequest] = problemKind{http.StatusBadRequest, "Invalid admin request"}
	kinds[CodeReplayPublishFailed] = problemKind{http.StatusServiceUnavailable, "Replay could not be published"}
}

func (s *Server) registerAdmin() {
	s.mux.HandleFunc("GET "+deadLetterCollectionPattern, s.handleListDeadLetters)
	s.mux.HandleFunc("GET "+deadLetterCollectionPattern+"/{id}", s.handleGetDeadLetter)
	s.mux.HandleFunc("POST "+deadLetterCollectionPattern+"/{id}/replay", s.handleReplayDeadLetter)
	s.mux.HandleFunc("POST "+deadLetterCollectionPattern+"/{id}/resolve", s.handleResolveDeadLetter)
}

// deadLetterErr maps the deadletter package's errors to problems.
func deadLetterErr(err error) error {
	switch {
	case errors.Is(err, deadletter.ErrNotFound):
		return &Error{Code: CodeDeadLetterNotFound, Detail: "no dead letter with this id", Err: err}
	case errors.Is(err, deadletter.ErrReasonRequired):
		return &Error{Code: CodeReplayReasonRequired, Detail: `the JSON body needs a non-empty "reason" (recorded with the request)`, Err: err}
	case errors.Is(err, deadletter.ErrNoProducer):
		return &Error{Code: CodeDeadLettersUnavailable,
			Detail: "this API instance has no Kafka brokers configured (CONVERGE_KAFKA_BROKERS), so it cannot re-publish; listing and showing work", Err: err}
	case errors.Is(err, deadletter.ErrPublish):
		return &Error{Code: CodeReplayPublishFailed,
			Detail: "the broker did not acknowledge the re-published record; nothing was changed, ask again", Err: err}
	}
	return err
}

func (s *Server) deadLetters(w http.ResponseWriter, r *http.Request) *deadletter.Service {
	if s.cfg.DeadLetters == nil {
		s.writeError(w, r, newError(CodeDeadLettersUnavailable, "this API instance has no dead-letter service configured"))
	}
	return s.cfg.DeadLetters
}

// handleListDeadLetters is GET /v1/admin/dead-letters[?code=&state=&task_id=&limit=]:
// {"dead_letters": [...]} oldest first.
func (s *Server) handleListDeadLetters(w http.ResponseWriter, r *http.Request) {
	svc := s.deadLetters(w, r)
	if svc == nil {
		return
	}
	q := r.URL.Query()
	f := deadletter.Filter{Code: q.Get("code"), TaskID: q.Get("task_id"), Limit: defaultDeadLetterListLimit}
	if st := q.Get("state"); st != "" {
		f.States = strings.Split(st, ",")
		for _, v := range f.States {
			switch v {
			case deadletter.StateParked, deadletter.StateReplayed, deadletter.StateResolved, deadletter.StateRefused:
			default:
				s.writeError(w, r, newError(CodeInvalidAdminRequest, "state %q is not one of parked, replayed, resolved, refused", clip(v, 40)))
				return
			}
		}
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maximumDeadLetterListLimit {
			s.writeError(w, r, newError(CodeInvalidAdminRequest, "limit must be an integer in [1, %d]", maximumDeadLetterListLimit))
			return
		}
		f.Limit = n
	}
	list, err := svc.List(r.Context(), f)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, map[string]any{"dead_letters": list})
}

func parseID(w http.ResponseWriter, r *http.Request, s *Server) (int64, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		s.writeError(w, r, newError(CodeDeadLetterNotFound, "no dead letter with id %q", clip(r.PathValue("id"), 40)))
		return 0, false
	}
	return id, true
}

// handleGetDeadLetter is GET /v1/admin/dead-letters/{id}.
func (s *Server) handleGetDeadLetter(w http.ResponseWriter, r *http.Request) {
	svc := s.deadLetters(w, r)
	if svc == nil {
		return
	}
	id, ok := parseID(w, r, s)
	if !ok {
		return
	}
	d, err := svc.Get(r.Context(), id)
	if err != nil {
		s.writeError(w, r, deadLetterErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, d)
}

// handleReplayDeadLetter is POST /v1/admin/dead-letters/{id}/replay with
// {"reason": "..."} (who replays is the authenticated admin tenant,
// recorded as "tenant:<name>"): 200 with the deadletter.Result (outcome
// replayed, noop or refused).
func (s *Server) handleReplayDeadLetter(w http.ResponseWriter, r *http.Request) {
	s.handleDeadLetterRequest(w, r, (*deadletter.Service).Replay)
}

// handleResolveDeadLetter is POST /v1/admin/dead-letters/{id}/resolve with
// {"reason": "..."} (who: as for a replay): the dead letter is marked resolved
// without publishing anything (who, when and why recorded); 200 with the
// deadletter.Result (outcome resolved, or noop when it already was). It
// needs no Kafka brokers.
func (s *Server) handleResolveDeadLetter(w http.ResponseWriter, r *http.Request) {
	s.handleDeadLetterRequest(w, r, (*deadletter.Service).Resolve)
}

// handleDeadLetterRequest reads and checks the id and the body of a replay
// or resolve request, then calls do.
func (s *Server) handleDeadLetterRequest(w http.ResponseWriter, r *http.Request,
	do func(*deadletter.Service, context.Context, int64, deadletter.Request) (deadletter.Result, error)) {
	svc := s.deadLetters(w, r)
	if svc == nil {
		return
	}
	id, ok := parseID(w, r, s)
	if !ok {
		return
	}
	reason, ok := s.readReason(w, r)
	if !ok {
		return
	}
	res, err := do(svc, r.Context(), id, deadletter.Request{Reason: reason, By: actor(r)})
	if err != nil {
		s.writeError(w, r, deadLetterErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, res)
}

// actor is who an admin request is recorded as: "tenant:<name>" of the
// authenticated admin credential (never a member of the body).
func actor(r *http.Request) string { return "tenant:" + principal(r).Name }

// readReason reads the body of an admin decision (a dead-letter replay or
// resolve, an outbox republish or discard): Content-Type application/json,
// at most maxAdminBodyBytes, one JSON object {"reason": "..."} decoded
// strictly (the string member reason only, nothing after it). It answers
// the problem itself (415, 413, 400 INVALID_ADMIN_REQUEST) and returns
// false; a missing or blank reason is returned as "", for the caller to
// refuse with its own code.
func (s *Server) readReason(w http.ResponseWriter, r *http.Request) (string, bool) {
	if err := checkContentType(r.Header); err != nil {
		s.writeError(w, r, err)
		return "", false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBodyBytes))
	var me *http.MaxBytesError
	if errors.As(err, &me) {
		s.writeError(w, r, err)
		return "", false
	}
	if err != nil {
		s.writeError(w, r, newError(CodeInvalidAdminRequest, "body could not be read"))
		return "", false
	}
	var in struct {
		Reason string `json:"reason"`
	}
	if err := strictDecode(body, &in); err != nil {
		s.writeError(w, r, newError(CodeInvalidAdminRequest, `body must be one JSON object {"reason": "..."} (a string, no other member; who acts is the credential's tenant): %s`, clip(err.Error(), 120)))
		return "", false
	}
	return in.Reason, true
}

// strictDecode decodes one JSON object into v: member names exact (case
// sensitive), no unknown and no repeated member (RFC 8259 leaves repeats
// undefined; the last would win), nothing after it.
func strictDecode(body []byte, v any) error {
	return jsonv2.Unmarshal(body, v, jsonv2.RejectUnknownMembers(true))
}

func (s *Server) writeAdminJSON(w http.ResponseWriter, r *http.Request, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, status, body)
}
