#!/usr/bin/env bash
# The rolling-upgrade suite: upgrading the service from the previous release (the commit in
# PREVIOUS_RELEASE) to this one, and rolling it back, under a steady load, fails no call. See
# deploy/upgrade/README.md for what it proves and the figures.
#
# It builds the previous release itself (git archive of the commit, cargo build into
# <repo>/target/previous-release, reused by later runs), makes a database of its own on the
# PostgreSQL at 127.0.0.1:5432 (user postgres, trust on loopback: scripts/services starts it),
# and runs upgrade.py (the replicas, the load, the lock-wait check, the replacements, the
# figures). The new release is IDEMPOTENCY_COORDINATOR_BIN, else
# <repo>/target/debug/idempotency-coordinator. The Python side runs in deploy/upgrade/.venv (the
# client from this checkout, the failover suite's pinned tools), checked with ruff and
# mypy --strict first; it imports the failover suite's modules from deploy/ha. Everything it
# starts is torn down on exit, and its database dropped; a run killed before it could clean up
# is cleaned up by the next one, first. Logs go to /tmp/idempotency-upgrade-logs, kept after a
# failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# $repo, $started_at, $BIN (the coordinator binary, absolute).
# shellcheck source=../suite_start.sh
source "$here/../suite_start.sh"

SERVER_URL=postgres://postgres@127.0.0.1:5432
DATABASE_PREFIX=idempotency_upgrade_
LOG_DIR=/tmp/idempotency-upgrade-logs
LOCK_FILE=/tmp/idempotency-upgrade.lock
WORK_PARENT=/tmp
WORK_PREFIX=idempotency-upgrade.
PREVIOUS_DIR=$repo/target/previous-release
PREVIOUS_SOURCE=$PREVIOUS_DIR/source
PREVIOUS_BIN=$PREVIOUS_DIR/debug/idempotency-coordinator
# The commit the previous binary was built from: a later run with the same commit skips cargo.
PREVIOUS_STAMP=$PREVIOUS_DIR/built-from

log() { echo "upgrade: $*" >&2; }
die() { log "$*"; exit 1; }
psql_server() { PGCONNECT_TIMEOUT=5 psql -X -q -t -A -v ON_ERROR_STOP=1 "$SERVER_URL/postgres" "$@"; }

# ---------------------------------------------------------------------------------------------
# Before anything: the binary, the previous release's commit, PostgreSQL.

[ -x "$BIN" ] || die "no coordinator binary at $BIN: build it (cargo build) or set IDEMPOTENCY_COORDINATOR_BIN"
previous=$(grep -v '^#' "$here/PREVIOUS_RELEASE" | tr -d '[:space:]')
[[ "$previous" =~ ^[0-9a-f]{40}$ ]] || die "deploy/upgrade/PREVIOUS_RELEASE holds no full commit hash ('$previous')"
if ! git -C "$repo" cat-file -e "$previous^{commit}" 2>/dev/null; then
  shallow=$(git -C "$repo" rev-parse --is-shallow-repository 2>/dev/null || echo "not a git checkout")
  die "the previous release's commit $previous is not in this clone (shallow: $shallow): fetch the history (git fetch --unshallow) or at least that commit (git fetch origin $previous)"
fi
command -v psql >/dev/null 2>&1 || die "psql is missing: run scripts/services (it installs PostgreSQL 15)"
if ! psql_server -c 'SELECT 1' >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || die "PostgreSQL does not answer at 127.0.0.1:5432: run scripts/services as root"
  log "PostgreSQL does not answer at 127.0.0.1:5432: running scripts/services"
  "$repo/scripts/services"
  psql_server -c 'SELECT 1' >/dev/null || die "PostgreSQL still does not answer at 127.0.0.1:5432"
fi

# One run at a time: the names above are fixed, and a run's start cleans up what an earlier one
# left. The lock is this shell's alone: every process started below gets `9>&-`, so that one
# left behind by a killed run cannot keep the next run out.
exec 9>"$LOCK_FILE"
flock -n 9 || die "another run of this suite holds $LOCK_FILE"

# ---------------------------------------------------------------------------------------------
# The Python side first (nothing started yet): the venv, then ruff and mypy, over this suite and
# the failover suite's modules it imports.

cd "$here"
# shellcheck source=../suite_venv.sh
source ../suite_venv.sh ../ha/requirements.txt
log "venv ready, ruff and mypy --strict clean ($((SECONDS - started_at)) s)"

# ---------------------------------------------------------------------------------------------
# Leftovers of an earlier run, and the teardown of this one: the processes its pid files name
# (checked to be still the ones started), its databases (every database with this suite's
# prefix: the lock says no other run is using one), its work folders, the previous release's
# extracted source.

# kill_recorded: $1 = pid file; kills its process if it still runs the command the file names.
# shellcheck source=../processes.sh
source ../processes.sh

clean_up() {
  local folder file database
  for folder in "$WORK_PARENT/$WORK_PREFIX"*; do
    [ -d "$folder" ] || continue
    for file in "$folder"/pids/*.pid; do
      if [ -e "$file" ]; then kill_recorded "$file"; fi
    done
    rm -rf "$folder"
  done
  for database in $(psql_server -c "SELECT datname FROM pg_database WHERE datname LIKE '${DATABASE_PREFIX}%'" 2>/dev/null); do
    psql_server -c "DROP DATABASE IF EXISTS \"$database\" WITH (FORCE)" >/dev/null 2>&1 \
      || log "could not drop the database $database"
  done
  rm -rf "$PREVIOUS_SOURCE"
}

clean_up
tear_down_on_exit "everything torn down, the database dropped"
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"

# ---------------------------------------------------------------------------------------------
# The previous release: the commit's tree, built into a target folder of its own. The source is
# extracted to the same place every time, with the commit's own file times (git archive), so
# that a later build reuses every dependency (only the workspace's own crates are rebuilt, in
# seconds); after a build of this commit the stamp lets later runs skip cargo altogether.

if [ "$(cat "$PREVIOUS_STAMP" 2>/dev/null)" = "$previous" ] && [ -x "$PREVIOUS_BIN" ]; then
  log "previous release ${previous:0:12}: built before ($PREVIOUS_BIN)"
else
  build_started=$SECONDS
  mkdir -p "$PREVIOUS_SOURCE"
  git -C "$repo" archive "$previous" | tar -x -C "$PREVIOUS_SOURCE"
  log "building the previous release ${previous:0:12} into $PREVIOUS_DIR (nice; a cold build takes minutes)"
  (cd "$PREVIOUS_SOURCE" && CARGO_TARGET_DIR="$PREVIOUS_DIR" nice -n 10 \
    cargo build --locked --bin idempotency-coordinator 9>&-)
  rm -rf "$PREVIOUS_SOURCE"
  echo "$previous" >"$PREVIOUS_STAMP"
  log "previous release built in $((SECONDS - build_started)) s"
fi

# ---------------------------------------------------------------------------------------------
# The scenario, in a database of its own (the previous release's migrate creates it).

database="$DATABASE_PREFIX$(date +%s)_$$"
work=$(mktemp -d "$WORK_PARENT/${WORK_PREFIX}XXXXXX")
mkdir -p "$work/pids"
log "new release: $BIN; previous release: $PREVIOUS_BIN (${previous:0:12}); database $database"
PYTHONPATH="$here/../ha" "$venv/bin/python" -u upgrade.py \
  --work "$work" --logs "$LOG_DIR" --binary "$BIN" --previous "$PREVIOUS_BIN" \
  --database-url "$SERVER_URL/$database" --migrations "$repo/migrations/postgres" 9>&-
