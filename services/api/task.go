package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	"github.com/google/uuid"

	"github.com/converge-run/converge/internal/ident"
	"github.com/converge-run/converge/internal/taskevent"
)

// validTaskID reports whether id has the syntax of ids looked up,
// ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$; anything else is 404 without a query
// (task ids are UUIDs; this also admits other plain ids).
func validTaskID(id string) bool { return ident.Valid(id, 1, 128, true) }

// cacheStatusName is this cache's name in Cache-Status (RFC 9211).
const cacheStatusName = "converge"

// taskResource is the body of GET /v1/tasks/{id}: the task snapshot (with
// its version) plus links.
type taskResource struct {
	taskevent.Task
	Links links `json:"links"`
}

// taskIDOf returns the task id of a request path: a UUID in any letter case
// is the task id in its canonical lower-case form (RFC 9562: UUIDs are
// case-insensitive on input; converge writes them lower case).
func taskIDOf(r *http.Request) string {
	id := r.PathValue("id")
	if len(id) == 36 {
		if u, err := uuid.Parse(id); err == nil {
			return u.String()
		}
	}
	return id
}

func notFound(id string) error {
	return newError(CodeTaskNotFound, "no task with id %q", clip(id, 128))
}

// handleGetTask is GET /v1/tasks/{id}, a cache-aside read (seed 9): a view
// in Redis is returned as is (Cache-Status: converge; hit); otherwise the
// task is read from PostgreSQL and back-filled with the version
// compare-and-set (Cache-Status: converge; fwd=miss[; stored]). A Redis
// failure never fails the read (Cache-Status: converge; fwd=miss;
// detail=error). ETag is the quoted version.
func (s *Server) handleGetTask(w http.ResponseWriter, r *http.Request) {
	id := taskIDOf(r)
	if !validTaskID(id) {
		s.writeError(w, r, notFound(id))
		return
	}
	ctx := r.Context()
	var (
		t           *taskevent.Task
		cacheStatus string
		cacheFailed bool
	)
	if s.cache != nil {
		cctx, cancel := context.WithTimeout(ctx, s.cfg.CacheTimeout)
		view, ok, err := s.cache.Get(cctx, id)
		cancel()
		switch {
		case err != nil:
			cacheFailed = true
			s.metrics.cache.WithLabelValues("error").Inc()
			s.log.WarnContext(ctx, "task view read failed; reading PostgreSQL", slog.String("task_id", id), slog.Any("error", err))
		case ok:
			s.metrics.cache.WithLabelValues("hit").Inc()
			t, cacheStatus = view, cacheStatusName+"; hit"
		default:
			s.metrics.cache.WithLabelValues("miss").Inc()
		}
	}
	if t == nil {
		var err error
		t, err = s.store.task(ctx, id)
		if errors.Is(err, errTaskNotFound) {
			err = notFound(id)
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if s.cache != nil {
			cacheStatus = cacheStatusName + "; fwd=miss"
			if cacheFailed {
				cacheStatus += "; detail=error"
			} else if stored, err := s.putView(ctx, *t); err != nil {
				cacheStatus += "; detail=error"
				s.log.WarnContext(ctx, "task view back-fill failed", slog.String("task_id", id), slog.Any("error", err))
			} else if stored {
				cacheStatus += "; stored"
			}
		}
	}
	if !canRead(principal(r), t.TenantID) {
		s.writeError(w, r, notFound(id)) // another tenant's task: no oracle
		return
	}
	body, err := json.Marshal(taskResource{Task: *t, Links: taskLinks(t.TaskID)})
	if err != nil {
		s.writeError(w, r, fmt.Errorf("encode task %s: %w", id, err))
		return
	}
	h := w.Header()
	if cacheStatus != "" {
		h.Set("Cache-Status", cacheStatus)
	}
	etag := `"` + strconv.FormatInt(t.Version, 10) + `"`
	h.Set("ETag", etag)
	h.Set("Cache-Control", "no-cache")
	if etagMatches(r.Header.Get("If-None-Match"), etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	writeJSON(w, http.StatusOK, body)
}

// etagMatches implements If-None-Match's weak comparison (RFC 9110 section
// 13.1.2) for a strong etag.
func etagMatches(header, etag string) bool {
	if header == "" {
		return false
	}
	for _, c := range strings.Split(header, ",") {
		c = strings.TrimSpace(c)
		if c == "*" || strings.TrimPrefix(c, "W/") == etag {
			return true
		}
	}
	return false
}

// putView back-fills the task view within CacheTimeout.
func (s *Server) putView(ctx context.Context, t taskevent.Task) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CacheTimeout)
	defer cancel()
	return s.cache.Put(ctx, t)
}
