package api

import (
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/converge-run/converge/internal/tenant"
)

// Problem codes of the tenant admin endpoints.
const (
	CodeTenantNotFound = "TENANT_NOT_FOUND"
	CodeTenantExists   = "TENANT_EXISTS"
	CodeTenantDisabled = "TENANT_DISABLED"
)

func init() {
	kinds[CodeTenantNotFound] = problemKind{http.StatusNotFound, "Tenant not found"}
	kinds[CodeTenantExists] = problemKind{http.StatusConflict, "Tenant exists"}
	kinds[CodeTenantDisabled] = problemKind{http.StatusConflict, "Tenant disabled"}
}

func (s *Server) registerAdminTenants() {
	s.mux.HandleFunc("GET /v1/admin/tenants", s.handleListTenants)
	s.mux.HandleFunc("POST /v1/admin/tenants", s.handleAddTenant)
	s.mux.HandleFunc("POST /v1/admin/tenants/{name}/rotate", s.handleRotateTenant)
	s.mux.HandleFunc("POST /v1/admin/tenants/{name}/disable", s.handleDisableTenant)
}

// tenantView is a tenant as the admin endpoints show it (never a token).
type tenantView struct {
	Name        string     `json:"name"`
	ID          string     `json:"tenant_id"`
	Admin       bool       `json:"admin"`
	DisabledAt  *time.Time `json:"disabled_at"`
	CreatedAt   time.Time  `json:"created_at"`
	Remaining   *int64     `json:"quota_remaining"`
	Credentials int        `json:"active_tokens"`
}

func viewOf(t tenant.Tenant) tenantView {
	return tenantView{Name: t.Name, ID: t.ID, Admin: t.Admin, DisabledAt: t.DisabledAt, CreatedAt: t.CreatedAt, Remaining: t.Remaining, Credentials: t.Credentials}
}

func tenantErr(err error) error {
	switch {
	case errors.Is(err, tenant.ErrNotFound):
		return &Error{Code: CodeTenantNotFound, Detail: "no tenant of this name", Err: err}
	case errors.Is(err, tenant.ErrDisabled):
		return &Error{Code: CodeTenantDisabled, Detail: "the tenant is disabled: its tokens cannot be rotated (enable it first)", Err: err}
	case errors.Is(err, tenant.ErrNameTaken):
		return &Error{Code: CodeTenantExists, Detail: "a tenant of this name exists", Err: err}
	case errors.Is(err, tenant.ErrInvalidName):
		return &Error{Code: CodeInvalidAdminRequest, Detail: "a tenant name is 1-63 of a-z 0-9 _ -, starting with a letter or digit", Err: err}
	}
	return err
}

// handleListTenants is GET /v1/admin/tenants: {"tenants": [...]} by name.
func (s *Server) handleListTenants(w http.ResponseWriter, r *http.Request) {
	ts, err := tenant.List(r.Context(), s.cfg.Pool)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := make([]tenantView, 0, len(ts))
	for _, t := range ts {
		out = append(out, viewOf(t))
	}
	s.writeAdminJSON(w, r, http.StatusOK, map[string]any{"tenants": out})
}

// handleAddTenant is POST /v1/admin/tenants with {"name": "...", "quota":
// N (optional), "admin": bool (optional)}: 201 with the tenant and its
// first token ("token", shown only in this answer); 409 TENANT_EXISTS.
func (s *Server) handleAddTenant(w http.ResponseWriter, r *http.Request) {
	if err := checkContentType(r.Header); err != nil {
		s.writeError(w, r, err)
		return
	}
	var in struct {
		Name  string `json:"name"`
		Quota *int64 `json:"quota"`
		Admin bool   `json:"admin"`
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBodyBytes))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := strictDecode(body, &in); err != nil || (in.Quota != nil && *in.Quota < 0) {
		s.writeError(w, r, newError(CodeInvalidAdminRequest, `body must be one JSON object {"name": "...", "quota": N (optional, >= 0), "admin": false (optional)}`))
		return
	}
	t, tok, err := tenant.Add(r.Context(), s.cfg.Pool, in.Name, in.Admin, in.Quota)
	if err != nil {
		s.writeError(w, r, tenantErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusCreated, map[string]any{"tenant": viewOf(t), "token": tok})
}

// handleRotateTenant is POST /v1/admin/tenants/{name}/rotate: every token
// of the tenant revoked, 200 with the new one ("token", shown only here).
func (s *Server) handleRotateTenant(w http.ResponseWriter, r *http.Request) {
	tok, err := tenant.Rotate(r.Context(), s.cfg.Pool, r.PathValue("name"))
	if err != nil {
		s.writeError(w, r, tenantErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, map[string]any{"name": r.PathValue("name"), "token": tok})
}

// handleDisableTenant is POST /v1/admin/tenants/{name}/disable: 200 with
// the tenant; its tokens stop working (within the API's 2 s cache).
func (s *Server) handleDisableTenant(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := tenant.Disable(r.Context(), s.cfg.Pool, name); err != nil {
		s.writeError(w, r, tenantErr(err))
		return
	}
	t, err := tenant.Get(r.Context(), s.cfg.Pool, name)
	if err != nil {
		s.writeError(w, r, tenantErr(err))
		return
	}
	s.writeAdminJSON(w, r, http.StatusOK, viewOf(t))
}
