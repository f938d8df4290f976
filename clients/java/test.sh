#!/usr/bin/env bash
# The whole check of the Java client on a fresh machine (Java 17, Maven 3.8 and openssl installed; every
# dependency, protoc and the gRPC code generator come from Maven Central): generates the stubs
# from ../../proto, compiles the client with -Xlint:all -Werror (the generated code apart), builds
# its javadoc, and runs the tests against the real coordinator binary, on PostgreSQL
# (postgres://postgres@127.0.0.1:5432, as scripts/services makes it) and on SQLite, the scenario
# vectors of ../conformance/scenarios.json with the workspace's fault-proxy in front of it.
#
#   IDEMPOTENCY_COORDINATOR_BIN  the binary (default <repo>/target/debug/idempotency-coordinator)
#   FAULT_PROXY_BIN              the fault-proxy of the scenario vectors (default <repo>/target/debug/fault-proxy)
#   MAVEN_ARGS                   extra Maven arguments (e.g. -o once the dependencies are cached)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export IDEMPOTENCY_COORDINATOR_BIN="${IDEMPOTENCY_COORDINATOR_BIN:-$repo/target/debug/idempotency-coordinator}"
if [[ ! -x "$IDEMPOTENCY_COORDINATOR_BIN" ]]; then
  echo "no coordinator binary at $IDEMPOTENCY_COORDINATOR_BIN: build it (cargo build) or set IDEMPOTENCY_COORDINATOR_BIN" >&2
  exit 1
fi
export FAULT_PROXY_BIN="${FAULT_PROXY_BIN:-$repo/target/debug/fault-proxy}"
if [[ ! -x "$FAULT_PROXY_BIN" ]]; then
  echo "no fault-proxy binary at $FAULT_PROXY_BIN: build it (cargo build) or set FAULT_PROXY_BIN" >&2
  exit 1
fi
if ! command -v openssl >/dev/null; then
  echo "no openssl on PATH: the TLS tests make their certificates with it" >&2
  exit 1
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "PostgreSQL does not answer at 127.0.0.1:5432 (run scripts/services as root)" >&2
  exit 1
fi
cd "$here"
# shellcheck disable=SC2086
mvn -B -q ${MAVEN_ARGS:-} verify
# Surefire is quiet with -q: print its totals, so that a run that ran no test is plain to see.
# They are counted from the reports' testcases: Surefire 3.5 writes tests="0" (and no failures)
# on the suite of a @ParameterizedClass, while listing each of its testcases.
python3 - "$here/target/surefire-reports" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
tests = failures = skipped = 0
for f in glob.glob(sys.argv[1] + "/TEST-*.xml"):
    for case in ET.parse(f).getroot().iter("testcase"):
        tests += 1
        skipped += case.find("skipped") is not None
        failures += case.find("failure") is not None or case.find("error") is not None
print(f"java client: {tests - failures - skipped} passed, {failures} failed, {skipped} skipped")
sys.exit(1 if failures or tests == 0 else 0)
PY
