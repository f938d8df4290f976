#!/usr/bin/env bash
# The whole check of the Go client, on a fresh machine (Go 1.26; PostgreSQL at 127.0.0.1:5432
# with trust auth and psql, as scripts/services makes it; Debian's protoc):
#   1. installs the pinned tools from the Go module proxy into ./bin (once per version);
#   2. regenerates the stubs into a temporary folder and fails if they differ from the committed
#      ones in idempotencyv1/;
#   3. go mod tidy -diff, gofmt -l, go vet, staticcheck;
#   4. go test -race against the real binaries, each test starting its own coordinator on port 0
#      (PostgreSQL and SQLite) and, for the middleware, the real gateway; the scenario vectors
#      with the fault-proxy between the client and the coordinator.
# The binaries come from IDEMPOTENCY_COORDINATOR_BIN (default: the repository's
# target/debug/idempotency-coordinator) and IDEMPOTENCY_GATEWAY_BIN (default:
# target/debug/idempotency-gateway; when that does not exist, the coordinator's own `gateway`
# subcommand is used); the scenario vectors' fault proxy from FAULT_PROXY_BIN (default:
# target/debug/fault-proxy).
set -euo pipefail
cd "$(dirname "$0")"
here=$(pwd)
repo_root=$(cd ../.. && pwd)

PROTOC_GEN_GO_VERSION=v1.36.12      # the same as google.golang.org/protobuf in go.mod
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
STATICCHECK_VERSION=v0.8.2          # honnef.co/go/tools
MODULE=github.com/idempotency-coordinator/idempotency-coordinator/clients/go

export IDEMPOTENCY_COORDINATOR_BIN="${IDEMPOTENCY_COORDINATOR_BIN:-$repo_root/target/debug/idempotency-coordinator}"
export IDEMPOTENCY_GATEWAY_BIN="${IDEMPOTENCY_GATEWAY_BIN:-$repo_root/target/debug/idempotency-gateway}"
export FAULT_PROXY_BIN="${FAULT_PROXY_BIN:-$repo_root/target/debug/fault-proxy}"
if [ ! -x "$IDEMPOTENCY_COORDINATOR_BIN" ]; then
  echo "no coordinator binary at $IDEMPOTENCY_COORDINATOR_BIN: run cargo build, or set IDEMPOTENCY_COORDINATOR_BIN" >&2
  exit 1
fi
if [ ! -x "$FAULT_PROXY_BIN" ]; then
  echo "no fault-proxy binary at $FAULT_PROXY_BIN: run cargo build, or set FAULT_PROXY_BIN" >&2
  exit 1
fi
if [ ! -x "$IDEMPOTENCY_GATEWAY_BIN" ]; then
  echo "no gateway binary at $IDEMPOTENCY_GATEWAY_BIN: using '$IDEMPOTENCY_COORDINATOR_BIN gateway'" >&2
  unset IDEMPOTENCY_GATEWAY_BIN
fi
if ! psql "postgres://postgres@127.0.0.1:5432/postgres" -X -q -t -A -c 'SELECT 1' >/dev/null 2>&1; then
  echo "PostgreSQL does not answer at 127.0.0.1:5432 as postgres: run scripts/services (as root)" >&2
  exit 1
fi

# 1. Tools, each installed once per version (a stamp beside it says which).
export GOBIN="$here/bin"
mkdir -p "$GOBIN"
install_tool() { # name package version
  if [ "$(cat "$GOBIN/.$1.version" 2>/dev/null)" != "$3" ] || [ ! -x "$GOBIN/$1" ]; then
    echo "installing $2@$3" >&2
    go install "$2@$3"
    echo "$3" > "$GOBIN/.$1.version"
  fi
}
install_tool protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION"
install_tool protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"
install_tool staticcheck honnef.co/go/tools/cmd/staticcheck "$STATICCHECK_VERSION"

# 2. The committed stubs are what the proto and the pinned generators make. protoc is Debian's
#    (protobuf-compiler); the well-known types it imports are in Debian's libprotobuf-dev.
command -v protoc >/dev/null || { echo "no protoc: apt-get install protobuf-compiler" >&2; exit 1; }
wkt=/usr/include
if [ ! -f "$wkt/google/protobuf/duration.proto" ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get install -y -q --no-install-recommends libprotobuf-dev >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends libprotobuf-dev >/dev/null; }
  else
    echo "no google/protobuf/duration.proto: apt-get install libprotobuf-dev (as root)" >&2
    exit 1
  fi
fi
generate_into() {
  PATH="$GOBIN:$PATH" protoc -I "$repo_root/proto" -I "$wkt" \
    --go_out="$1" --go_opt=module="$MODULE" \
    --go-grpc_out="$1" --go-grpc_opt=module="$MODULE" \
    "$repo_root/proto/idempotency/v1/idempotency.proto"
}
if [ "${1:-}" = "--generate" ]; then
  generate_into "$here"
  echo "regenerated idempotencyv1/"
  exit 0
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
generate_into "$scratch"
if ! diff -ru idempotencyv1 "$scratch/idempotencyv1"; then
  echo "the stubs in idempotencyv1/ differ from the proto: run clients/go/test.sh --generate and commit" >&2
  exit 1
fi
echo "generated stubs match the proto"

# 3. Static checks.
go mod tidy -diff
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
  echo "not gofmt'd:" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet ./...
"$GOBIN/staticcheck" ./...
echo "go vet and staticcheck: clean"

# 4. The tests, against the real binaries.
go test -race -count=1 -timeout 4m ./...
