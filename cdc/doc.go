// Package cdc is converge's outbox relay: it tails inserts into outbox_event
// through a logical replication slot (pgoutput, protocol 1) and produces
// each row to the task-events topic (taskevent contract: key = task id,
// value = RFC 8785 canonical payload, headers event-id = outbox_id, type,
// aggregate version, payload sha256). Seed sections 4 and 5; DESIGN.md "cdc".
//
// # Setup (idempotent, at every start)
//
//   - Publication (Config.PublicationName): created FOR TABLE
//     public.outbox_event WITH (publish = 'insert') when missing; when it
//     exists it must still cover public.outbox_event and publish inserts,
//     or the relay waits for it to be fixed before it touches the slot
//     (ErrPublicationMismatch, "Publication checks" below; a migration that
//     drops and recreates the table leaves the publication covering
//     nothing).
//   - Slot (Config.SlotName): a permanent logical slot with pgoutput, created
//     when missing. A slot invalidated by max_slot_wal_keep_size (wal_status
//     lost) fails Run with ErrSlotLost; a slot of another kind or database
//     with ErrSlotMismatch; a slot streamed by another process makes the
//     session fail with ErrSlotActive and Run try again after a backoff (one
//     relay per slot, PostgreSQL enforces it: a second relay is a standby). A new slot
//     only holds commits after its consistent point: outbox rows committed
//     before the first start are not relayed by CDC (the reconciler's scan of
//     unpublished rows covers them).
//   - Topic: created with Config.Partitions partitions when missing.
//
// # Invariants
//
//   - Value: outbox_event.payload is text (migration 00004) holding the
//     canonical JSON each writer encoded and hashed into payload_sha256
//     (package outbox, taskevent.Encode). The stored bytes are the value:
//     the relay hashes them (no allocation for the value) and never parses
//     them. A row whose payload_sha256 is not the hash of its bytes is
//     relayed as it is, the column as header, logged and counted: the
//     consumers refuse it (PAYLOAD_HASH_MISMATCH) and dead-letter it, and
//     the stream goes on. The database guarantees only that the payload is
//     JSON (CHECK outbox_event_payload_json_check).
//   - Produce: rows are produced as they are decoded, never buffered per
//     transaction; at most MaxBufferedRecords records are in flight, from
//     decoding until Kafka acknowledged them (or they are parked), and at
//     most MaxBufferedRecords decoded transactions wait for the slot to
//     pass them (decoding waits for room, sending status updates
//     meanwhile), so memory is bounded whatever the transaction size. The
//     producer is franz-go's idempotent producer with acks=all and the
//     default key partitioner (Kafka's murmur2 for keyed records): all
//     events of a task go to one partition in commit order.
//   - Progress record (migration 00015): a transaction is done when its
//     Commit was seen, Kafka acknowledged every row of it (or the row was
//     parked), and the INSERT recording the transaction in
//     outbox_published_transaction (one narrow row per transaction,
//     outbox.RecordTransactions; one statement per flush, every
//     FlushInterval or as soon as FlushMaxRecords transactions wait)
//     committed. Every row of a recorded transaction that is not parked is
//     published (the SQL function outbox_published_at); the relay updates
//     no outbox row on this path, so an outbox row is written once. The
//     recording runs on a goroutine of its own (the marker), which counts
//     the transactions done in the tracker only after the INSERT
//     committed; the receive loop never waits for it and reads the
//     tracker's confirmable LSN when it sends a status update. A failure
//     of the marker (an INSERT error, an injected fault) stops Run with no
//     further status update. Only transactions the relay received are
//     recorded: rows the slot never delivered stay unpublished for the
//     reconciler (below).
//   - Commit visibility (internal/outbox, visibility.go): PostgreSQL flushes a commit record
//     and wakes the WAL senders before the committing backend leaves the
//     proc array (with a synchronous standby, only after the standby
//     confirmed), so the relay can decode, produce and have Kafka
//     acknowledge rows that other sessions do not see yet. Recording their
//     transaction needs no row: the record is true as soon as it is
//     written, and the rows read as published from the moment they are
//     visible. Parking a row does need it: a Park that changed nothing is
//     classified in one statement with its own snapshot
//     (pg_current_snapshot): a row found settled is done, a row not
//     visible while its transaction (the xid of its pgoutput Begin) is
//     still in progress for that snapshot is given back to the tracker and
//     parked at the next flush, and only a row absent although its
//     transaction is visible (deleted after its commit) is counted done,
//     logged and counted. A row not yet parked holds the slot before its
//     transaction.
//   - The slot advances only to the end LSN of the last transaction of the
//     longest WAL-ordered prefix of transactions whose Commit was seen and
//     whose rows are all done. franz-go completes partitions independently,
//     so the LSN of the last acknowledgement is never confirmed by itself.
//     Restart granularity is the transaction: after a crash every row of the
//     first unconfirmed transaction is produced again, with the same event-id
//     and the same value, and the consumers' inboxes absorb the duplicates.
//     Publication is at-least-once.
//   - Transactions streamed again: a session starts from the slot's
//     confirmed_flush_lsn as PostgreSQL last wrote it to disk, which after
//     a crash of PostgreSQL may be minutes older than what the relay had
//     confirmed (persistSlot). The relay therefore records its confirmable
//     LSN itself, per slot, in relay_progress (migration 00020; the marker
//     writes it at most once per StatusInterval, shutdown once more). A
//     session reads it at its start: a transaction whose commit LSN is
//     below it had every row acknowledged by Kafka (or parked) and recorded
//     by this slot's relay, so when the slot streams it again its rows are
//     counted (converge_relay_outbox_rows_already_published_total) and not
//     produced again, and it is done at its Commit. Only what was confirmed
//     after the last write (at most about a StatusInterval) and what was
//     acknowledged but not yet confirmed is produced again. The position is
//     the slot's own (another relay's slot is not affected:
//     TestSecondSlotRelaysWhatTheFirstRecorded) and the cluster's: a row
//     is written with the cluster's system identifier (IDENTIFY_SYSTEM) and
//     read only by the same cluster, because an LSN of another cluster's
//     WAL (the database restored there with pg_dump) may lie ahead of this
//     one's (TestProgressOfAnotherClusterIsIgnored). A row ahead of the
//     server's WAL flush position (IDENTIFY_SYSTEM) cannot be this WAL's
//     either (a cluster of the same lineage, built from one base backup):
//     the relay removes it. A write lands only while the session's own
//     walsender holds the slot on the server the pool reaches (not through
//     a pool that reconnected to a promoted standby while the replication
//     connection hangs on the old primary:
//     TestProgressIsRecordedOnlyByTheSlotsWalsender; such a write is logged
//     once per session). Before it creates its slot, the relay forgets the
//     progress recorded under the slot's name, which says nothing of a new
//     slot (TestNewSlotForgetsOlderProgress). Like the slot's own position,
//     the progress does not follow a change of topic or brokers: a relay
//     restarted on the same slot with another topic does not produce there
//     what it confirmed to the old one.
//   - Standby status updates set the write, flush and apply positions all to
//     that LSN (pglogrepl would copy the write position into zero flush/apply
//     positions). They are sent at least every StatusInterval and at once
//     when a server keepalive asks for a reply. The server's WAL end from
//     keepalives is confirmed only while the relay is idle (no transaction
//     tracked, none being received): the keepalive carries the walsender's
//     sent position, and every transaction committed before it was then
//     received and is done. Otherwise only commit LSNs the tracker passed
//     are, including those of heartbeats (below). Without the idle rule a
//     fast shutdown of PostgreSQL waits for good for the relay to confirm
//     the shutdown checkpoint.
//   - Heartbeat: every HeartbeatInterval (default 10s; negative disables) the
//     relay runs SELECT pg_logical_emit_message(true, 'converge-heartbeat',
//     '{"slot":...,"emitted_at":...}') on its normal connection. The
//     transactional message is a transaction of its own in the WAL; with the
//     pgoutput option messages 'true' it arrives as Begin, Message, Commit
//     and goes through the tracker like any transaction: an empty one is
//     done at its Commit, so the slot advances to the heartbeat's commit LSN
//     only once every earlier transaction is done. Without it an idle
//     outbox retains all WAL that other tables write (PostgreSQL 15+ skips
//     their empty transactions in pgoutput). Heartbeats of relays on other
//     slots of the database are tracked the same way, their round trip is
//     not measured. Needs PostgreSQL 14+. A failed heartbeat is logged and
//     counted, never fatal.
//   - Slot monitoring: every SlotSampleInterval (default 10s) the relay reads
//     pg_current_wal_lsn() - confirmed_flush_lsn, - restart_lsn and
//     wal_status of its slot from pg_replication_slots (the slot_* metrics;
//     wal_status is also exported when Run fails with ErrSlotLost).
//   - Receives from the replication connection are bounded by its read
//     deadline (at most ReceiveTimeout, and never past the next status
//     update), moved about once per status interval rather than per
//     message (receive.go), so flushes and status updates happen while the stream
//     is idle; cancelling Run's context wakes a waiting receive.
//   - Publication checks: see the section below.
//   - Parking (seed 4.1, issue 13): a record the producer or the broker
//     refuses for good (MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE,
//     INVALID_RECORD, CORRUPT_MESSAGE, INVALID_TIMESTAMP,
//     UNSUPPORTED_FOR_MESSAGE_FORMAT) and a row that cannot be decoded but
//     has an outbox id (INVALID_ROW) are parked by the marker
//     (outbox.Park: parked_at, publish_attempts, last_error_code,
//     last_error, last_attempt_at), in the flush, with the same visibility
//     check (Classify); a parked row is settled, so the slot moves past it
//     and the stream goes on. Operators decide with `converge outbox` or
//     the API's /v1/admin/outbox/ endpoints (Republish produces RecordOf
//     the row: same key, value, headers; republish.go).
//   - Rows the slot will not deliver (unpublished, not parked, older than
//     a threshold) are produced again by RepublishUnpublished: the one
//     routine of the reconciler's pass and of `converge outbox republish
//     --unpublished`.
//   - Any other failure of a session — a record whose produce fails for a
//     reason retrying may fix (broker unreachable past DeliveryTimeout, an
//     authorization error), the database or the replication connection,
//     another process on the slot — closes it; its failed record's attempt
//     is recorded on the row (outbox.RecordFailure) and Run opens a new
//     session from the slot after RestartBackoffMin..Max. Only the fatal
//     errors (see Run) end Run.
//   - The backlog check (outbox.Backlog, the reconciler) finds the rows
//     neither published nor parked from a created_xid watermark
//     (migration 00008) and an anti-join on the transaction records.
//   - Shutdown (ctx cancelled): stop reading, wait up to ShutdownTimeout for
//     in-flight records, record the settled transactions, send a final
//     status update with the confirmable LSN, close, return nil.
//
// # Publication checks (issue 13)
//
// pgoutput sends a row only when, in the catalog as of the row's place in
// the WAL (decoding uses historic catalog snapshots), the publication
// covers the table and publishes inserts. A row written while that is not
// so is never in the slot's stream, whatever the slot's position and
// whenever the publication is fixed; nothing in the stream shows that rows
// are missing. So the relay checks:
//
//   - the publication (store.checkPublication: it exists, covers
//     public.outbox_event, publishes inserts): when a session opens, every
//     SlotSampleInterval while it streams, and after each Relation message
//     of the outbox (asynchronously, in the monitor: the receive loop makes
//     no extra round trip);
//   - each pgoutput Relation message of public.outbox_event (sent before
//     the first change of the relation in a session and after its schema
//     changed): it must have every column the relay reads (newRelation;
//     tenant_id is optional). Relation messages of other tables are kept
//     and their rows ignored;
//   - the stream's errors: a walsender failing with "publication ... does
//     not exist" (SQLSTATE 42704). PostgreSQL before 18 fails so on every
//     change written while the publication did not exist (dropped while
//     the relay streamed), even once the relay created it again.
//
// A mismatch — reason missing, not_covered, no_insert (ErrPublicationMismatch)
// or columns (ErrRelationMismatch) — makes the relay unhealthy: Health
// returns it with the statement that fixes it (`converge relay` serves it as
// GET /readyz, 503), converge_relay_publication_mismatch{reason} is 1,
// converge_relay_publication_mismatches_total{reason} counts it once, and
// it is logged at error level (repeated while it lasts). The session ends
// without a further status update, so the slot stays at the position last
// confirmed, and the relay does not stream until the mismatch is gone:
//
//   - a publication mismatch is checked again every SlotSampleInterval
//     before the slot is touched (at start no slot is created meanwhile);
//     once the publication delivers inserts the relay opens a session from
//     the slot. The rows committed meanwhile are not in the stream: the
//     reconciler republishes them (consumers/reconciler, RepublishAfter,
//     default 5 minutes after they were written) with their original
//     records. With RepairPublication (`converge dev`) the relay repairs the
//     publication when it opens the session instead of waiting.
//   - a Relation message without a column, and the walsender's error for a
//     dropped publication, end every session at the same place (the slot
//     never passes it); the relay opens a new session every
//     SlotSampleInterval. It is healthy again once a Relation message of the
//     outbox maps, or once the slot was moved past that place (the fix, in
//     Health's text: restore the column if one is missing, stop the relay,
//     pg_replication_slot_advance past the WAL it cannot decode, start the
//     relay; the reconciler republishes the rows written meanwhile).
//
// Neither ends Run, and neither counts as a restart: ending Run would make
// `converge relay` exit — a crash loop whose metrics and message are gone
// between restarts — and stop all of `converge dev`, API included, while
// the fix is one statement in the database after which the relay resumes
// by itself. Not streaming, rather than streaming on and confirming
// heartbeats, stops the slot where the relay found the mismatch (within a
// SlotSampleInterval of its start): the relay does not go on confirming a
// stream it knows is missing outbox rows, and it holds no replication
// connection a PostgreSQL shutdown would wait for. The cost is WAL: the
// slot retains it while the mismatch lasts (the slot_* gauges are still
// sampled every SlotSampleInterval, so ConvergeReplicationSlotRetainedWALHigh
// fires; past max_slot_wal_keep_size the slot is lost, ErrSlotLost). Tests: TestRelayPublicationMismatchAtStart,
// TestRelayPublicationDroppedWhileStreaming,
// TestRelayPublicationDroppedAndRecreated,
// TestRelayChecksPublicationOnRelationMessage,
// TestRelayOutboxRelationWithoutColumn, TestRelayRepairsPublicationWhenAsked,
// and consumers/reconciler TestPublicationRepairedRowsReachTheTopic (every
// row of the gap reaches the topic, none is marked published unproduced).
//
// # Fault points
//
//   - fault.RelayBeforeMarkPublished: after Kafka acknowledged a batch, before
//     the flush records its transactions (and parks its refused rows).
//   - fault.RelayAfterAckBeforeConfirm: after the record committed, before
//     the status update that would advance the slot.
//   - fault.RelayPublishConfirmLost: Kafka acknowledged a record, the
//     produce callback sees an error instead (a lost publisher confirm): Run
//     fails and a restart produces the record again from the slot.
//
// With action error Run returns an error wrapping fault.ErrInjected and sends
// no further status update (a simulated crash); with crash the process exits.
//
// # Metrics
//
//	name                                                      type       labels      meaning
//	converge_relay_events_published_total                     counter    event_type  records acknowledged by Kafka (republications count again)
//	converge_relay_produce_errors_total                       counter    -           records whose produce failed for good
//	converge_relay_payload_hash_mismatches_total              counter    -           rows whose payload_sha256 differs from the canonical payload's hash
//	converge_relay_commit_to_ack_seconds                      histogram  -           transaction commit time to Kafka's ack of its last record, seconds
//	converge_relay_confirmed_lsn                              gauge      -           LSN (as a number) last sent as write/flush/apply position
//	converge_relay_last_acked_lsn                             gauge      -           LSN (as a number) up to which every transaction is acknowledged by Kafka and recorded (what the next status update confirms)
//	converge_relay_slot_lag_bytes                             gauge      -           pg_current_wal_lsn() - confirmed_flush_lsn, bytes (sampled)
//	converge_relay_slot_retained_wal_bytes                    gauge      -           pg_current_wal_lsn() - restart_lsn: WAL kept for the slot, bytes (sampled)
//	converge_relay_slot_wal_status                            gauge      status      1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others
//	converge_relay_slot_sample_errors_total                   counter    -           failed reads of pg_replication_slots
//	converge_relay_heartbeats_emitted_total                   counter    -           heartbeats written into the WAL
//	converge_relay_heartbeat_errors_total                     counter    -           heartbeats that could not be written
//	converge_relay_heartbeat_rtt_seconds                      gauge      -           emit -> decoded from the slot, seconds, of the last heartbeat received
//	converge_relay_heartbeat_last_received_timestamp_seconds  gauge      -           Unix time the last own heartbeat was decoded
//	converge_relay_transactions_in_flight                     gauge      -           decoded transactions the slot has not passed yet
//	converge_relay_records_in_flight                          gauge      -           records produced, not yet acknowledged (or parked)
//	converge_relay_outbox_transactions_recorded_total         counter    -           transactions this relay recorded in outbox_published_transaction
//	converge_relay_outbox_rows_already_published_total        counter    -           rows streamed again below the relay's recorded progress (relay_progress): not produced again
//	converge_relay_outbox_rows_not_yet_visible_total          counter    -           times a flush found a row to park not yet visible (retried at the next flush)
//	converge_relay_outbox_rows_gone_total                     counter    -           rows to park deleted after their commit before they were parked
//	converge_relay_status_updates_total                       counter    -           standby status updates sent
//	converge_relay_outbox_rows_parked_total                   counter    code        rows parked because they cannot be published
//	converge_relay_restarts_total                             counter    reason      sessions failed and restarted (produce, slot_active, database, other; a publication mismatch is not counted)
//	converge_relay_streaming                                  gauge      -           1 while streaming from the slot, 0 while connecting or backing off
//	converge_relay_publication_mismatch                       gauge      reason      1 for each reason (missing, not_covered, no_insert, columns) the relay finds now; the relay does not stream while one is 1
//	converge_relay_publication_mismatches_total               counter    reason      mismatches found (once per finding, however long it lasts)
//
// The relay's franz-go client exports converge_kafka_client_*{component=
// "relay"} when the caller passes kafkametrics.ClientMetrics in KafkaOpts
// (the converge binary does).
package cdc
