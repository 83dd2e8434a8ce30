// Package taskview is converge's Redis task view (seed section 9; DESIGN
// "projections"): a derived, possibly stale read model of each task, and
// the Projector that keeps it up to date from the task-events topic.
//
// # The view
//
// One Redis hash per task under "task-view:v1:<task_id>" (Key) with fields
// "v" (the task version) and "json" (the JSON of taskevent.Task, which
// carries the version too). The "v1" namespace is the view's serialization
// version: a new serialization gets a new prefix, so old values are never
// read by new code (seed 9.2).
//
// Invariants:
//
//   - Every write is Cache.Put, a single Lua script that stores the snapshot
//     only if the incoming version is strictly greater than the stored one.
//     So events may arrive in any order, more than once, and concurrently
//     with API back-fills: the view only moves forward in version. Versions
//     are below 2^53 (a CHECK constraint on task.version), so Lua's doubles
//     compare them exactly.
//   - Every stored view has a TTL (24h by default) plus up to 10% random
//     jitter so views do not expire together; expiry and eviction are normal
//     (seed 9.3) and readers fall back to PostgreSQL.
//   - The view never decides a write: PostgreSQL is the only source of truth.
//     A writer that changes a task outside the event stream commits first
//     and then calls Cache.Invalidate (DEL). After a DEL a late, older event
//     can store an older snapshot again until a newer event or the TTL
//     replaces it; readers that need certainty read PostgreSQL.
//
// # The projector
//
// Projector is a consumer group (default "converge-projector") on the
// task-events topic. For every record of any event type it decodes the event
// (taskevent.Decode, plus the payload-sha256 header check when present) and
// calls Cache.Put(event.Task). Offsets are committed manually: after the
// Redis writes of each polled batch, with rebalances blocked while a batch is
// in hand (kgo.BlockRebalanceOnPoll), and again in OnPartitionsRevoked and
// before leaving the group. Only offsets of records whose write finished are
// committed, so a record is never skipped; a crash projects some records
// again, which the version compare-and-set makes harmless (at-least-once
// delivery, idempotent writes).
//
// Records that cannot be decoded are counted, logged and committed past:
// one poison record never blocks the view. When Redis is unavailable the
// write is retried with exponential backoff capped at MaxRetryBackoff until
// it succeeds or Run's context ends; nothing past the failing record is
// committed meanwhile. A long outage can exceed the group's rebalance
// timeout; the member is then evicted and its uncommitted records are
// projected again by whichever member takes the partition.
//
// # Metrics
//
//	converge_projector_events_total{outcome}         counter  events handled; outcome=stored|stale|invalid
//	converge_projector_redis_errors_total            counter  failed view writes (each retried)
//	converge_cache_stale_writes_rejected_total       counter  Cache.Put calls refused by the version CAS
//	                                                          (projector and API back-fill alike)
//
// The API's cache-aside read exports converge_cache_requests_total{result}
// (see package services/api).
package taskview
