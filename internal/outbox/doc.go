// Package outbox owns the transactional outbox (seed 4): the only code that
// inserts outbox_event rows, builds their payloads, and marks them
// published. The API, the worker, the reconciler and the dead-letter service
// insert through it, in the transaction of the change each event describes;
// the relay (package cdc) marks through it.
//
// # Invariants
//
//   - An event is written in the same transaction as the task change it
//     describes (Insert, InsertOnce, QueueInsert): both commit or neither
//     does. The outbox id is a new UUIDv7 and is the event id consumers
//     deduplicate on; (task, version, event type) is unique.
//   - The payload is the canonical JSON (RFC 8785) of the event, stored as
//     text with its SHA-256 (taskevent.Encode): the relay publishes these
//     bytes as they are.
//   - published_at is set only after the broker acknowledged the event
//     (MarkPublished); a republication after a restart leaves it as it is.
//     publish_attempts counts the attempts that set it.
//   - A row MarkPublished does not find is not proof that it is gone: its
//     transaction may be committed and streamed but not visible yet
//     (Classify, visibility.go). Only a row absent although its
//     transaction is visible to the same statement's snapshot is gone.
//   - Backlog.Unpublished reports the backlog (rows unpublished past a
//     threshold) from a created_xid watermark, with no index on
//     published_at (so MarkPublished is a HOT update, migration 00008); the
//     reconciler logs and exports it.
//   - A row the relay cannot publish is parked (Park: parked_at, attempts,
//     last error code and text) and settled for the relay; a retryable
//     failure is counted on the row (RecordFailure). An operator decides on
//     a parked row once (Decide: republished or discarded, by, reason).
//   - Rows are removed only when published, or parked and decided (issue
//     13 retention): past the outbox window (Backlog.Purgeable,
//     DeletePurgeable), or with their task past the task window
//     (DeleteOfTask). An unpublished or undecided row is never removed.
package outbox
