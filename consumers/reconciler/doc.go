// Package reconciler converges what the worker could not finish: effects of
// the effect ledger whose outcome nobody knows any more (seed sections 7, 8,
// 10, 14; DESIGN.md "consumers/reconciler").
//
// An effect stays started or unknown when the worker crashed or timed out
// between writing the ledger row and recording the outcome. After
// EffectDeadline without an update, a pass observes the artifact store under
// the effect's own idempotency token (never a new one) and records what it
// sees:
//
//	present, matches task id, attempt, size, request SHA-256  -> verified (observed_result_sha256)
//	present, does not match                                   -> compensation_required (ARTIFACT_VERIFICATION_FAILED)
//	absent                                                    -> planned: not executed, safe to retry with the same token
//
// An effect in compensation_required past the deadline is compensated (seed
// 8): a ledger row of kind artifact.hide with token
// "compensation-for-<effect_id>" is written first, the store hides the
// object, the hide is verified by observing the token gone, and the effect
// becomes compensated.
//
// # Invariants
//
//   - Every repair is a compare-and-set on the state the pass read (WHERE
//     effect_id = $1 AND state = $old): a repair computed from a stale read
//     can never undo newer progress (the rescuer bug DESIGN.md warns about).
//     A lost compare-and-set is counted as "skipped" and nothing is written.
//   - Work per pass is bounded: each scan reads at most BatchSize effects,
//     oldest first.
//   - The reconciler never writes to the store except to hide an object
//     whose effect is compensation_required, and never moves a task: the
//     worker, on the redelivery of the task's record, finds the repaired
//     ledger row (verified: completes; planned: writes with the same token;
//     compensation_required/compensated: fails the task).
//
// # Metrics
//
//	converge_reconciler_actions_total{kind}   counter   effects handled, by action: verified, planned, compensation_required, compensated, skipped (lost compare-and-set), error
//	converge_reconciler_passes_total{result}  counter   passes, by result: ok, error (a scan query failed)
//	converge_reconciler_pass_seconds          histogram duration of one pass
package reconciler
