// Package task owns the task aggregate's state machine and every statement
// that writes the task and task_input tables (seed 2.1, 2.2, 10). The worker,
// the reconciler, the dead-letter service and the API call it; nothing else
// writes a task.
//
// # Invariants
//
//   - Status moves only along queued -> running -> completed | failed,
//     queued -> cancelled for a client's version-guarded cancel
//     (CancelIfQueued; terminal), and failed -> queued for a dead-letter
//     replay (ReopenIfFailed); a
//     status CHECK constraint refuses anything else (compensating and
//     compensated are allowed by the schema, seed 2.1, and not entered by
//     this code).
//   - Every transition is a compare-and-set on status and version that
//     increments the version (StartIfQueued, CompleteIfRunning,
//     FailIfRunning, FailIfNotTerminal, CancelIfQueued, ReopenIfFailed): a change computed
//     from a stale read matches no row and applies nothing (Changed.Applied
//     is false), so two deliveries, or a delivery and a repair, never both
//     apply (DESIGN.md, River's rescuer bug). The snapshot a transition
//     returns is the one its outbox event carries (package outbox), written
//     in the same transaction (seed 4).
//   - A task is created at version 0, status queued, with its document
//     (task_input: its RFC 8785 form, whose SHA-256 is input_sha256; rows of
//     releases before 2026-12-07 hold the document as received, see
//     CanonicalInput) and its tenant (internal/tenant), in the API's create
//     transaction (QueueCreate).
//   - Versions stay below 2^53 (a CHECK constraint), so they survive JSON
//     and Lua doubles.
//   - A task is removed only by retention (issue 13, seed 3.3: Expired,
//     Hold, Delete): terminal, past the task window, once Hold finds
//     nothing that still needs it; the reconciler removes the rows of the
//     other aggregates through their owners first, in one transaction.
//   - A task not found may be one whose creating transaction is not visible
//     to this session yet (consumers/worker, ErrNotYetVisible).
//
// Functions named Queue* add their statement to a caller's pgx.Batch (one
// round trip for several statements); their results are read by the
// callbacks when the batch is closed.
package task
