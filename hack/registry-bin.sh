#!/usr/bin/env bash
# Makes sure the CNCF Distribution registry (the `registry` binary behind the registry:2/3 images)
# exists and prints its directory as the last line. The README's getting-started test pushes the
# images to it and the test node's containerd pulls them from it (tests/e2e/test_getting_started.py).
#
# Order: $GPUDRA_REGISTRY_DIR (if it has the binary) -> the version-keyed cache -> a build of
# github.com/distribution/distribution/v3 at REGISTRY_VERSION from the Go module proxy (about three
# minutes on 2 cores the first time, then cached). Progress goes to stderr; only the directory goes
# to stdout.
set -euo pipefail

REGISTRY_VERSION="${REGISTRY_VERSION:-v3.1.2}"
MODULE=github.com/distribution/distribution/v3
TOOL=registry-bin
BINARIES=(registry)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/registry/$REGISTRY_VERSION"

use_given_dir GPUDRA_REGISTRY_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $REGISTRY_VERSION" GPUDRA_REGISTRY_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building registry $REGISTRY_VERSION from the Go module proxy (first time only: ~3 min on 2 cores)"
# Outside any module, so the pinned version's own go.mod decides every dependency. The version
# stamp is what `registry --version` prints.
(cd "$STAGE" && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$STAGE" go install -trimpath \
  -ldflags "-s -w -X $MODULE/version.version=$REGISTRY_VERSION" "$MODULE/cmd/registry@$REGISTRY_VERSION" >&2)
has_all "$STAGE" || { log "FAILED: no registry binary in $STAGE"; exit 1; }
mv -f "$STAGE/registry" "$BIN_DIR/registry"
log "built in $((SECONDS - start)) s: $("$BIN_DIR/registry" --version 2>/dev/null || echo "$BIN_DIR/registry")"
echo "$BIN_DIR"
