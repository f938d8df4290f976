#!/usr/bin/env bash
# The Python client's whole check, on a fresh machine with Python 3.10+ and pip: makes a
# virtualenv in clients/python/.venv, installs the package and the pinned test tools from PyPI,
# checks the committed generated stubs against the proto, then runs ruff, mypy --strict and
# pytest against the real coordinator binary on PostgreSQL (127.0.0.1:5432) and SQLite, and the
# scenario vectors (clients/conformance/scenarios.json) through fault-proxy.
#
# The binaries come from IDEMPOTENCY_COORDINATOR_BIN, else <repo>/target/debug/idempotency-coordinator,
# and FAULT_PROXY_BIN, else <repo>/target/debug/fault-proxy (cargo build makes both).
# Extra arguments go to pytest (e.g. `clients/python/test.sh -k lease`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

# A relative path is the caller's: made absolute before leaving the caller's folder.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
IDEMPOTENCY_COORDINATOR_BIN="$(absolute "${IDEMPOTENCY_COORDINATOR_BIN:-$repo/target/debug/idempotency-coordinator}")"
FAULT_PROXY_BIN="$(absolute "${FAULT_PROXY_BIN:-$repo/target/debug/fault-proxy}")"
export IDEMPOTENCY_COORDINATOR_BIN FAULT_PROXY_BIN
for binary in "$IDEMPOTENCY_COORDINATOR_BIN" "$FAULT_PROXY_BIN"; do
  if [[ ! -x "$binary" ]]; then
    echo "no binary at $binary: build it (cargo build) or set IDEMPOTENCY_COORDINATOR_BIN / FAULT_PROXY_BIN" >&2
    exit 1
  fi
done
cd "$here"

# shellcheck source=scripts/venv.sh
source scripts/venv.sh
"${pip[@]}" install -r requirements-test.txt
# Not editable, and rebuilt every run: the tests must pass against the package as pip installs it.
"${pip[@]}" install .
"${pip[@]}" install --force-reinstall --no-deps .

PYTHON="$venv/bin/python" scripts/generate.sh --check
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" --strict
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
