#!/usr/bin/env bash
# Instructions per RPC in the coordinator, counted by valgrind's callgrind (repeatable on a noisy
# machine, unlike time): the release coordinator runs under callgrind with instrumentation off;
# for each workload it is switched on while one caller drives it, then dumped, and the dump's
# total is divided by the calls the bench made. Prints, per workload, the instructions per call
# and the ten functions that cost the most by their own instructions (callees not counted).
#
#   bench/callgrind-per-rpc.sh [TARGET_DIR] [SECONDS]    # default: target/release, 10
#
# STORE_FLAGS, when set, replaces `--database-url <a database of its own>` (e.g. several
# `--cluster NAME=URL`; the bench's namespace, `bench`, is then served by the default cluster).
#
# Needs valgrind, PostgreSQL at 127.0.0.1:5432 (scripts/services) and a release build
# (cargo build --release --workspace --bins). Writes its dumps to a temporary folder it names.
set -euo pipefail
bin=${1:-target/release}
seconds=${2:-10}
coordinator=$bin/idempotency-coordinator
bench=$bin/idempotency-bench
[ -x "$coordinator" ] && [ -x "$bench" ] || { echo "no release build in $bin" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "no valgrind: apt-get install valgrind" >&2; exit 1; }

out=$(mktemp -d /tmp/callgrind-per-rpc.XXXXXX)
database=callgrind_per_rpc_$$
url=postgres://postgres@127.0.0.1:5432/$database
port=$((20000 + $$ % 20000))
echo "dumps in $out; coordinator on 127.0.0.1:$port, database $database" >&2

read -r -a store_flags <<<"${STORE_FLAGS:---database-url $url}"
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/callgrind.out.%p" \
  "$coordinator" serve "${store_flags[@]}" --listen "127.0.0.1:$port" \
  >"$out/coordinator.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS $database" postgres >/dev/null 2>&1 || true' EXIT
# Ready when a health check gets through (valgrind makes the start slow).
for _ in $(seq 1 120); do
  if "$coordinator" healthcheck --addr "127.0.0.1:$port" >/dev/null 2>&1; then break; fi
  sleep 1
done

printf '%-18s %8s %16s\n' workload calls "instructions/call"
for workload in health try-start lifecycle replay mark-processed-1; do
  callgrind_control -i on "$pid" >/dev/null
  report=$("$bench" run --target "http://127.0.0.1:$port" --workload "$workload" --callers 1 \
    --duration "${seconds}s")
  callgrind_control -i off "$pid" >/dev/null
  callgrind_control -d "$workload" "$pid" >/dev/null
  # The bench's row: workload, store, callers, ops/s, …; calls = ops/s × seconds.
  ops=$(awk -v w="$workload" '$1 == w && !seen { print $4; seen = 1 }' <<<"$report")
  calls=$(awk -v ops="$ops" -v s="$seconds" 'BEGIN { printf "%d", ops * s }')
  dump=$(ls -t "$out"/callgrind.out."$pid".* | head -n 1)
  # (awk reads to the end: an early exit would fail the pipe with SIGPIPE under pipefail.)
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ && !seen { gsub(",", "", $1); print $1; seen = 1 }')
  printf '%-18s %8d %16d\n' "$workload" "$calls" $((total / (calls > 0 ? calls : 1)))
  callgrind_annotate "$dump" 2>/dev/null \
    | awk '/^-+$/ { rule++ } rule >= 6 && /\(/ && shown < 10 { print; shown++ }' >"$out/$workload.top10"
done
for workload in health try-start lifecycle replay mark-processed-1; do
  echo "== $workload: the ten functions that cost the most (own Ir)"
  cat "$out/$workload.top10"
done
