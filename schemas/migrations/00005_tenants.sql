-- +goose Up
-- Tenants (issue 12; DESIGN.md "Data model": tenant, hashed API
-- credentials, quota). A tenant is a client team; its API credentials are
-- random tokens stored only as their SHA-256 (a slow password hash is not
-- needed for 256-bit random tokens); its quota is decremented in the create
-- transaction by a conditional UPDATE (seed 2.2), never read-then-write.
CREATE TABLE tenant (
  tenant_id   text PRIMARY KEY,
  name        text NOT NULL UNIQUE CHECK (name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
  is_admin    boolean NOT NULL DEFAULT false,
  disabled_at timestamptz,
  created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_credential (
  token_sha256 bytea PRIMARY KEY CHECK (length(token_sha256) = 32),
  tenant_id    text NOT NULL REFERENCES tenant (tenant_id),
  created_at   timestamptz NOT NULL DEFAULT now(),
  revoked_at   timestamptz
);

CREATE INDEX api_credential_active_idx ON api_credential (tenant_id) WHERE revoked_at IS NULL;

-- A tenant without a row here has no quota (unlimited).
CREATE TABLE quota (
  tenant_id text PRIMARY KEY REFERENCES tenant (tenant_id),
  remaining bigint NOT NULL CHECK (remaining >= 0)
);

-- The owner of a task; NULL for tasks created before tenants existed
-- (readable by admin credentials only).
ALTER TABLE task ADD COLUMN tenant_id text REFERENCES tenant (tenant_id);

-- +goose Down
ALTER TABLE task DROP COLUMN tenant_id;
DROP TABLE quota;
DROP TABLE api_credential;
DROP TABLE tenant;
