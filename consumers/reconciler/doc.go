// Package reconciler converges what the other components could not finish
// (seed sections 3.1, 7, 8, 9, 10, 13.5, 14; DESIGN.md
// "consumers/reconciler"): effects whose outcome nobody knows, compensations
// that timed out, inbox rows left processing, tasks that stopped making
// progress, idempotency records left in progress, unpublished outbox rows
// and stale Redis views; and it records dead letters.
//
// It writes no table itself: each aggregate's rules — compare-and-set
// transitions, tokens, read-back verification, the compensation protocol —
// are stated once by its owner (internal/ledger, internal/inbox,
// internal/task, internal/outbox, services/api/idempotency); this package
// decides when to apply them.
//
// # Effects
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
// A task has at most one verified artifact.put effect: a partial unique
// index (migration 00003) decides. An effect found matching while another
// effect of its task is already verified (an earlier attempt resolved late,
// after a dead-letter replay) is "superseded": it becomes
// compensation_required with error code ARTIFACT_SUPERSEDED and its object
// is hidden in the same pass, as below. (The worker resumes a task's
// unfinished effect with its own attempt and token, so this is the
// constraint's last line of defence, not the common path.)
//
// An effect in compensation_required past the deadline is compensated
// (ledger.Compensate, seed 8): its own artifact.hide ledger entry, the store
// observed first — a hide that timed out after it happened
// (fault.ArtifactHideTimeoutAfterCommit) is found done and recorded verified
// without hiding again ("compensation_observed") — then the effect becomes
// compensated.
//
// # Other scans (each bounded by BatchSize per pass)
//
//   - Inbox: rows processing with no delivery for InboxLease whose task is
//     terminal are finished (-> completed, result {"released_by":
//     "reconciler"}); rows of non-terminal tasks are left to the task scan
//     (and not read: they would fill the batch); rows whose message has no
//     outbox row any more (removed before the delivery registered it, as a
//     late replay does; its task may still be live, and a redelivery is
//     made safe by the ledger) are removed ("inbox_purged").
//   - Tasks: queued or running without an update for TaskDeadline are
//     re-driven by a TaskRedriveRequested outbox event for their current
//     version, written in a transaction that re-checks status and version;
//     the outbox's unique (task, version, type) allows one re-drive per
//     task version, so nothing is re-driven forever. The worker handles it
//     like TaskCreated; its inbox and the ledger make the second drive safe.
//   - Idempotency: records in_progress past locked_until are resolved from
//     the task state, never assuming the first execution did not happen:
//     with a task -> succeeded with the task's first 202 response; without
//     one (the API writes both in one transaction) the record is deleted so
//     that a retry with the same key creates the task.
//   - Outbox: rows unpublished for longer than OutboxThreshold are counted
//     (gauges below) and logged. The relay publishes; only with a Producer
//     does a pass republish the rows unpublished, and not parked, past
//     RepublishAfter — the rows the slot will not deliver
//     (cdc.RepublishUnpublished, "outbox_republished") — never a parked
//     row, which waits for a person's decision.
//   - Task views (with Redis): a cursor on task id walks the task table,
//     BatchSize tasks per pass; a view whose version is below the
//     database's is replaced by the database snapshot (taskview.Cache.Put,
//     whose Lua compare-and-set never regresses a view). Absent views stay
//     absent.
//   - Retention (issue 13, seed 3.3): idempotency records past expires_at
//     whose task is settled (idempotency.Purge); outbox rows published, or
//     parked and decided, past OutboxRetention, with their inbox rows of
//     every consumer, in one transaction, except a row one of whose inbox
//     rows is processing (kept with it until the inbox scan releases it,
//     and left out of the next batches of the pass); terminal
//     tasks last updated more than TaskRetention ago (task.Expired: a
//     cursor on (updated_at, task_id) walks past the tasks kept). A task is
//     kept while task.Hold names a reason (an idempotency record names it,
//     an event unpublished, a dead letter parked or refused, an effect not
//     settled) or an inbox row of its events (or of its dead letters'
//     messages) is processing. Otherwise its
//     artifacts are deleted first, each under its own artifact.delete
//     ledger entry (ledger.DeleteArtifacts: ledger row, store DeleteMany,
//     observe gone, verified; a crash between two steps is resumed with the
//     same token, fault points retention.after-delete-planned and
//     retention.after-artifact-delete), then one transaction removes, in
//     the project's lock order, its resolved and replayed dead letters,
//     inbox rows, effects, outbox rows, input and the task, after checking
//     Hold again under the locks; then its Redis view is removed (a
//     failure counts as an error; the view then expires with its TTL).
//     Tasks go a batch of BatchSize at a time (the batch's ledger writes,
//     the store's fsyncs and the removal transaction shared), batch after
//     batch while they come back full, for up to RetentionBudget per pass;
//     the keys and outbox rows above too. Several reconcilers share the
//     walk: each claims its batch's tasks with session advisory locks
//     (claimTasks, never waited for) and passes over the ones claimed
//     elsewhere.
//   - Dead letters: parked or refused dead letters whose task has
//     completed since (by another route) are resolved — nothing is left to
//     replay (deadletter.Store.ResolveCompleted, "dead_letter_resolved") —
//     and converge_deadletter_unresolved is refreshed.
//
// # Dead-letter intake
//
// With Brokers, Run also consumes DeadLetterTopic (group DeadLetterGroup,
// default converge-reconciler-dlq) into the dead_letter table
// (deadletter.FromRecord, Store.Insert: ON CONFLICT DO NOTHING on the
// origin topic/partition/offset), committing a poll's offsets only after all
// its inserts succeeded (a failed insert is retried with backoff).
//
// # Invariants
//
//   - Every repair is a compare-and-set on the state (and version) the pass
//     read: a repair computed from a stale read can never undo newer
//     progress (the rescuer bug DESIGN.md warns about). A lost
//     compare-and-set is counted as "skipped" and nothing is written.
//   - Work per pass is bounded: each scan reads at most BatchSize rows,
//     oldest first.
//   - The reconciler never writes to the store except to hide an object
//     whose effect is compensation_required and to delete the objects of a
//     task removed by retention (each under its own ledger entry), and
//     moves a task only through
//     the worker (a re-drive event): on the redelivery of the task's
//     record the worker finds the repaired ledger row (verified: completes;
//     planned: writes with the same token; compensation_required or
//     compensated: fails the task).
//
// # Metrics
//
//	converge_reconciler_actions_total{kind}          counter   actions, by kind: verified, planned, compensation_required, superseded, compensated, compensation_observed, skipped (lost compare-and-set), error, inbox_released, task_redriven, idempotency_resolved, cache_repaired, dead_letter_recorded, dead_letter_resolved, outbox_republished, idempotency_expired, outbox_purged, inbox_purged, artifact_deleted, task_purged
//	converge_reconciler_passes_total{result}         counter   passes, by result: ok, error (a scan failed)
//	converge_reconciler_pass_seconds                 histogram duration of one pass
//	converge_deadletter_unresolved                   gauge     dead letters in state parked or refused (they need a person)
//	converge_outbox_unpublished_rows                 gauge     outbox rows unpublished for longer than OutboxThreshold
//	converge_outbox_oldest_unpublished_age_seconds   gauge     age of the oldest unpublished outbox row (0 when none; parked rows excluded)
//	converge_outbox_parked_rows                      gauge     parked outbox rows not yet republished or discarded
//	converge_reconciler_expired_tasks                gauge     terminal tasks past TaskRetention still present after the pass (kept, or not reached yet), up to 10001
package reconciler
