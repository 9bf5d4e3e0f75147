#!/usr/bin/env bash
# Makes sure cdi-validate (hack/cdi-tools: the official CDI Go library as a validator) exists and
# prints its directory as the last line. The tests run it on every CDI spec they validate
# (tests/cdispec.py), so a spec the runtimes' own CDI code would reject fails the test.
#
# Order: $GPUDRA_CDI_TOOLS_DIR (if it has cdi-validate) -> the cache, keyed by a hash of
# hack/cdi-tools/{go.mod,go.sum,main.go} (tests/cdispec.py computes the same path) -> a build from
# those pinned modules (a few seconds with a warm Go module cache). Progress goes to stderr; only
# the directory goes to stdout.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$HACK_DIR/cdi-tools"
TOOL=cdi-tools-bin
BINARIES=(cdi-validate)
source "$HACK_DIR/lib/cached-tool.sh"
build_pinned_go_tool "$SRC" cdi-validate GPUDRA_CDI_TOOLS_DIR tags.cncf.io/container-device-interface
