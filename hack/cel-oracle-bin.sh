#!/usr/bin/env bash
# Makes sure cel-oracle (hack/cel-oracle: Kubernetes' own DRA CEL library,
# k8s.io/dynamic-resource-allocation/cel, as kube-apiserver and kube-scheduler run it) exists for
# each Kubernetes release gpudra supports (hack/cel-oracle/v1.*: one pinned module each, sharing
# main.go) and prints the last one's directory as the last line. The CEL tests ask each for the
# estimated cost, the match and the actual cost of each case and compare gpudra's Python evaluator,
# set to that release, with its answers (tests/celoracle.py).
#
# Each is cached under ~/.cache/gpudra/cel-oracle/<hash of its main.go, go.mod and go.sum>
# (tests/celoracle.py computes the same path), else built from those pinned modules. Progress goes
# to stderr; only the directories go to stdout.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOL=cel-oracle-bin
BINARIES=(cel-oracle)
source "$HACK_DIR/lib/cached-tool.sh"
for release in "$HACK_DIR"/cel-oracle/v1.*/; do
  # a subshell each: the helpers exit once the binary is there
  (build_pinned_go_tool "${release%/}" cel-oracle "" k8s.io/dynamic-resource-allocation cel-oracle)
done
