// Package tenant owns the tenant aggregate: the tenant, api_credential and
// quota tables (migration 00005) and the rules on them (issue 12; DESIGN.md
// "Data model"; seed sections 2.2 and 3).
//
// Invariants:
//   - A tenant is a client team with a unique name (NamePattern). Every
//     task created through the API belongs to one tenant (task.tenant_id);
//     a tenant sees only its own tasks and artifacts, and the idempotency
//     scope of its creates is its own (CreateScope): the same
//     Idempotency-Key in two tenants is two intents.
//   - An API credential is a random token (NewToken: 256 bits, 47 URL-safe
//     characters, prefix TokenPrefix) shown once; only its SHA-256 is
//     stored. Lookup finds a credential by that hash and compares it in
//     constant time (crypto/subtle). Tokens are never logged.
//   - A token authenticates while it is not revoked (Rotate revokes every
//     token of the tenant and issues one) and its tenant is not disabled
//     (Disable). An Authenticator may accept a token for at most its TTL
//     after either change.
//   - A tenant with a quota row can create at most remaining more tasks:
//     QueueConsumeQuota decrements it in the create transaction with a
//     conditional UPDATE whose failure aborts the transaction (no task, no
//     idempotency record, no outbox row); it runs only after the request's
//     idempotency record was inserted, so a replayed request consumes
//     nothing. A tenant without a quota row is unlimited.
//   - An admin tenant's credentials may use the admin endpoints and read
//     every task, including those created before tenants existed (which
//     have no tenant).
package tenant
