// Package api is converge's HTTP API (schemas/openapi.yaml describes it):
// clients submit JSON documents for conversion under an Idempotency-Key and
// read task state and artifacts.
//
// Routes (net/http ServeMux method patterns):
//
//	POST /v1/tasks                 create a task (202) or replay the key's first response
//	GET  /v1/tasks/{id}            task state, cache-aside over the Redis task view
//	GET  /v1/tasks/{id}/artifact   the verified artifact of a completed task
//	GET  /healthz                  process alive (200)
//	GET  /readyz                   200 when PostgreSQL answers within 1s (body lists "redis" under "degraded" when Redis does not); 503 otherwise
//	GET  /metrics                  Prometheus metrics of Config.Gatherer
//
// The admin plane (AdminHandler, admin tenants only) serves
// /v1/admin/dead-letters (list, show, replay, resolve: package deadletter),
// /v1/admin/tenants, and the parked outbox rows (seed 4.1, issue 13):
//
//	GET  /v1/admin/outbox/parked[?code=&all=&limit=]   parked rows, oldest park first (outbox.ListParked)
//	GET  /v1/admin/outbox/{id}                         one outbox row in any state (outbox.Get)
//	POST /v1/admin/outbox/{id}/republish {"reason"}    cdc.Republish with Config.OutboxProducer (503 without it)
//	POST /v1/admin/outbox/{id}/discard   {"reason"}    outbox.Decide discarded
//
// A decision records who as "tenant:<name>" of the credential, never a
// member of the body; a blank reason is 422. The routines are those of
// `converge dlq` and `converge outbox`: the handlers only read the request
// and map the packages' errors to problem codes (deadLetterErr, outboxErr).
//
// # Idempotency (seed section 3)
//
// Every /v1/ request carries "Authorization: Bearer <token>", a credential
// of a tenant (internal/tenant): without a valid one it is 401
// UNAUTHENTICATED; admin routes (/v1/admin/) need an admin tenant's (403
// FORBIDDEN). A tenant sees only its own tasks and artifacts: another
// tenant's task is 404 TASK_NOT_FOUND, as if it did not exist.
//
// A create request is identified by its Idempotency-Key within its
// tenant's scope (tenant.CreateScope; the same key in two tenants is two
// intents) and described by its fingerprint: the
// SHA-256 of the RFC 8785 form of {"operation":"create-document-task",
// "input_sha256":..., "output_format":..., "policy_version":1}, where
// input_sha256 is the SHA-256 of the document's canonical form. So two
// byte-different encodings of the same JSON value are the same request, and
// no timestamp or trace id enters the fingerprint.
//
// One PostgreSQL transaction inserts the idempotency record first, ON
// CONFLICT DO NOTHING, already complete — succeeded, with the task id and
// the replayable 202 response, both chosen before the transaction (the body
// holds no timestamp) — then the task (queued, version 0), its input (the
// document's RFC 8785 form, whose SHA-256 is input_sha256) and the
// TaskCreated outbox row; the record's foreign key to the task is checked
// at COMMIT (migration 00016). No other
// session sees the record before the transaction commits, so seed 3.1's
// in_progress state lasts exactly as long as the transaction: a concurrent
// request with the same key waits on the primary key meanwhile. The
// record's primary key, never a prior SELECT, decides between concurrent
// first uses: the loser's transaction writes nothing and reads the winner's
// committed record. Outcomes for a key already recorded:
//
//   - different fingerprint: 422 IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST;
//   - same fingerprint, succeeded: the stored status and body again (byte
//     for byte: bodies are stored and served in canonical form) with
//     Idempotent-Replayed: true;
//   - same fingerprint, no stored response yet: 409
//     IDEMPOTENCY_REQUEST_IN_PROGRESS with Retry-After: 1.
//
// Group commit (issue 11; coalesce.go): requests that reach the create
// transaction while CreateTransactions (2) such transactions are running
// queue up, and the next transaction takes up to CreateBatchMax (32) of
// them: each request's statements as above (but the TaskCreated outbox
// rows, inserted by one statement for the group), one BEGIN and one COMMIT
// for all, records inserted in (scope, key) order. Each request still gets the
// outcome it would have had alone: a key recorded before, or used twice in
// the group, is the loser's case above, answered after the group's
// transaction ended; any other failure (a quota with nothing left, a
// guard, a lost connection, a deadline) rolls the whole group back and
// every request of it runs in its own transaction, under its own context.
// A group transaction waits at most 500 ms for a lock (lock_timeout: an
// uncommitted record of a member's key, a tenant's quota row) and at most
// half the time left to its most pressed member, so that no request waits
// for what only another needs and each still has time to run alone. For
// one second after a request found its tenant's quota exhausted, that
// tenant's requests run alone. A lone request runs alone.
//
// A create transaction whose COMMIT was sent but whose answer was lost (a
// broken connection, a deadline) may have committed: it is settled by
// reading, on a connection of the pool, the idempotency record of a request
// that inserted a task; the transaction committed exactly when the record
// names that task. The read ends at the request's deadline (for a group,
// its earliest member's) or, when that has passed or is nearer, one second
// after it starts, and at most five seconds after it starts; it ends at
// once when the client has left (for a group, every member's). A settled group answers each
// request as committed; a settled single request answers 202 with its
// task. A record that is absent
// or names another request's task, or a read that fails or does not see the
// commit yet, counts as not committed: the group's requests run alone, and
// a single request fails as a database error does (503
// DATABASE_UNAVAILABLE, or 499 when its client has left); a retry with the
// same key answers from the record.
//
// Records are kept IdempotencyTTL (expires_at); a record is honoured until
// it is deleted, so expiry must only be acted on by a retention job that
// also checks the task is terminal and its outbox published (seed 3.3).
//
// # Input validation
//
// The body is {"document": <any JSON value>, "output_format": "jcs"}
// (output_format optional), at most MaxBodyBytes. The envelope is parsed
// permissively so that problems inside the document are reported by
// canon.Transform with their precise I-JSON codes. No input causes a 5xx:
// every rejection is a 4xx problem and writes nothing.
//
// # Errors
//
// Every error is an RFC 9457 application/problem+json document {"type":
// "https://converge.dev/problems/<code-lower-kebab>", "title", "status",
// "detail", "code"} (plus extension members such as task_status), produced
// by one function (problemFor) mapping errors to status codes. A database
// that cannot be reached is 503 DATABASE_UNAVAILABLE with Retry-After; a
// panic is 500 INTERNAL (a defect).
//
// # Cache-aside read (seed section 9)
//
// GET /v1/tasks/{id} returns the Redis view when present (Cache-Status:
// converge; hit, RFC 9211), else reads PostgreSQL and back-fills the view
// with its version compare-and-set, which never replaces a newer view
// (Cache-Status: converge; fwd=miss; stored, or without "; stored" when a
// newer view won). A Redis failure never fails the read (Cache-Status:
// converge; fwd=miss; detail=error). A view may be stale by design: its
// version (also the ETag) tells the client how new it is. The cache never
// decides a write.
//
// # Artifacts
//
// GET /v1/tasks/{id}/artifact serves a completed task's artifact, located
// by the task's latest verified artifact.put effect, only after hashing the
// stored bytes and finding task.artifact_sha256: unverified bytes are never
// served (503 ARTIFACT_UNAVAILABLE instead). An artifact the reconciler's
// task retention deleted (an artifact.delete effect is recorded for it,
// ledger.ArtifactDeleted, read only when the store does not find the
// object) is 410 ARTIFACT_EXPIRED; once the task's rows are removed too,
// the task and its artifact are 404 TASK_NOT_FOUND.
//
// # Fault points
//
// fault.APIAfterCommitResponseLost: after the create transaction committed,
// the handler aborts the connection instead of answering (seed 13.1); a
// retry with the same key gets the first response.
//
// fault.APICreateGroupAbort: a group create transaction fails after its
// records were inserted, before COMMIT: nothing is committed and each of
// its requests runs alone.
//
// # Metrics
//
//	converge_api_requests_total{route,method,code}        counter    requests answered; route is the mux pattern's path
//	                                                                 ("unmatched" otherwise), code the status or "aborted"
//	converge_api_request_duration_seconds{route,method}   histogram  request latency in seconds
//	converge_api_idempotency_total{outcome}               counter    created|replayed|key_reused|in_progress|quota_exhausted
//	converge_api_create_batch_size                        histogram  create requests per committed group transaction;
//	                                                                 1 for each request run alone
//	converge_api_create_group_aborts_total                counter    group transactions rolled back (their requests
//	                                                                 then ran alone)
//	converge_cache_requests_total{result}                 counter    task view lookups: hit|miss|error
//	converge_cache_stale_writes_rejected_total            counter    back-fills refused by the version CAS
//	                                                                 (registered by package taskview)
package api
