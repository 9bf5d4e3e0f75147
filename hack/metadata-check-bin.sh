#!/usr/bin/env bash
# Makes sure metadata-check (hack/metadata-check/v1.<minor>: the device metadata decoder containers
# use, k8s.io/dynamic-resource-allocation/devicemetadata, of each release that has one) is built,
# and prints one directory per release, the last lines (v1.36 first). The tests decode every device
# metadata file the agent writes with each (tests/metadatacheck.py).
#
# Order, per release: $GPUDRA_METADATA_CHECK_DIR_v1_<minor> (if it has metadata-check) -> the cache,
# ~/.cache/gpudra/metadata-check-v1.<minor>/<hash of go.mod, go.sum, main.go> (the tests compute
# the same path) -> a build from those pinned modules. Progress goes to stderr.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOL=metadata-check-bin
BINARIES=(metadata-check)
for src in "$HACK_DIR"/metadata-check/v1.*/; do
  release="$(basename "$src")"
  # a subshell each: build_pinned_go_tool exits once it has printed the directory
  (source "$HACK_DIR/lib/cached-tool.sh"
   build_pinned_go_tool "${src%/}" metadata-check "GPUDRA_METADATA_CHECK_DIR_${release//./_}" \
     k8s.io/dynamic-resource-allocation "metadata-check-$release")
done
