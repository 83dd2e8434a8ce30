// Package deadletter is converge's dead-letter store and controlled replay
// (seed 13.5, 14 "Poison Message"; DESIGN.md "Kafka contract"): the
// reconciler records every record of the dead-letter topic in the
// dead_letter table (FromRecord, Store.Insert), and a person lists, inspects
// and replays or resolves them (`converge dlq`, GET/POST
// /v1/admin/dead-letters) through a Service. The dead_letter table's SQL is
// in store.go; the record format is internal/taskevent's (the dlq-* headers,
// DeadLetterRecord), and the rows a replay changes in other aggregates (the
// task re-opened, the inbox row reset, the re-drive event) are written by
// their owners (internal/task, internal/inbox, internal/outbox).
//
// # Identity
//
// A dead letter is identified by its origin (topic, partition, offset),
// unique in the table: consuming the dead-letter topic again, or a record
// dead-lettered twice after a worker crash, is recorded once (INSERT ... ON
// CONFLICT DO NOTHING). Its id (dead_letter_id) is what the commands take.
//
// # States
//
//	parked    recorded from the dead-letter topic, never replayed
//	replayed  the original record was re-published (replay_count counts it)
//	resolved  nothing is left to replay: a replay found the task completed,
//	          or failed for another reason than this dead letter; a person
//	          resolved it (Resolve); or the reconciler found its task
//	          completed since (Store.ResolveCompleted)
//	refused   a replay was asked past MaxReplays (default 3) replays of its
//	          task; a person must decide (the record stays in the table,
//	          nothing is dropped): fix and complete the task (a replay, or
//	          the reconciler, then resolves it) or Resolve it
//
// The row keeps who asked, when and why of the LAST request — replay or
// resolve — (last_replay_by, last_replay_at, last_replay_reason,
// last_replay_outcome); every request is also logged (earlier requests of
// the same dead letter are only in the log).
//
// # Replay
//
// Replay re-publishes the ORIGINAL record — same key, value and headers
// (the dlq-* headers are not part of it), so the same event id — to the
// original topic, in one database transaction that holds the dead letter's
// row lock while the broker acknowledges. It needs a Kafka producer
// (ErrNoProducer otherwise, before anything is read or written).
//
//  1. every dead letter of the same task (task id; of the same message,
//     event id, when the record names no task) is locked, in id order; a
//     resolved one is answered as it is;
//  2. the worker's inbox row of the message, then the task (when the record
//     names one), are locked — the order of the worker's transactions;
//  3. the task decides first, whatever the dead letter's state: completed,
//     or failed or compensated with another terminal_error_code than the
//     dead letter's, makes the replay a no-op and the dead letter resolved
//     ("task ... is already completed; nothing to replay", "task ... failed
//     with CODE, not because of this dead letter; nothing to replay") — a
//     refused one too, so it stops waiting for a person;
//  4. a dead letter refused earlier stays refused (nothing published); a
//     dead letter already replayed is a no-op (state unchanged): its
//     redelivery is in flight or done, and one that failed again was
//     parked as a new dead letter — so concurrent requests for one dead
//     letter publish once;
//  5. when the TASK was replayed MaxReplays times in all (the sum of
//     replay_count over all its dead letters: a replay that fails again
//     makes two new ones, the re-published original's and the
//     TaskRedriveRequested event's, which has its own event id), the dead
//     letter becomes refused and nothing is published — whichever of the
//     task's dead letters is asked for;
//  6. a task failed WITH the dead letter's code is re-opened by a
//     compare-and-set on its version (failed -> queued, version+1,
//     terminal_error_code cleared) and a TaskRedriveRequested outbox event
//     of the new version is written in the same transaction: the projector
//     replaces the failed view with the queued one, and the worker drives
//     the task from whichever of the two records (this event, the
//     re-published original) comes first — the other finds the task
//     running or terminal and is a duplicate. A queued or running task is
//     left as it is;
//  7. the worker's inbox row of the message (consumer group from the dead
//     letter) is reset to processing when it is failed, so the redelivery
//     is processed instead of being taken as a duplicate; the worker starts
//     a queued task whose version is above the event's from its current
//     version, resuming the task's unfinished artifact effect (same token);
//  8. the original record is produced and acknowledged, then the dead
//     letter becomes replayed (replay_count+1) and the transaction commits.
//
// A produce failure (ErrPublish) rolls everything back. A commit failure
// after the produce leaves the redelivery a duplicate (the inbox row is
// still failed) and the replay can be asked again. The worker's inbox
// insert waits for the row lock of step 7, so it never sees the old state
// after the replayed record arrives.
//
// # Resolve
//
// Resolve marks a dead letter resolved without publishing anything or
// touching the task (a person decided no replay is needed; the reason is
// required and recorded). It needs no producer. Its replay_count is kept
// and still counts towards MaxReplays. Store.ResolveCompleted, called by
// the reconciler's passes, resolves parked and refused dead letters whose
// task has completed since (last_replay_by "reconciler").
//
// # Metrics
//
//	converge_deadletter_replays_total{outcome}   counter  replay requests by outcome: replayed, noop, refused, error
//
// The counter lives in the process that serves metrics and replays: the
// API (`converge api`, `converge dev`). `converge dlq replay` is a
// short-lived process whose counter nobody scrapes: it prints each outcome
// (and logs it) instead, and the dead_letter row records it. Resolve
// requests are not counted.
//
// The reconciler exports converge_deadletter_unresolved (parked or refused
// rows) and the worker converge_deadletter_published_total{error_code}.
package deadletter
