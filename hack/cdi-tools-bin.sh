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
HASH="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-16)"
BIN_DIR="$CACHE_ROOT/cdi-tools/$HASH"

use_given_dir GPUDRA_CDI_TOOLS_DIR
use_cached "$BIN_DIR"
require_go cdi-validate GPUDRA_CDI_TOOLS_DIR
new_stage "$BIN_DIR"
start=$SECONDS
log "building cdi-validate ($(go -C "$SRC" list -m -f '{{.Path}} {{.Version}}' tags.cncf.io/container-device-interface)) from the Go module proxy"
(cd "$SRC" && CGO_ENABLED=0 go build -trimpath -mod=readonly -ldflags "-s -w" -o "$STAGE/cdi-validate" . >&2)
mv -f "$STAGE/cdi-validate" "$BIN_DIR/cdi-validate"
log "built in $((SECONDS - start)) s: $BIN_DIR/cdi-validate"
echo "$BIN_DIR"
