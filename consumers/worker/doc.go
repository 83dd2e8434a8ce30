// Package worker is converge's task worker: a Kafka consumer group on the
// task-events topic that turns each TaskCreated event into a verified
// artifact — the RFC 8785 canonical form of the task's document — and moves
// the task to completed (or failed), with the next event written to the
// outbox in the same transaction (seed sections 6, 7, 7.1, 10, 12, 13.3).
//
// Delivery is at-least-once; the worker makes repeated deliveries harmless.
// It never claims more than that.
//
// # Per record
//
//  1. Records whose event-type header is neither TaskCreated nor
//     TaskRedriveRequested (the reconciler's re-drive of a stuck task, handled
//     like TaskCreated) are skipped: "ignored" (the worker's own
//     TaskCompleted/TaskFailed share the topic).
//  2. The record is checked against the contract of package taskevent:
//     SHA-256 of the value == payload-sha256 header, the value decodes,
//     event-id header == event_id, key == task_id. A failure is
//     deterministic (see below).
//  3. Intake transaction: inbox_message (consumer_name = Group, message_id
//     = event id, payload_sha256) is inserted as processing; the primary key
//     decides. Same id and another hash: an inbox_conflict row, nothing
//     processed ("conflict", seed 13.4). Same hash and completed/failed: a
//     duplicate, only deliveries is counted ("duplicate"). Same hash and
//     processing: an earlier delivery stopped mid-way and is resumed — once
//     its inbox lease allows (seed 6): the registering or resuming delivery
//     leases the row to this instance (Config.LeaseOwner, InboxLease ≥
//     AttemptTimeout); another instance's live lease makes the delivery
//     wait ("lease_held", inbox.ErrLeaseHeld; not counted against
//     MaxAttempts) until the holder finishes it or the lease expires, and a
//     record given up unfinished releases the lease. The
//     task moves queued -> running by a compare-and-set on status queued and
//     a version at least the event's (version+1, attempt+1; a task re-opened
//     by a dead-letter replay is queued at a higher version than its
//     TaskCreated and starts from its current version); a task already running is resumed at
//     its current attempt, a terminal one makes the delivery a duplicate. The
//     document is canonicalized and the effect's ledger row (kind
//     artifact.put, token artifact.Token(task, attempt), request SHA-256 and
//     size of the canonical bytes, state started) is written before the
//     store is called. When the task already has an artifact.put effect
//     that is verified, or whose outcome is not known (planned, started,
//     unknown, completed) — a task re-opened by a dead-letter replay after
//     its effect started — that effect is resumed with its own attempt and
//     token instead (seed 7: retry with the same token), so a replay never
//     writes a second artifact. A partial unique index (migration 00003)
//     allows one verified artifact.put per task; a completion that meets it
//     is retried and finds the verified effect.
//  4. Effect: a verified ledger row skips to completion. Otherwise the store
//     is observed by token first (Head): a present object is never written
//     again; an absent one is Put with the same token. A Put timeout sets the
//     effect to unknown and is resolved by observing the same token, never
//     by a new token (seed 7). The object is then read back in full and its
//     metadata (task id, attempt), size and SHA-256 compared with the
//     ledger's request (seed 7.1).
//  5. Completion transaction: effect -> verified (compare-and-set from the
//     state read), task running -> completed with the artifact's SHA-256 and
//     size (compare-and-set on version), inbox -> completed, and a
//     TaskCompleted outbox row (outbox_id a UUIDv7). A verification mismatch
//     instead fails the task with ARTIFACT_VERIFICATION_FAILED in one
//     transaction (effect -> compensation_required, task -> failed, inbox ->
//     failed, TaskFailed outbox row) and then compensates (seed 8): a ledger
//     row of kind artifact.hide with token "compensation-for-<effect_id>",
//     store Hide, Head must then report the object gone, hide effect ->
//     verified, original effect -> compensated. An unfinished compensation
//     stays compensation_required for the reconciler.
//
// # Offsets and order
//
// The worker is a handler of internal/consumergroup, which states the rules
// once: records of a partition in order, one goroutine per partition,
// offsets committed only after the transaction recording each record's
// outcome, revoke/loss/shutdown handling. On top of it the worker processes
// at most Concurrency records of all partitions at once.
//
// Runs of fresh records of a batch share one intake and one completion
// transaction (batch.go, MaxBatchRecords), and so do the runs of different
// partitions submitted while RunGroups groups are busy (groups.go); every
// record off the happy path goes through the per-record protocol below, in
// its partition's goroutine, which resumes it from its durable state.
//
// The aggregates' rules live with their owners: the inbox in
// internal/inbox, the task transitions in internal/task, the effect ledger
// (tokens, read-back verification, compensation) in internal/ledger, the
// outbox in internal/outbox. This package composes them into transactions.
//
// Round trips: the per-record intake transaction starts the task, reads
// the document and the live effect in one batch, and writes and reads the
// effect's ledger row in another. A run's intake registers the inbox rows
// and starts the tasks, reading their documents, in one batch, and inserts
// the effects' ledger rows, returning them, in another (first attempts
// only: batch.go). The completion transaction moves inbox, task and effect
// in one batch before the outbox insert.
//
// # Errors
//
// Commit visibility (issue 9): an event on the topic proves its transaction
// committed, not that this session sees it yet (PostgreSQL flushes the
// commit record, and the relay streams it, before the committing backend
// leaves the proc array; a synchronous standby that does not confirm widens
// the window at will). A task not found, or found at a version older than
// the event's, is therefore never taken as proof: the error wraps
// ErrNotYetVisible and the record is retried in place (backoff capped at 1s)
// until VisibilityTimeout has passed since the record was produced (or first
// failed), and only then dead-lettered (TASK_NOT_FOUND,
// TASK_VERSION_CONFLICT); the dead-letter transaction then leaves the task
// alone even when it sees it by then. A task that the start's
// compare-and-set did not find but the next statement finds queued at a
// version the start accepts became visible between the two: the start is
// made again in the same transaction, whose next statement sees it.
//
// Retryable decides, once, what happens to a failed attempt. Retryable
// errors (database unavailable, deadlines, store I/O, concurrent changes,
// injected faults) retry the same record in place with exponential backoff
// and jitter (RetryBackoffMin doubling up to RetryBackoffMax), at most
// MaxAttempts times, so partition order is preserved. A deterministic error
// (seed 13.5, a poison message), or the last retryable failure (code
// RETRIES_EXHAUSTED), dead-letters the record:
//
//  1. the record is produced to DeadLetterTopic (default <topic>.dlq) with
//     its original key, value and headers plus dlq-original-topic,
//     dlq-original-partition, dlq-original-offset, dlq-consumer-group,
//     dlq-error-class (deterministic|retryable), dlq-error-code,
//     dlq-error-message, dlq-attempts, dlq-processor-version,
//     dlq-first-failure-at, dlq-last-failure-at (RFC 3339); dlq-* headers
//     already on the record are replaced, never appended;
//  2. after the broker acknowledged it, one transaction records the outcome:
//     the inbox row (when the record has an event id) -> failed with
//     result_json {"error_code": ...}; when the record passed the contract
//     checks and its task exists and is not terminal, the task -> failed
//     (compare-and-set on version) with terminal_error_code = the code, and
//     a TaskFailed outbox event (not for an error wrapping
//     ErrNotYetVisible: the task is left for the reconciler's re-drive);
//     a task not found is waited for (the transaction retried) until
//     VisibilityTimeout after the earlier of the record's timestamp and
//     its first failure, since a record
//     failed before it read the database may be dead-lettered before its
//     task is visible, and left alone after that;
//  3. only then is the offset committed ("dead_lettered").
//
// A crash between 1 and 3 dead-letters the record again on redelivery; the
// reconciler records a dead letter once per origin offset. The reconciler
// consumes the dead-letter topic into the dead_letter table; `converge dlq
// replay` re-publishes the original record (package deadletter).
//
// # Fault points
//
// fault.WorkerProcessError (keys: task id, input SHA-256) makes the
// processing of a task's TaskCreated/TaskRedriveRequested fail
// deterministically with INJECTED_PROCESSING_ERROR: a poison message.
// fault.WorkerAfterArtifactWrite fires after the write and read-back, before
// the completion transaction: the attempt fails and is retried (or the
// record is redelivered after a restart), and finds the object by token.
// fault.WorkerBeforeOffsetCommit fires after the outcomes of a partition's
// batch of a poll are durable, before its offset is marked for commit: the
// offset is forgotten (a lost ack) and the records come again after a
// restart or rebalance, as duplicates (unless a later batch of the
// partition is committed first).
//
// # Metrics
//
//	converge_worker_batched_records_total            counter   records whose intake went through a run's shared transaction (batch.go)
//	converge_worker_group_records                    histogram records per group of runs whose shared intake committed (groups.go; buckets 1 to 256)
//	converge_worker_messages_total{outcome}          counter   records by outcome: processed, duplicate, conflict, ignored, failed, retried (one per failed attempt), dead_lettered, cancelled (a task cancelled while queued: not started); every outcome is exported at 0 from the start (the dead-letter alert takes increase() of dead_lettered)
//	converge_deadletter_published_total{error_code}  counter   records parked on the dead-letter topic (acknowledged and recorded), by error code; RETRIES_EXHAUSTED and TASK_NOT_FOUND are exported at 0 from the start, other codes appear with their first dead letter (at 1)
//	converge_worker_effect_transitions_total{kind,state} counter effect ledger transitions made by the worker (kind artifact.put|artifact.hide; state started, unknown, verified, compensation_required, compensated, failed)
//	converge_worker_processing_seconds               histogram first attempt on a record to its durable outcome, retries included
//	converge_worker_task_end_to_end_seconds          histogram task created_at to completed_at of the tasks this worker completed
package worker
