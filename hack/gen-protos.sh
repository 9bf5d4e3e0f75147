#!/usr/bin/env bash
# Regenerates the committed gRPC stubs of the kubelet plugin from its .proto files.
# Needs the `dev` extra (pinned grpcio-tools): pip install -e '.[dev]'.
# The -I mapping makes the generated modules import each other as gpudra_driver.plugin.gen.*.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
src=driver/gpudra_driver/plugin/protos
"$PYTHON" -m grpc_tools.protoc \
  -Igpudra_driver/plugin/gen="$src" \
  --python_out=driver --pyi_out=driver --grpc_python_out=driver \
  "$src/dra_v1.proto" "$src/dra_v1beta1.proto" "$src/pluginregistration.proto"
echo "regenerated: $(ls driver/gpudra_driver/plugin/gen/*_pb2*.py* | tr '\n' ' ')"
