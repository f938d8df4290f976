#!/usr/bin/env bash
# Regenerates the protobuf messages in src/idempotency_client/_proto from the repository's proto.
# With --check, generates into a temporary folder and fails if the committed files differ.
# Needs grpcio-tools (the exact version in requirements-test.txt) in the running Python.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
proto_root="$here/../../proto"
target="$here/src/idempotency_client/_proto"
python="${PYTHON:-python}"

generate_into() {
  "$python" -m grpc_tools.protoc -I "$proto_root" --python_out="$1" --pyi_out="$1" \
    "$proto_root/idempotency/v1/idempotency.proto"
}

if [ "${1:-}" = "--check" ]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  generate_into "$scratch"
  for file in idempotency_pb2.py idempotency_pb2.pyi; do
    if ! diff -u "$target/idempotency/v1/$file" "$scratch/idempotency/v1/$file"; then
      echo "generated $file differs from the proto: run clients/python/scripts/generate.sh and commit" >&2
      exit 1
    fi
  done
  echo "generated stubs match the proto"
else
  generate_into "$target"
fi
