# Sourced (not run) first by the suites' test.sh (deploy/ha, deploy/upgrade), with $here set to
# the suite's folder: what every suite knows before it changes anything.
# shellcheck shell=bash

# The repository, and the start of the wall time the teardown reports (processes.sh).
repo="$(cd "$here/../.." && pwd)"
started_at=$SECONDS

# A relative path is the caller's: made absolute before anything changes the folder.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
# The coordinator binary under test.
BIN="$(absolute "${IDEMPOTENCY_COORDINATOR_BIN:-$repo/target/debug/idempotency-coordinator}")"
