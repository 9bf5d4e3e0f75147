#!/usr/bin/env bash
# Makes sure cel-oracle (hack/cel-oracle: Kubernetes' own DRA CEL library,
# k8s.io/dynamic-resource-allocation/cel, as kube-apiserver and kube-scheduler run it) exists and
# prints its directory as the last line. The CEL tests ask it for the estimated cost, the match
# and the actual cost of each case and compare gpudra's Python evaluator with its answers
# (tests/celoracle.py).
#
# Order: $GPUDRA_CEL_ORACLE_DIR (if it has cel-oracle) -> the cache, keyed by a hash of
# hack/cel-oracle/{go.mod,go.sum,main.go} (tests/celoracle.py computes the same path) -> a build
# from those pinned modules. Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$HACK_DIR/cel-oracle"
TOOL=cel-oracle-bin
BINARIES=(cel-oracle)
source "$HACK_DIR/lib/cached-tool.sh"
build_pinned_go_tool "$SRC" cel-oracle GPUDRA_CEL_ORACLE_DIR k8s.io/dynamic-resource-allocation
