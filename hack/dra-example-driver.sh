#!/usr/bin/env bash
# Makes sure Kubernetes' reference DRA driver, dra-example-kubeletplugin (kubernetes-sigs/
# dra-example-driver: the kubelet plugin every DRA driver is modelled on, built on
# k8s.io/dynamic-resource-allocation/kubeletplugin, no NVIDIA code), exists and prints its
# directory as the last line. bench/prepare_latency.py times its NodePrepareResources beside
# gpudra's agent (GPUDRA_DRA_EXAMPLE_DIR, as make bench sets it).
#
# Order: $GPUDRA_DRA_EXAMPLE_DIR (if it has the binary) -> the version-keyed cache -> a build of
# sigs.k8s.io/dra-example-driver at DRA_EXAMPLE_VERSION from the Go module proxy (about two minutes
# on 2 cores the first time, then cached). Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

DRA_EXAMPLE_VERSION="${DRA_EXAMPLE_VERSION:-v0.4.0}"
MODULE=sigs.k8s.io/dra-example-driver
TOOL=dra-example-driver
BINARIES=(dra-example-kubeletplugin)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/dra-example-driver/$DRA_EXAMPLE_VERSION"

use_given_dir GPUDRA_DRA_EXAMPLE_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $DRA_EXAMPLE_VERSION" GPUDRA_DRA_EXAMPLE_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building dra-example-kubeletplugin $DRA_EXAMPLE_VERSION from the Go module proxy (first time only: ~2 min on 2 cores)"
# In the module's own directory (downloaded into the module cache), so that its go.mod and go.sum
# decide every dependency. Not `go install ...@version`: that also asks the proxy for the module's
# version list (for deprecations), which a proxy serving pinned versions only may refuse.
fix="with Go and the proxy at hand, rerun \`make dra-example-driver\`, or set GPUDRA_DRA_EXAMPLE_DIR to a directory with dra-example-kubeletplugin"
download="$(cd "$STAGE" && GOFLAGS= go mod download -json "$MODULE@$DRA_EXAMPLE_VERSION" 2>&1)" || true
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")"
[[ "$src" == *"@$DRA_EXAMPLE_VERSION" && -f "$src/go.mod" ]] || {
  log "FAILED: go mod download $MODULE@$DRA_EXAMPLE_VERSION (GOPROXY=$(go env GOPROXY)): $download"
  log "$fix"; exit 1; }
(cd "$src" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" \
  -o "$STAGE/dra-example-kubeletplugin" ./cmd/dra-example-kubeletplugin >&2) || {
  log "FAILED: go build in $src (needs Go >= 1.26 and the Go module proxy, GOPROXY=$(go env GOPROXY))"
  log "$fix"; exit 1; }
has_all "$STAGE" || { log "FAILED: no dra-example-kubeletplugin in $STAGE"; exit 1; }
mv -f "$STAGE/dra-example-kubeletplugin" "$BIN_DIR/dra-example-kubeletplugin"
log "built in $((SECONDS - start)) s: $BIN_DIR ($MODULE $DRA_EXAMPLE_VERSION)"
echo "$BIN_DIR"
