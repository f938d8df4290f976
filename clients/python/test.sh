#!/usr/bin/env bash
# The Python client's whole check, on a fresh machine with Python 3.10+ and pip: makes a
# virtualenv in clients/python/.venv, installs the package and the pinned test tools from PyPI,
# checks the committed generated stubs against the proto, then runs ruff, mypy --strict and
# pytest against the real coordinator binary on PostgreSQL (127.0.0.1:5432) and SQLite.
#
# The binary comes from IDEMPOTENCY_COORDINATOR_BIN, else <repo>/target/debug/idempotency-coordinator.
# Extra arguments go to pytest (e.g. `clients/python/test.sh -k lease`).
set -euo pipefail
cd "$(dirname "$0")"

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
