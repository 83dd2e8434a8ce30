// Package inbox owns the consumers' inbox (seed 6, 13.4): every statement
// that writes inbox_message and inbox_conflict. The worker registers and
// finishes deliveries, the reconciler releases rows left processing, the
// dead-letter service re-opens a failed one for a replay.
//
// # Invariants
//
//   - A message is identified by (consumer_name, message_id), message_id
//     being the event id (= outbox id). Register inserts it Processing; the
//     primary key, not a prior read, decides which delivery registered it.
//   - A registered message with the same payload hash is a redelivery:
//     Completed or Failed is a duplicate; Processing is resumed (the effect
//     ledger makes the effect safe to resume) once its lease allows: a
//     delivery that registers or resumes a message leases it (locked_by,
//     locked_until: Lease, Acquire), and another instance's live lease
//     makes a redelivery wait (ErrLeaseHeld) instead of processing
//     concurrently (seed 6). A lease outlives its holder's attempt, so a
//     takeover after expiry never overlaps a live attempt of the holder. With another payload hash
//     it is a conflict: recorded once per hash in inbox_conflict and never
//     processed.
//   - A row leaves Processing only by a compare-and-set (Finish, Release),
//     in the transaction that makes the delivery's outcome durable; the
//     consumer's offset is committed only after that transaction.
//   - Every transaction that touches a message locks rows in the order
//     inbox, task, effect, outbox (Lock first), so concurrent deliveries and
//     replays never deadlock.
//   - Rows are removed only when not Processing (DeleteMessages): with
//     their outbox rows past the outbox window, or with their task past the
//     task window (issue 13 retention; the reconciler decides when). A
//     Processing row is removed only when stale and of a message that
//     has no outbox row, or no task, any more (DeleteStale).
package inbox
