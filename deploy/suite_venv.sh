# Sourced by the suites under deploy/ (the failover and the rolling-upgrade suite), from their own
# folder: the Python venv they run in (clients/python/scripts/venv.sh: $venv, $pip), with the
# pinned tools of $1 (a requirements file) and the client from this checkout, then ruff,
# mypy --strict and, where it is installed, shellcheck of test.sh: nothing runs unchecked.
# shellcheck shell=bash
# shellcheck source=../clients/python/scripts/venv.sh
source ../../clients/python/scripts/venv.sh
"${pip[@]}" install -r "$1"
"${pip[@]}" install ../../clients/python
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" --strict
if command -v shellcheck >/dev/null 2>&1; then
  shellcheck -x test.sh
fi
