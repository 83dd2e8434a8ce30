package api

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/converge-run/converge/internal/tenant"
)

type principalKey struct{}

func withPrincipal(ctx context.Context, p tenant.Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// principal is the authenticated caller of a /v1/ request (set by
// ServeHTTP before any handler runs).
func principal(r *http.Request) tenant.Principal {
	p, _ := r.Context().Value(principalKey{}).(tenant.Principal)
	return p
}

// authenticate checks the request's bearer token (RFC 6750 section 2.1:
// "Authorization: Bearer <token>"): a missing, malformed, unknown, revoked
// or disabled token is 401 UNAUTHENTICATED (one answer for all, so it is no
// oracle); a valid token of a tenant that is not an admin on an admin route
// is 403 FORBIDDEN; a database that does not answer is 503. The token is
// never logged.
func (s *Server) authenticate(r *http.Request, admin bool) (tenant.Principal, error) {
	if len(r.Header.Values("Authorization")) > 1 {
		return tenant.Principal{}, newError(CodeUnauthenticated, "send one Authorization header")
	}
	h := r.Header.Get("Authorization")
	scheme, token, ok := strings.Cut(h, " ")
	if h == "" || !ok || !strings.EqualFold(scheme, "Bearer") {
		return tenant.Principal{}, newError(CodeUnauthenticated, "send Authorization: Bearer <token> with a converge API token")
	}
	p, err := s.cfg.Auth.Authenticate(r.Context(), strings.TrimSpace(token))
	if errors.Is(err, tenant.ErrUnauthenticated) {
		return tenant.Principal{}, newError(CodeUnauthenticated, "the API token is not valid (unknown, revoked, or its tenant is disabled)")
	}
	if err != nil {
		return tenant.Principal{}, err
	}
	if admin && !p.Admin {
		return tenant.Principal{}, newError(CodeForbidden, "this endpoint needs an admin credential")
	}
	return p, nil
}

// canRead reports whether p may read a task owned by tenantID (empty: a
// task created before tenants existed): its own tenant's, or any for an
// admin. Another tenant's task is answered as not found (no oracle).
func canRead(p tenant.Principal, tenantID string) bool {
	return p.Admin || (tenantID != "" && tenantID == p.TenantID)
}
