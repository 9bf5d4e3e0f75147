#!/usr/bin/env bash
# Regenerates the committed protobuf modules: the kubelet plugin's gRPC stubs (from its own .proto
# files) and the fake container runtime's of the real-kubelet tests (tests/fakecri/protos/api.proto, copied
# unchanged from k8s.io/cri-api at the tested Kubernetes release).
# Needs the `dev` extra (pinned grpcio-tools): pip install -e '.[dev]'.
# The -I mappings make the generated modules import each other as gpudra_driver.plugin.gen.* and
# fakecri.gen.*.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
src=driver/gpudra_driver/plugin/protos
"$PYTHON" -m grpc_tools.protoc \
  -Igpudra_driver/plugin/gen="$src" \
  --python_out=driver --pyi_out=driver --grpc_python_out=driver \
  "$src/dra_v1.proto" "$src/dra_v1beta1.proto" "$src/pluginregistration.proto" \
  "$src/dra_health_v1alpha1.proto" "$src/dra_health_v1.proto"
"$PYTHON" -m grpc_tools.protoc -Ifakecri/gen=tests/fakecri/protos \
  --python_out=tests --pyi_out=tests --grpc_python_out=tests tests/fakecri/protos/api.proto
echo "regenerated: $(ls driver/gpudra_driver/plugin/gen/*_pb2*.py* tests/fakecri/gen/*_pb2*.py* | tr '\n' ' ')"
