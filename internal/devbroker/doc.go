// Package devbroker is converge's embedded development broker: franz-go's
// in-process Kafka cluster (kfake) plus a reaper that removes consumer-group
// members whose process is gone, which can be stopped and restarted with its
// state (a Kafka outage on demand). `converge dev` (make run) and
// `converge experiment` (and its test) start it; other tests use plain
// kfake (internal/testenv).
//
// # Why
//
// kfake (pinned pseudo-version v0.0.0-20260918054303-01f206a7e32c, groups.go)
// differs from Apache Kafka in three ways that together wedge a classic
// consumer group after consumers are SIGKILLed during a rebalance (issue 9):
//
//   - A member's session timer is armed only after a JoinGroup or SyncGroup
//     response was handed to its connection (group.reply calls
//     updateHeartbeat only when creq.reply succeeded; a new member's pending
//     timer is stopped when it joins with its member id). A member that
//     joined and died before the response may have no session timer (the
//     send to the connection's buffered response channel races its closed
//     done channel): it stays a member, can be chosen leader or be assigned
//     partitions, never syncs, and only a completed rebalance removes it.
//     Kafka schedules every member's heartbeat expiry when the join phase
//     completes, whether or not the response reached the client.
//   - Each JoinGroup, and each removal, restarts the rebalance timer
//     (rebalance() re-arms tRebalance with the largest rebalance timeout of
//     the members). Kafka sets the join deadline once per rebalance.
//   - The session timer of a member that waits for its JoinGroup or
//     SyncGroup response keeps running (clients do not heartbeat then), so
//     a live member waiting longer than its session timeout (below the
//     rebalance timeout with franz-go's defaults and converge's) is
//     removed; its client notices only when the request's read timeout
//     (rebalance timeout + 10s) expires, logs
//     "unable to join group session: ... i/o timeout" and joins again as a
//     new member, which restarts the timer once more. Kafka never expires a
//     member awaiting a join or sync response.
//
// Measured with the reproduction in this package (wedge_test.go: five
// processes configured like the worker SIGKILLed mid-join two seconds
// apart, two live members, four partitions), against plain kfake: with
// franz-go's default timeouts (session 45s, heartbeat 3s, rebalance 60s,
// those of issue 9) the group was still in PreparingRebalance 15 minutes
// after the last kill, the live members logging "unable to join group
// session: ... i/o timeout" every 70s and rejoining at staggered times,
// while lag_seconds grew to 907s; with internal/consumergroup's timeouts
// (10s, 1s, 30s) it converged 63s and 73s after the last kill (two runs),
// the live members removed while waiting and rejoining only 40s later.
// With the reaper the group was Stable on the two live members 1.7 to 2.0s
// after the last kill, with every victim evicted and no live member.
//
// # What the reaper does
//
// Start wraps kfake's listener (kfake.ListenFn) and tracks every open client
// connection: its remote address and the client id of its first request
// header. Every ScanInterval (1s) the reaper describes the classic groups
// and takes a member as dead when both hold:
//
//   - the connection of its ClientHost (the remote address of the
//     connection it first joined on) is closed, and
//   - no open connection carries its ClientID.
//
// A member found dead on Confirmations (2) scans in a row is evicted with a
// LeaveGroup (v3+, its member id, a KIP-800 reason) sent on its behalf;
// kfake removes it, also when it is parked in a JoinGroup, and rebalances at
// once when every remaining member has joined. A dead member is thus gone
// one to two seconds after its process died, whatever the session and
// rebalance timeouts, and the live members converge on their next heartbeat
// (internal/consumergroup: every second).
//
// The rule is conservative: a live process always has an open connection
// with its client id (fetches and heartbeats), so it is never evicted;
// processes that share a client id (franz-go's default "kgo") keep each
// other's dead members, which then wait for kfake's own timers as before.
// converge's consumers therefore use a client id per process
// (internal/clientid: "converge-worker-<host>-<pid>", likewise for the
// projector and the reconciler's dead-letter intake). Members restored from
// DataDir's session state at start get RestoredGrace (15s) to reconnect.
// KIP-848 groups (ConsumerGroupHeartbeat, which converge does not use) are
// not scanned.
//
// Nothing here is needed with a real Kafka cluster, where a dead member is
// removed after its session timeout and the join deadline does not move;
// there a rebalance that counted dead members still costs a session
// timeout per round (kfake patched to behave like Kafka in the three
// points above converged 83s after the last kill of the reproduction with
// 45s sessions: two rounds).
//
// # Timeouts
//
// The session, heartbeat and rebalance timeouts of converge's consumers
// are internal/consumergroup's (see its Config for the defaults and their
// trade-offs); they bound how soon a real Kafka reassigns a crashed
// member's partitions. On this broker the reaper, not the session timeout,
// bounds how long a dead member holds the group: about Confirmations ×
// ScanInterval plus one heartbeat interval. The three kfake behaviours
// above do not depend on the values: shorter timeouts shorten each wait
// (63-73s instead of more than 15 minutes above), but the wedge still lasts
// several session timeouts, and two live members whose re-joins are
// staggered by more than 10s (the read timeout minus the rebalance
// timeout) but less than the rebalance timeout renew it indefinitely.
//
// # Stop and Restart
//
// With Config.DataDir, Stop takes the cluster away in process: kfake writes
// its state to the directory (topics, record log, committed offsets,
// producer ids and sequence windows, group sessions) and closes its
// listeners and every client connection, so every client gets connection
// refused on the broker's address, as when a broker process is down.
// Restart creates a new kfake cluster on the same ports from that
// directory, and a new reaper, whose RestoredGrace covers the restored
// members while their clients reconnect. Clients reconnect by themselves;
// an idempotent producer's records given during the outage are delivered
// once, after the earlier ones (restart_test.go). The kafka-outage
// experiment (cmd/converge/internal/experiment) uses it.
//
// # Metrics
//
//   - converge_devbroker_group_members_evicted_total{group} (counter):
//     members evicted because their process is gone.
//   - converge_devbroker_group_scan_errors_total (counter): scans
//     (DescribeGroups, LeaveGroup) that failed.
//   - converge_devbroker_connections (gauge): open client connections.
package devbroker
