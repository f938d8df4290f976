#!/usr/bin/env bash
# Tests the Node client on a fresh machine (Node 20 and npm; PostgreSQL at 127.0.0.1:5432 with
# trust auth and psql for the PostgreSQL half): installs the locked dependencies, generates the
# types from ../../proto and type-checks and builds, then runs every test against the real
# coordinator binary, taken from IDEMPOTENCY_COORDINATOR_BIN (default: the repository's
# target/debug/idempotency-coordinator), and the scenario vectors through the workspace's
# fault-proxy, taken from FAULT_PROXY_BIN (default: target/debug/fault-proxy).
set -euo pipefail
cd "$(dirname "$0")"

repo_root=$(cd ../.. && pwd)
export IDEMPOTENCY_COORDINATOR_BIN="${IDEMPOTENCY_COORDINATOR_BIN:-$repo_root/target/debug/idempotency-coordinator}"
if [ ! -x "$IDEMPOTENCY_COORDINATOR_BIN" ]; then
  echo "no coordinator binary at $IDEMPOTENCY_COORDINATOR_BIN: run cargo build, or set IDEMPOTENCY_COORDINATOR_BIN" >&2
  exit 1
fi
export FAULT_PROXY_BIN="${FAULT_PROXY_BIN:-$repo_root/target/debug/fault-proxy}"
if [ ! -x "$FAULT_PROXY_BIN" ]; then
  echo "no fault-proxy binary at $FAULT_PROXY_BIN: run cargo build, or set FAULT_PROXY_BIN" >&2
  exit 1
fi

npm ci --no-audit --no-fund
# The build generates src/generated from the proto on every run (nothing generated is
# committed, so it cannot disagree with the proto), then runs tsc with strict checks.
npm run build
npm test
