// Package ledger owns the effect ledger (seed 7, 7.1, 8): the kinds,
// states and token formats of the side effects converge performs on the
// artifact store, every statement that writes effect_ledger, the read-back
// verification and the compensation protocol. The worker and the
// reconciler call it; the API reads the verified artifact's token from it.
//
// # Invariants
//
//   - An effect's ledger row is written (Plan, state started) before the
//     store is called; its identity is (kind, idempotency token), unique:
//     the token is also the row's effect_id, its primary key (a CHECK
//     since migration 00017; the tokens of different kinds never meet),
//     which the ledger's reads use, so a retry of the same attempt finds
//     the same row and the same token
//     (PutToken: "<task_id>.attempt-<n>"; CompensationToken:
//     "compensation-for-<effect_id>").
//   - A timeout is never "did not happen": the effect goes to unknown
//     (MarkUnknown) and is resolved by observing the same token — present
//     and matching (Verify) -> verified, present and not matching ->
//     compensation_required, absent -> planned — never by a new token.
//   - An artifact.put is verified only after its object was read back and
//     Verify held (task id, attempt, size, SHA-256). At most one
//     artifact.put per task is verified: the partial unique index
//     OneVerifiedIndex decides (OneVerifiedViolation).
//   - A compensation is a new effect with its own ledger row, not a
//     rollback (Compensate): observed first, hidden only when present,
//     verified by observing the object gone.
//   - Retention removes an artifact through the ledger too (DeleteArtifact):
//     an artifact.delete effect per artifact.put, token DeleteToken
//     ("delete-for-<effect_id>"), written before the store removes the
//     object (readable or hidden), verified by observing the store hold
//     nothing under the put's token; only then do the task's effects go
//     (DeleteOfTask), with the task.
//   - Every transition is a compare-and-set on the state read (MarkUnknown,
//     MarkPlanned, MarkVerified, RequireCompensation, MarkFailed,
//     MarkCompensated): a repair computed from a stale read changes nothing.
package ledger
