#!/bin/bash
# run.sh: PostgreSQL's CPU per task for one task's statements (task.sql) on
# schema variants, in alternating rounds, on a PostgreSQL 15 cluster of its
# own (fsync on, checkpoint_timeout 1 h, jit off). BENCHMARKS.md, session of
# 2026-12-07 (ninth), items 1 and 2.
#
# Usage (from the repository root, after make build):
#   cmd/converge/internal/bench/schemacost/run.sh [-r rounds] [-t tasks-per-client] [-s script] [-p seconds] [variant...]
# variant: a (the schema as migrated) or x for variant-x.sql applied to a
# copy; default: a c. script: task.sql (default) or task-cast.sql. Each run
# is pgbench -M prepared, 8 clients, 2 threads; tasks per run = 8 x
# tasks-per-client (default 1000). Prints one line per run, then per variant
# the median CPU (ms per task: the postmaster and all its children, from
# /proc) and the median of the per-round ratios to the first variant.
# With -p, each round instead runs the first variant and each other one at
# the same time for that many seconds (4 clients each, the start order
# alternating): both see the same machine, whose speed drifts by more than
# these effects between runs; it prints the other's tps over the first's
# (above 1: the other is cheaper) and their medians.
# Needs pg_config, the server binaries, pgbench, psql, python3, bc. As root
# the cluster runs as the postgres user. PORT (default 55432) must be free.
# The payloads' timestamps have dashes for colons (pgbench reads ":name" as
# a variable); PostgreSQL only checks that they are JSON.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../../.." && pwd)
rounds=10 tpc=1000 script=task.sql port=${PORT:-55432} pair=
usage() { sed -n '/^# Usage/,/^#   cmd/p' "$0" >&2; exit 2; }
die() { echo "run.sh: $*" >&2; exit 1; }
while getopts r:t:s:p: o; do
  case $o in r) rounds=$OPTARG ;; t) tpc=$OPTARG ;; s) script=$OPTARG ;; p) pair=$OPTARG ;; *) usage ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || set -- a c
positive='^[1-9][0-9]*$'
[[ $rounds =~ $positive && $tpc =~ $positive ]] || die "-r and -t take positive integers"
[[ -z $pair || $pair =~ $positive ]] || die "-p takes a positive number of seconds"
[[ -z $pair || $# -ge 2 ]] || die "-p compares the first variant with others: give two or more"
[ -f "$here/$script" ] || die "no script $here/$script"
for v in "$@"; do
  [[ $v = a || -f $here/variant-$v.sql ]] || die "no variant $v ($here/variant-$v.sql)"
done
! (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null || die "port $port is in use (set PORT)"
bindir=$(pg_config --bindir)
work=$(mktemp -d /tmp/schemacost.XXXXXX)
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$1"; else sh -c "$1"; fi; }
# On failure, the cluster's log and the last pgbench output are printed
# before the directory goes.
cleanup() {
  local rc=$?
  if [ "$rc" != 0 ]; then
    for f in "$work/pgbench.out" "$work/log"; do
      if [ -f "$f" ]; then echo "--- $f (tail)" >&2; tail -20 "$f" >&2; fi
    done
  fi
  if [ -f "$work/data/postmaster.pid" ]; then as_pg "$bindir/pg_ctl -D $work/data -m fast stop >/dev/null" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
if [ "$(id -u)" = 0 ]; then chown postgres "$work"; fi
as_pg "$bindir/initdb -D $work/data -A trust -U postgres >/dev/null"
as_pg "$bindir/pg_ctl -D $work/data -l $work/log -w -o '-c port=$port -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c wal_level=logical -c shared_buffers=256MB -c max_wal_size=16GB -c checkpoint_timeout=3600 -c jit=off' start >/dev/null"
export PGOPTIONS="-c client_min_messages=warning"
psql=(psql -h 127.0.0.1 -p "$port" -U postgres -qAt -v ON_ERROR_STOP=1)
"${psql[@]}" -c "CREATE DATABASE base"
"$root/bin/converge" migrate --finalize --database-url "postgres://postgres@127.0.0.1:$port/base" >/dev/null
"${psql[@]}" -d base -c "CREATE SEQUENCE task_seq"
for v in "$@"; do
  "${psql[@]}" -c "CREATE DATABASE v_$v TEMPLATE base"
  if [ "$v" != a ]; then "${psql[@]}" -d "v_$v" -f "$here/variant-$v.sql"; fi
done
defs=(-D lockms=1000 -D scope=tenant-x-create-document-task
  -D fp=55dfa58b3d531a89b26e0054e7257768b5409b99920935a49dbc40a3259a0e0e
  -D sha=6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09
  -D empty=x -D queued=queued -D jcs=jcs -D created=TaskCreated -D completedev=TaskCompleted
  -D consumer=converge-worker -D lockedby=converge-worker-vm -D put=artifact.put
  -D started=started -D verified=verified -D completed=completed
  -D 'result={"task_version": 2, "artifact_sha256": "6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09"}'
  -D 'p1={"event_id": "01a24ffe-184a-784b-b698-5056a560d21c","event_type": "TaskCreated","occurred_at": "2026-12-07T10-13-02.155858Z","schema_version": 1,"task": {"artifact_sha256": null,"artifact_size": null,"attempt": 0,"completed_at": null,"created_at": "2026-12-07T10-13-02.155858Z","input_sha256": "6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09","input_size": 35,"output_format": "jcs","status": "queued","task_id": "01a24ffe-184a-7838-b940-e17f47470043","tenant_id": null,"updated_at": "2026-12-07T10-13-02.155858Z","version": 0}}'
  -D 'p2={"event_id": "01a24ffe-1884-7183-ba96-433aa24fd4d8","event_type": "TaskCompleted","occurred_at": "2026-12-07T10-13-02.210484Z","schema_version": 1,"task": {"artifact_sha256": "6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09","artifact_size": 35,"attempt": 1,"completed_at": "2026-12-07T10-13-02.210484Z","created_at": "2026-12-07T10-13-02.155858Z","input_sha256": "6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09","input_size": 35,"output_format": "jcs","status": "completed","task_id": "01a24ffe-184a-7838-b940-e17f47470043","tenant_id": null,"updated_at": "2026-12-07T10-13-02.210484Z","version": 2}}'
  -D 'body={"links":  {"self":  "/v1/tasks/01a24ffe-184a-7838-b940-e17f47470043", "artifact":  "/v1/tasks/01a24ffe-184a-7838-b940-e17f47470043/artifact"}, "status":  "queued", "task_id":  "01a24ffe-184a-7838-b940-e17f47470043", "version":  0, "input_sha256":  "6818580458c943960dffcda101448df4efa8baef9cff419a76b6283a8f090b09"}')
# pgcpu: CPU ticks of the postmaster, its reaped children and its live ones.
pgcpu() {
  local pm t c v
  pm=$(head -1 "$work/data/postmaster.pid")
  t=$(awk '{print $14+$15+$16+$17}' "/proc/$pm/stat")
  for c in $(pgrep -P "$pm"); do
    v=$(awk '{print $14+$15}' "/proc/$c/stat" 2>/dev/null || true)
    t=$((t + ${v:-0}))
  done
  echo "$t"
}
# pgb DB OUT ARGS...: pgbench of the script on v_DB (ARGS: clients, length),
# its output in OUT; tps_of OUT: the rate pgbench printed.
pgb() {
  local db=$1 out=$2
  shift 2
  pgbench -h 127.0.0.1 -p "$port" -U postgres -n -M prepared "$@" "${defs[@]}" -f "$here/$script" "v_$db" >"$out" 2>&1
}
tps_of() { grep -o "tps = [0-9.]*" "$1" | cut -d' ' -f3; }
truncate_tables() {
  "${psql[@]}" -d "v_$1" -c "TRUNCATE task, task_input, idempotency_record, outbox_event, inbox_message, effect_ledger CASCADE"
}
if [ -n "$pair" ]; then
  first=$1
  shift
  for i in $(seq "$rounds"); do
    for v in "$@"; do
      truncate_tables "$first"
      truncate_tables "$v"
      "${psql[@]}" -c "CHECKPOINT"
      order=("$first" "$v")
      if [ $((i % 2)) = 0 ]; then order=("$v" "$first"); fi
      pids=()
      for d in "${order[@]}"; do
        pgb "$d" "$work/pair.$d" -c 4 -j 1 -T "$pair" &
        pids+=($!)
      done
      for d in "${order[@]}"; do
        ok=1
        wait "${pids[0]}" || ok=
        pids=("${pids[@]:1}")
        if [ -z "$ok" ] || grep -q "aborted" "$work/pair.$d"; then
          cp "$work/pair.$d" "$work/pgbench.out"
          die "pgbench on $d failed"
        fi
      done
      a=$(tps_of "$work/pair.$first")
      b=$(tps_of "$work/pair.$v")
      echo "$i $v $(echo "scale=4; $b / $a" | bc) $b $first $a"
    done
  done | tee "$work/results"
  python3 - "$work/results" "$first" <<'PY'
import statistics, sys
r = {}
for l in open(sys.argv[1]):
    f = l.split()
    r.setdefault(f[1], []).append(float(f[2]))
print("variant  median tps ratio to %s (run at the same time)" % sys.argv[2])
for v, x in r.items():
    print("%-8s %.3f  (%s)" % (v, statistics.median(x), " ".join("%.3f" % y for y in x)))
PY
  exit 0
fi
n=$((tpc * 8)) tick=$(getconf CLK_TCK)
for i in $(seq "$rounds"); do
  for v in "$@"; do
    truncate_tables "$v"
    "${psql[@]}" -c "CHECKPOINT"
    c0=$(pgcpu)
    pgb "$v" "$work/pgbench.out" -c 8 -j 2 -t "$tpc" || die "pgbench on $v failed"
    tps=$(tps_of "$work/pgbench.out")
    c1=$(pgcpu)
    done_=$("${psql[@]}" -d "v_$v" -c "SELECT count(*) FROM task WHERE status = 'completed'")
    if [ "$done_" != "$n" ]; then die "run $i of $v: $done_ of $n tasks completed"; fi
    echo "$i $v $(echo "scale=3; ($c1 - $c0) * 1000 / $tick / $n" | bc) $tps"
  done
done | tee "$work/results"
python3 - "$work/results" "$1" <<'PY'
import statistics, sys
runs = [l.split() for l in open(sys.argv[1])]
cpu = {}
for r in runs:
    cpu.setdefault(r[1], {})[r[0]] = float(r[2])
first = cpu[sys.argv[2]]
print("variant  median ms/task  median per-round ratio to %s" % sys.argv[2])
for v, x in cpu.items():
    ratios = [x[i] / first[i] for i in x if i in first]
    print("%-8s %14.3f  %.3f" % (v, statistics.median(x.values()), statistics.median(ratios)))
PY
