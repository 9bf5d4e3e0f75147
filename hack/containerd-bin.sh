#!/usr/bin/env bash
# Makes sure containerd, containerd-shim-runc-v2 and ctr (and crictl) exist and prints their
# directory as the last line. Used by the real-runtime e2e test (tests/e2e/test_real_runtime.py).
#
# Order: $GPUDRA_CONTAINERD_DIR (if it has everything) -> the version-keyed cache -> a build of
# github.com/containerd/containerd/v2 at CONTAINERD_VERSION (and sigs.k8s.io/cri-tools' crictl at
# CRICTL_VERSION) from the Go module proxy: about 4-5 minutes on 2 cores the first time, then cached.
# Static (CGO_ENABLED=0), without btrfs. Debian's bookworm containerd (1.6) has no CDI; runc comes
# from Debian (hack/debian-packages.sh). Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.2.9}"
CRICTL_VERSION="${CRICTL_VERSION:-v1.34.0}"
TOOL=containerd-bin
BINARIES=(containerd containerd-shim-runc-v2 ctr crictl)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/containerd/$CONTAINERD_VERSION"

use_given_dir GPUDRA_CONTAINERD_DIR
if has_all "$BIN_DIR" && [[ "$("$BIN_DIR/containerd" --version 2>/dev/null)" == *" $CONTAINERD_VERSION "* ]]; then
  log "cached: $BIN_DIR"
  echo "$BIN_DIR"; exit 0
fi
require_go "containerd $CONTAINERD_VERSION" GPUDRA_CONTAINERD_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building containerd, containerd-shim-runc-v2, ctr $CONTAINERD_VERSION from the Go module proxy (first time only: ~4-5 min on 2 cores)"
# Outside any module, so the pinned version's own go.mod decides every dependency. The version
# stamp is what `containerd --version` prints (and what the cache check above reads).
pkg=github.com/containerd/containerd/v2
(cd "$STAGE" && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$STAGE" go install -trimpath -tags no_btrfs \
  -ldflags "-s -w -X $pkg/version.Version=$CONTAINERD_VERSION -X $pkg/version.Revision=module" \
  "$pkg/cmd/containerd@$CONTAINERD_VERSION" "$pkg/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
  "$pkg/cmd/ctr@$CONTAINERD_VERSION" >&2)
log "containerd built in $((SECONDS - start)) s"
start=$SECONDS
log "building crictl $CRICTL_VERSION (~2 min the first time)"
(cd "$STAGE" && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$STAGE" go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
  "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION" >&2)
log "crictl built in $((SECONDS - start)) s"
has_all "$STAGE" || { log "FAILED: missing binaries in $STAGE"; exit 1; }
for b in "${BINARIES[@]}"; do mv -f "$STAGE/$b" "$BIN_DIR/$b"; done
log "ready: $("$BIN_DIR/containerd" --version)"
echo "$BIN_DIR"
