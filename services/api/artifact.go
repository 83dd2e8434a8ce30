package api

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/taskevent"
)

// handleGetArtifact is GET /v1/tasks/{id}/artifact. Only a completed task
// has an artifact; it is located through the task's latest verified
// artifact.put effect (seed 7) and served only when the stored bytes hash
// to task.artifact_sha256: the bytes are hashed before the first byte is
// sent, so unverified bytes are never served.
//
// Answers: 200 with Content-Type application/json, Content-Length, ETag
// "<sha256 hex>", Repr-Digest sha-256=:<base64>: (RFC 9530) and
// X-Artifact-Sha256 <hex>; 404 TASK_NOT_FOUND; 409 ARTIFACT_NOT_READY
// (queued, running, compensating; member task_status); 409 TASK_FAILED
// (failed, compensated; members task_status and terminal_error_code); 410
// ARTIFACT_EXPIRED when retention deleted the artifact (an artifact.delete
// effect is recorded for it; the task's rows are removed next, and then the
// answer is 404 TASK_NOT_FOUND); 503 ARTIFACT_UNAVAILABLE when the verified
// object is missing or does not match.
func (s *Server) handleGetArtifact(w http.ResponseWriter, r *http.Request) {
	id := taskIDOf(r)
	if !validTaskID(id) {
		s.writeError(w, r, notFound(id))
		return
	}
	ctx := r.Context()
	t, err := s.store.task(ctx, id)
	if errors.Is(err, errTaskNotFound) || (err == nil && !canRead(principal(r), t.TenantID)) {
		err = notFound(id) // another tenant's task: no oracle
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	switch t.Status {
	case taskevent.StatusCompleted:
	case taskevent.StatusCancelled:
		s.writeError(w, r, &Error{Code: CodeTaskCancelled, Detail: fmt.Sprintf("task %s was cancelled before it ran and has no artifact", id),
			Extensions: map[string]any{"task_status": t.Status}})
		return
	case taskevent.StatusFailed, taskevent.StatusCompensated:
		code := ""
		if t.TerminalErrorCode != nil {
			code = *t.TerminalErrorCode
		}
		s.writeError(w, r, &Error{Code: CodeTaskFailed, Detail: fmt.Sprintf("task %s is %s (%s) and has no artifact", id, t.Status, code),
			Extensions: map[string]any{"task_status": t.Status, "terminal_error_code": code}})
		return
	default:
		s.writeError(w, r, &Error{Code: CodeArtifactNotReady, Detail: fmt.Sprintf("task %s is %s; the artifact exists once it is completed", id, t.Status),
			Extensions: map[string]any{"task_status": t.Status}})
		return
	}
	if s.cfg.ArtifactStore == nil || t.ArtifactSHA256 == nil {
		s.writeError(w, r, newError(CodeArtifactUnavailable, "no artifact store is configured"))
		return
	}
	want := *t.ArtifactSHA256
	token, err := s.store.verifiedArtifactToken(ctx, id)
	if errors.Is(err, ledger.ErrNoVerifiedArtifact) {
		err = &Error{Code: CodeArtifactUnavailable, Detail: "the completed task has no verified artifact", Err: err}
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	f, meta, err := s.cfg.ArtifactStore.Open(token)
	if errors.Is(err, artifact.ErrNotFound) {
		// Only on this failure path: a task past the retention window whose
		// artifact was deleted is 410, not a store fault.
		if deleted, derr := s.store.artifactDeleted(ctx, token); derr == nil && deleted {
			s.writeError(w, r, &Error{Code: CodeArtifactExpired, Err: err,
				Detail: fmt.Sprintf("task %s is past the retention window; its artifact was deleted and the task is being removed", id)})
			return
		}
	}
	if err != nil {
		s.writeError(w, r, &Error{Code: CodeArtifactUnavailable, Detail: "the artifact could not be read from the store", Err: err})
		return
	}
	defer f.Close()
	if meta.SHA256 != want {
		s.writeError(w, r, &Error{Code: CodeArtifactUnavailable, Detail: "the stored artifact does not match the task",
			Err: fmt.Errorf("artifact %s: meta sha256 %s, task says %s", token, meta.SHA256, want)})
		return
	}
	sum, size, err := hashFrom(f)
	if err == nil && (sum != want || (t.ArtifactSize != nil && size != *t.ArtifactSize)) {
		err = fmt.Errorf("artifact %s: stored bytes sha256 %s size %d, task says %s", token, sum, size, want)
	}
	if err != nil {
		s.writeError(w, r, &Error{Code: CodeArtifactUnavailable, Detail: "the stored artifact does not match the task", Err: err})
		return
	}
	raw, _ := hex.DecodeString(sum)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.FormatInt(size, 10))
	h.Set("ETag", `"`+sum+`"`)
	h.Set("Repr-Digest", "sha-256=:"+base64.StdEncoding.EncodeToString(raw)+":")
	h.Set("X-Artifact-Sha256", sum)
	h.Set("Cache-Control", "no-cache") // a compensation may hide it later
	if etagMatches(r.Header.Get("If-None-Match"), `"`+sum+`"`) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	if n, err := io.Copy(w, f); err != nil || n != size {
		s.log.WarnContext(ctx, "artifact stream interrupted", slog.String("task_id", id), slog.Int64("sent", n), slog.Any("error", err))
	}
}

// hashFrom hashes f from the start and rewinds it.
func hashFrom(f io.ReadSeeker) (string, int64, error) {
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("read artifact: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", 0, fmt.Errorf("rewind artifact: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}
