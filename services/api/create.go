package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// PolicyVersion is the conversion policy version that enters every request
// fingerprint; bump it when the same input would be converted differently.
const PolicyVersion = 1

// fingerprintOperation names the operation in the fingerprint (seed 3).
const fingerprintOperation = "create-document-task"

// Fingerprint returns the request fingerprint of a create request (seed
// section 3): the lowercase hex SHA-256 of the RFC 8785 form of
// {"input_sha256":...,"operation":"create-document-task","output_format":...,
// "policy_version":PolicyVersion}. It depends only on the canonical document
// (through inputSHA256), never on timestamps, trace ids or the request's
// byte encoding. The canonical text is written directly (members in RFC 8785
// order, strings quoted by jsontext.AppendQuote, which uses RFC 8785's
// minimal escaping); TestFingerprintIsCanonical checks it against
// canon.Transform.
func Fingerprint(inputSHA256, outputFormat string) string {
	var buf [256]byte
	b := append(buf[:0], `{"input_sha256":`...)
	b, _ = jsontext.AppendQuote(b, inputSHA256)
	b = append(b, `,"operation":"`+fingerprintOperation+`","output_format":`...)
	b, _ = jsontext.AppendQuote(b, outputFormat)
	b = append(b, `,"policy_version":`...)
	b = strconv.AppendInt(b, PolicyVersion, 10)
	b = append(b, '}')
	return canon.SHA256Hex(b)
}

// links are the hypermedia links of a task resource.
type links struct {
	Self     string `json:"self"`
	Artifact string `json:"artifact"`
}

func taskLinks(id string) links {
	return links{Self: taskPath(id), Artifact: taskPath(id) + "/artifact"}
}

func taskPath(id string) string { return idempotency.TaskPath(id) }

// handleCreate is POST /v1/tasks (seed sections 3 and 4): validate, then in
// one transaction write the idempotency record, the task, its input and the
// TaskCreated outbox row; or replay the first response of the key.
func (s *Server) handleCreate(w http.ResponseWriter, r *http.Request) {
	if err := checkContentType(r.Header); err != nil {
		s.rejectUnread(w, r, err)
		return
	}
	key, err := parseIdempotencyKey(r.Header)
	if err != nil {
		s.rejectUnread(w, r, err)
		return
	}
	if r.ContentLength > s.cfg.MaxBodyBytes {
		s.rejectUnread(w, r, &http.MaxBytesError{Limit: s.cfg.MaxBodyBytes})
		return
	}
	reserve := r.ContentLength
	if reserve < 0 {
		reserve = s.cfg.MaxBodyBytes // chunked: it may grow to the limit
	}
	release, ok := s.limits.reserveBody(principal(r).TenantID, reserve)
	if !ok {
		s.rejectUnread(w, r, newError(CodeOverloaded, "the server (or this tenant's share of it) is reading as many request bodies as it holds at once; retry"))
		return
	}
	defer release()
	// RequestTimeout bounds reading the body too: a body still arriving at
	// the request's deadline is cut there (its read deadline moved to now,
	// never later than the server's ReadTimeout) and answered 408, not a
	// later 503 of statements that would have no time left.
	rc := http.NewResponseController(w)
	stop := context.AfterFunc(r.Context(), func() { _ = rc.SetReadDeadline(time.Now()) })
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	stop()
	if err == nil && errors.Is(r.Context().Err(), context.DeadlineExceeded) {
		err = os.ErrDeadlineExceeded // the body came, but after the deadline
	}
	if err != nil {
		var me *http.MaxBytesError
		switch {
		case errors.As(err, &me):
		case isTimeout(err):
			err = newError(CodeRequestTimeout, "the request body was not received within the server's read timeout or the request's timeout")
		default:
			err = canonError(canon.CodeMalformedJSON, "request body could not be read: "+err.Error(), -1)
		}
		s.writeError(w, r, err)
		return
	}
	req, err := parseCreateRequest(body)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	canonical, err := canon.Transform(req.Document)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	inputSHA := canon.SHA256Hex(canonical)
	p := principal(r)
	k := idempotency.Key{Scope: tenant.CreateScope(p.TenantID), Key: key, Fingerprint: Fingerprint(inputSHA, req.OutputFormat),
		TTL: s.cfg.IdempotencyTTL, Lease: s.cfg.IdempotencyLease}
	draft, err := newTaskDraft(p.TenantID, req, canonical, inputSHA)
	if err != nil {
		s.writeError(w, r, err)
		return
	}

	// One request per key waits on the database at a time (keyflight.go).
	var (
		fl     *flight
		leader bool
	)
	for {
		if fl, leader = s.flights.begin(k.Scope, key); leader {
			break
		}
		select {
		case <-fl.done:
		case <-r.Context().Done():
			s.writeError(w, r, fmt.Errorf("create task: waiting for a request with the same key: %w", r.Context().Err()))
			return
		}
		if fl.outcome == flightHeld {
			s.metrics.idempotency.WithLabelValues(idemInProg).Inc()
			s.writeError(w, r, &Error{Code: CodeIdempotencyInProgress, Detail: errKeyHeldDetail, Err: errKeyTaken})
			return
		}
		if fl.outcome == flightFailed {
			s.writeError(w, r, fl.err) // what this request would meet now: no second wait
			return
		}
		if fl.outcome == flightSettled {
			break // the key is recorded: this request finds it without waiting
		}
		// The leader ended without an outcome (its own deadline, its client
		// leaving, an exhausted quota): the next one leads.
	}
	outcome := flightOpen
	if leader {
		defer func() { s.flights.end(k.Scope, key, fl, outcome) }()
	}
	fail := func(err error) {
		if leader && outcome == flightOpen && r.Context().Err() == nil {
			// Failed for a reason of the database, not of this request's
			// own end (its deadline, its client leaving): the followers
			// answer the same at once instead of waiting again in turn.
			outcome, fl.err = flightFailed, err
		}
		s.writeError(w, r, err)
	}

	// At most a few rounds: a record that vanished between our conflicting
	// insert and our read (deleted by retention) lets the next insert win.
	for range 3 {
		n, err := s.store.createTask(r.Context(), k, p, draft)
		if err == nil {
			outcome = flightSettled
			s.metrics.idempotency.WithLabelValues(idemCreated).Inc()
			s.log.InfoContext(r.Context(), "task created", slog.String("task_id", n.Task.TaskID), slog.String("idempotency_key", key))
			if s.cfg.Faults.Hit(fault.APIAfterCommitResponseLost) != fault.ActionNone {
				panic(http.ErrAbortHandler) // the client sees a dropped connection
			}
			writeCreated(w, n.Task.TaskID, http.StatusAccepted, n.Response, false)
			return
		}
		if errors.Is(err, tenant.ErrQuotaExhausted) {
			s.metrics.idempotency.WithLabelValues(idemQuota).Inc()
			s.writeError(w, r, newError(CodeQuotaExhausted, "tenant %s has no task left in its quota", p.Name))
			return
		}
		if ae := (*Error)(nil); errors.As(err, &ae) && ae.Code == CodeIdempotencyInProgress {
			outcome = flightHeld
			s.metrics.idempotency.WithLabelValues(idemInProg).Inc()
		}
		if !errors.Is(err, errKeyTaken) {
			fail(err)
			return
		}
		rec, err := s.store.idempotencyRecord(r.Context(), k.Scope, key)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			fail(err)
			return
		}
		outcome = flightSettled
		s.answerExisting(w, r, k.Fingerprint, rec)
		return
	}
	s.writeError(w, r, &Error{Code: CodeIdempotencyInProgress, Detail: "the idempotency record of this key is changing; retry", Err: errKeyTaken})
}

// taskDraft is a task about to be created. Its ids and its 202 body are
// chosen before the create transaction, whose first statement inserts the
// idempotency record complete with them (migration 00016); its rows are
// built once the transaction's timestamp is known (build). A draft may be
// used by several attempts of one request: nothing of a failed attempt was
// written.
type taskDraft struct {
	TaskID, OutboxID string
	Response         []byte // canonical JSON of the 202 body
	tenantID         string
	req              *createRequest
	document         []byte // the document's RFC 8785 form, stored as the task's input
	inputSHA         string
	inputSize        int64
	// build returns the task's rows created at now; rows unless a test
	// replaces it.
	build func(now time.Time) (*newTask, error)
}

// newTaskDraft chooses the ids (UUIDv7) and the 202 body of a new task of
// tenantID for req, whose document's RFC 8785 form is canonical, with
// SHA-256 inputSHA.
func newTaskDraft(tenantID string, req *createRequest, canonical []byte, inputSHA string) (*taskDraft, error) {
	taskID, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("task id: %w", err)
	}
	outboxID, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("outbox id: %w", err)
	}
	d := &taskDraft{TaskID: taskID.String(), OutboxID: outboxID.String(), tenantID: tenantID, req: req, document: canonical, inputSHA: inputSHA, inputSize: int64(len(canonical))}
	d.Response = idempotency.CreatedResponse(d.snapshot(time.Time{}))
	d.build = d.rows
	return d, nil
}

// snapshot is the task's queued v0 snapshot created at now.
func (d *taskDraft) snapshot(now time.Time) taskevent.Task {
	return taskevent.Task{
		TaskID: d.TaskID, TenantID: d.tenantID, Status: taskevent.StatusQueued, Version: 0, Attempt: 0,
		OutputFormat: d.req.OutputFormat, InputSHA256: d.inputSHA, InputSize: d.inputSize,
		CreatedAt: now, UpdatedAt: now,
	}
}

// rows returns the rows of the task created at now (the creating
// transaction's timestamp): the queued v0 snapshot and the TaskCreated
// event in canonical form, with the draft's 202 body.
func (d *taskDraft) rows(now time.Time) (*newTask, error) {
	t := d.snapshot(now)
	ev := &taskevent.Event{
		EventID: d.OutboxID, EventType: taskevent.TypeTaskCreated, SchemaVersion: taskevent.SchemaVersion,
		TaskID: t.TaskID, TaskVersion: t.Version, OccurredAt: now, Task: t,
	}
	payload, payloadSHA, err := taskevent.Encode(ev)
	if err != nil {
		return nil, err
	}
	return &newTask{Task: t, Document: d.document, OutboxID: ev.EventID, Payload: payload, PayloadSHA256: payloadSHA, Response: d.Response}, nil
}

// answerExisting answers a request whose key is already recorded (seed
// 3.1): a different fingerprint is 422 IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST;
// the same fingerprint replays the stored response, or is 409 in progress
// while no response is stored.
func (s *Server) answerExisting(w http.ResponseWriter, r *http.Request, fingerprint string, rec *idempotency.Record) {
	status, body, outcome, err := storedAnswer(rec, fingerprint,
		"this Idempotency-Key was first used with a different request; use a new key for a new task")
	s.metrics.idempotency.WithLabelValues(outcome).Inc()
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeCreated(w, *rec.TaskID, status, body, true)
}

// storedAnswer is the answer to a request whose idempotency key is
// recorded (seed 3.1), for creates and cancels alike: another fingerprint
// is 422 IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST (with reusedDetail);
// no stored response yet is 409 IDEMPOTENCY_REQUEST_IN_PROGRESS; else the
// stored status and body in canonical form (jsonb does not keep the bytes;
// RFC 8785 restores the ones first sent). outcome is the
// converge_api_idempotency_total label of the answer.
func storedAnswer(rec *idempotency.Record, fingerprint, reusedDetail string) (status int, body []byte, outcome string, err error) {
	if rec.Fingerprint != fingerprint {
		return 0, nil, idemKeyReused, newError(CodeIdempotencyKeyReused, "%s", reusedDetail)
	}
	if rec.State != idempotency.Succeeded || rec.ResponseStatus == nil || rec.ResponseBody == nil || rec.TaskID == nil {
		return 0, nil, idemInProg, newError(CodeIdempotencyInProgress, "the first request with this Idempotency-Key is still in progress; retry later with the same key")
	}
	body, err = canon.Transform(rec.ResponseBody)
	if err != nil {
		return 0, nil, idemReplayed, fmt.Errorf("stored response of task %s: %w", *rec.TaskID, err)
	}
	return *rec.ResponseStatus, body, idemReplayed, nil
}

func writeCreated(w http.ResponseWriter, taskID string, status int, body []byte, replayed bool) {
	h := w.Header()
	h.Set("Location", taskPath(taskID))
	h.Set("Cache-Control", "no-store")
	if replayed {
		h.Set("Idempotent-Replayed", strconv.FormatBool(true))
	}
	writeJSON(w, status, body)
}
