// Package bench is `converge bench` (make bench): it measures each stage of
// the pipeline against its physical limit, measured in the same run on the
// same PostgreSQL.
//
// One run starts a fresh local PostgreSQL cluster (internal/localpg, fsync,
// synchronous_commit and full_page_writes ON, as `converge dev`), an
// in-process kfake broker with a data directory and an fsync per produced
// batch (as `converge dev`), and a redis-server, all under a temporary
// directory, and gives each stage its own database:
//
//  1. create: the API (in process, default pool) under `loadgen` in the
//     closed model at 1, 4, 16 and 64 clients, against pgbench running the
//     create transaction's four statements (idempotency record insert,
//     complete; task, task_input and outbox inserts), one round trip each, with the same client counts and the same row sizes →
//     ratio; and against pgbench sending the API's own statements in the
//     API's two pipelines (\startpipeline) → the stricter ratio.
//  2. relay: events/s from a pre-filled outbox (one row per transaction, as
//     the API writes them) until Kafka acknowledged every row and the slot
//     advanced past the last one, against a minimal pglogrepl loop that only
//     decodes the same rows from its own slot (both slots are created before
//     the rows) → ratio; plus the relay's serial parts alone (its
//     record of published transactions, payload canonicalization, which only rows older
//     than migration 00004 still need). Then the peak RSS
//     (VmHWM) of a `converge relay` subprocess relaying ONE transaction of
//     RSSRows rows.
//  3. worker: tasks/s from a pre-filled topic of TaskCreated events to
//     completed tasks, against pgbench running the worker's statements
//     (inbox insert, task running CAS, document read, effect insert and
//     read; completion transaction) for the same number of tasks with as
//     many clients as the worker processes partitions → ratio; plus the
//     artifact store's Put+Observe rate alone (the part pgbench cannot do),
//     the disk's fdatasync rate, the worker's mean time per record and
//     effective concurrency (Little's law), and how many partitions one
//     poll of the topic spans.
//  4. end to end: the whole pipeline (internal/pipeline) under loadgen in the
//     open model at increasing fixed rates; the sustained rate is the highest
//     rate whose p99 end-to-end latency (task completed_at − created_at) stays
//     under 1 s with every task completed, no request failed and requests
//     sent at ≥ 95 % of the rate; and the p99 at 500 tasks/s.
//
// Every measurement is repeated Config.Runs times and the median reported.
// Around each measurement the CPU time of this process, of the PostgreSQL
// server processes and of pgbench is sampled from /proc, so the results say
// which process used the two cores. With Config.ProfileDir, CPU profiles of
// this process (API, relay, worker in process) are written per stage (the
// create stage at 16 clients, the first relay and worker runs, the first run
// of every end-to-end rate).
//
// Nothing here is a test assertion: `make test` runs the driver once at a
// tiny size (bench_test.go) to prove it still works.
package bench
