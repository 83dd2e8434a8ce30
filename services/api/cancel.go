package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/jackc/pgx/v5"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

// cancelOperation names the operation in a cancel's fingerprint and scope.
const cancelOperation = "cancel-task"

// cancelScope is the idempotency scope of tenantID's cancels.
func cancelScope(tenantID string) string { return "tenant:" + tenantID + ":" + cancelOperation }

// cancelFingerprint is the SHA-256 of the RFC 8785 form of
// {"operation":"cancel-task","task_id":...,"version":...}: a key reused for
// another task or version is another request.
func cancelFingerprint(taskID string, version int64) string {
	b := append([]byte(nil), `{"operation":"`+cancelOperation+`","task_id":`...)
	b, _ = jsontext.AppendQuote(b, taskID)
	b = append(b, `,"version":`...)
	b = strconv.AppendInt(b, version, 10)
	b = append(b, '}')
	return canon.SHA256Hex(b)
}

// ifMatchRE is an entity tag exactly as ETag writes a version: a decimal
// without sign or leading zeros, below 2^53, in quotes.
var ifMatchRE = regexp.MustCompile(`^"(0|[1-9][0-9]{0,15})"$`)

// parseIfMatch reads If-Match: one strong entity tag whose value is a
// task version ("3"), as GET /v1/tasks/{id} sends in ETag.
func parseIfMatch(h http.Header) (int64, error) {
	vs := h.Values("If-Match")
	if len(vs) == 0 {
		return 0, newError(CodePreconditionRequired, `a cancel needs If-Match: "<version>" (the ETag of GET /v1/tasks/{id}), so that it applies only to the version the client saw`)
	}
	v := strings.TrimSpace(strings.Join(vs, ","))
	if !ifMatchRE.MatchString(v) {
		return 0, newError(CodeIfMatchInvalid, `If-Match must be one strong entity tag holding a task version, like "3"`)
	}
	n, err := strconv.ParseInt(v[1:len(v)-1], 10, 64)
	if err != nil {
		return 0, newError(CodeIfMatchInvalid, `If-Match must be one strong entity tag holding a task version, like "3"`)
	}
	return n, nil
}

// handleCancel is POST /v1/tasks/{id}/cancel with If-Match: "<version>" and
// an Idempotency-Key (the seed's opening: a cancel must be decided by the
// database on the version the client saw, never by a cached status). In one
// transaction: the idempotency record (scope tenant:<id>:cancel-task), the
// task locked, then
//
//   - another tenant's or an unknown task: 404 TASK_NOT_FOUND;
//   - a version other than If-Match's: 412 VERSION_MISMATCH with
//     current_version (and ETag);
//   - not queued (running, or terminal): 409 TASK_NOT_CANCELLABLE with
//     task_status;
//   - queued at that version: cancelled by task.CancelIfQueued (`WHERE
//     status = 'queued' AND version = $v`), a TaskCancelled outbox event, and
//     200 with the task, stored in the record.
//
// A refused cancel writes nothing (its record is rolled back too, so the
// key may be used again). Repeating a successful cancel with the same key
// replays the stored 200 (Idempotent-Replayed: true); the same key with
// another task or version is 422 IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST.
func (s *Server) handleCancel(w http.ResponseWriter, r *http.Request) {
	id := taskIDOf(r)
	if !validTaskID(id) {
		s.writeError(w, r, notFound(id))
		return
	}
	key, err := parseIdempotencyKey(r.Header)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	version, err := parseIfMatch(r.Header)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	p := principal(r)
	k := idempotency.Key{Scope: cancelScope(p.TenantID), Key: key, Fingerprint: cancelFingerprint(id, version),
		TTL: s.cfg.IdempotencyTTL, Lease: s.cfg.IdempotencyLease}
	ctx := r.Context()
	var body []byte
	err = pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		var err error
		body, err = s.cancelInTx(ctx, tx, k, p, id, version)
		return err
	})
	if errors.Is(err, errKeyTaken) {
		rec, rerr := idempotency.Get(ctx, s.cfg.Pool, k.Scope, key)
		if rerr != nil {
			s.writeError(w, r, rerr)
			return
		}
		s.replayCancel(w, r, k.Fingerprint, rec)
		return
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.InfoContext(ctx, "task cancelled", slog.String("task_id", id), slog.Int64("version", version), slog.String("tenant", p.Name))
	w.Header().Set("ETag", `"`+strconv.FormatInt(version+1, 10)+`"`)
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, http.StatusOK, body)
}

// cancelInTx is the cancel transaction's work (see handleCancel); it
// returns the 200 body, or an *Error that rolls everything back.
func (s *Server) cancelInTx(ctx context.Context, tx pgx.Tx, k idempotency.Key, p tenant.Principal, id string, version int64) ([]byte, error) {
	b := &pgx.Batch{}
	var created time.Time
	idempotency.QueueBegin(b, k, &created)
	if err := tx.SendBatch(ctx, b).Close(); errors.Is(err, pgx.ErrNoRows) {
		return nil, errKeyTaken
	} else if err != nil {
		return nil, fmt.Errorf("insert idempotency record: %w", err)
	}
	t, found, err := task.Lock(ctx, tx, id)
	if err != nil {
		return nil, err
	}
	if !found || t.TenantID == "" || t.TenantID != p.TenantID {
		// Only the owning tenant cancels (an admin reads every task but
		// changes none): another tenant's task is not found.
		return nil, notFound(id)
	}
	if t.Version != version {
		return nil, &Error{Code: CodeVersionMismatch, Detail: fmt.Sprintf("task %s is at version %d, not %d; read it again and decide on what it is now", id, t.Version, version),
			Extensions: map[string]any{"current_version": t.Version, "task_status": t.Status}}
	}
	if t.Status != taskevent.StatusQueued {
		return nil, &Error{Code: CodeTaskNotCancellable, Detail: fmt.Sprintf("task %s is %s: only a queued task can be cancelled", id, t.Status),
			Extensions: map[string]any{"task_status": t.Status, "current_version": t.Version}}
	}
	c, err := task.CancelIfQueued(ctx, tx, id, version)
	if err != nil {
		return nil, err
	}
	if !c.Applied { // the row is locked: cannot happen
		return nil, fmt.Errorf("cancel task %s: the locked row changed", id)
	}
	if _, err := outbox.Insert(ctx, tx, taskevent.TypeTaskCancelled, c.Task); err != nil {
		return nil, err
	}
	raw, err := json.Marshal(taskResource{Task: c.Task, Links: taskLinks(id)})
	if err != nil {
		return nil, err
	}
	body, err := canon.Transform(raw) // the form a replay gives back from the stored jsonb
	if err != nil {
		return nil, err
	}
	b = &pgx.Batch{}
	idempotency.QueueCompleteWith(b, k, id, http.StatusOK, body)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("complete idempotency record: %w", err)
	}
	return body, nil
}

// replayCancel answers a cancel whose key is recorded (storedAnswer).
func (s *Server) replayCancel(w http.ResponseWriter, r *http.Request, fingerprint string, rec *idempotency.Record) {
	status, body, _, err := storedAnswer(rec, fingerprint,
		"this Idempotency-Key was first used for another cancel (another task or version); use a new key")
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.Header().Set("Idempotent-Replayed", "true")
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, status, body)
}
