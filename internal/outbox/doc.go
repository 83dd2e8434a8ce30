// Package outbox owns the transactional outbox (seed 4): the only code that
// inserts outbox_event rows, builds their payloads, and records them
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
//   - A row is published only after the broker acknowledged its event:
//     either its transaction is recorded (RecordTransactions, the relay:
//     one row of outbox_published_transaction per transaction whose rows
//     the slot delivered and Kafka acknowledged, migration 00015) and the
//     row is not parked, or its own published_at is set (MarkPublished, a
//     republication by the reconciler or an operator; Decide). The SQL
//     function outbox_published_at(row) is that rule, for every reader;
//     outbox_publish_attempts(row) counts the failed attempts and the
//     successful one. A republication leaves a published row as it is.
//   - A row Park does not find is not proof that it is gone: its
//     transaction may be committed and streamed but not visible yet
//     (Classify, visibility.go). Only a row absent although its
//     transaction is visible to the same statement's snapshot is gone.
//   - Backlog.Unpublished reports the backlog (rows unpublished past a
//     threshold) from a created_xid watermark (migration 00008) and an
//     anti-join on the transaction records; the reconciler logs and
//     exports it.
//   - A row the relay cannot publish is parked (Park: parked_at, attempts,
//     last error code and text) and settled for the relay; a retryable
//     failure is counted on the row (RecordFailure). An operator decides on
//     a parked row once (Decide: republished or discarded, by, reason).
//   - Rows are removed only when published, or parked and decided (issue
//     13 retention): past the outbox window (Backlog.Purgeable,
//     DeletePurgeable), or with their task past the task window
//     (DeleteOfTasks), and a transaction's record with the last row of it.
//     An unpublished or undecided row is never removed.
package outbox
