#!/usr/bin/env bash
# The orders example's whole check, on a fresh machine with Python 3.11 and pip: makes a
# virtualenv in examples/orders/.venv, installs the Python client from this checkout, the
# example and the pinned tools, then runs ruff, mypy --strict and the scenarios (pytest), which
# need PostgreSQL at 127.0.0.1:5432 (trust auth, user postgres) and RabbitMQ at 127.0.0.1:5672
# (guest/guest).
#
# The coordinator binary comes from IDEMPOTENCY_COORDINATOR_BIN, else
# <repo>/target/debug/idempotency-coordinator. EXAMPLE_ORDERS sets the orders per scenario
# (60 by default, so the run stays within a few minutes; the README's manual run uses 500).
# Extra arguments go to pytest (e.g. `examples/orders/test.sh -k relay`).
set -euo pipefail
cd "$(dirname "$0")"

# shellcheck source=../../clients/python/scripts/venv.sh
source ../../clients/python/scripts/venv.sh
"${pip[@]}" install ../../clients/python
"${pip[@]}" install -r requirements-test.txt
# Not editable, and rebuilt every run: the scenarios run the example as pip installs it.
"${pip[@]}" install --force-reinstall --no-deps .

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
answers 5432 || { echo "PostgreSQL is not answering on 127.0.0.1:5432" >&2; exit 1; }
answers 5672 || { echo "RabbitMQ is not answering on 127.0.0.1:5672" >&2; exit 1; }

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" --strict
"$venv/bin/python" -m pytest "$@"
