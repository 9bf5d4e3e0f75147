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
HASH="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-16)"
BIN_DIR="$CACHE_ROOT/cel-oracle/$HASH"

use_given_dir GPUDRA_CEL_ORACLE_DIR
use_cached "$BIN_DIR"
require_go cel-oracle GPUDRA_CEL_ORACLE_DIR
new_stage "$BIN_DIR"
start=$SECONDS
log "building cel-oracle ($(go -C "$SRC" list -m -f '{{.Path}} {{.Version}}' k8s.io/dynamic-resource-allocation)) from the Go module proxy"
(cd "$SRC" && CGO_ENABLED=0 go build -trimpath -mod=readonly -ldflags "-s -w" -o "$STAGE/cel-oracle" . >&2)
mv -f "$STAGE/cel-oracle" "$BIN_DIR/cel-oracle"
log "built in $((SECONDS - start)) s: $BIN_DIR/cel-oracle"
echo "$BIN_DIR"
