#!/usr/bin/env bash
# Makes sure Anchore's syft (https://github.com/anchore/syft) exists and prints its directory as the
# last line. `make sbom-images` (hack/sbom-images.sh) writes the images' CycloneDX SBOMs with it,
# and tests/integration/test_release_pipeline.py checks them; make test passes GPUDRA_SYFT_DIR.
#
# Order: $GPUDRA_SYFT_DIR (if it has the binary) -> the version-keyed cache -> a build of
# github.com/anchore/syft's ./cmd/syft at SYFT_VERSION from the Go module proxy (the first time only:
# about 2 GB of modules and 10 CPU-minutes, 9 minutes on 2 shared cores; then cached). Progress goes
# to stderr; only the directory goes to stdout.
set -euo pipefail

SYFT_VERSION="${SYFT_VERSION:-v1.57.2}"
MODULE=github.com/anchore/syft
TOOL=syft-bin
BINARIES=(syft)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/syft/$SYFT_VERSION"

use_given_dir GPUDRA_SYFT_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $SYFT_VERSION" GPUDRA_SYFT_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building syft ($MODULE $SYFT_VERSION) from the Go module proxy (first time only: about 10 CPU-minutes)"
# In the module's own directory, so that its go.mod and go.sum decide every dependency (as
# hack/promtool-bin.sh does: no `go install ...@version`, which also asks for the version list).
fix="with Go and the proxy at hand, rerun \`make syft\`, or set GPUDRA_SYFT_DIR to a directory with syft"
download="$(cd "$STAGE" && GOFLAGS= go mod download -json "$MODULE@$SYFT_VERSION" 2>&1)" || true
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")"
[[ "$src" == *"@$SYFT_VERSION" && -f "$src/go.mod" ]] || {
  log "FAILED: go mod download $MODULE@$SYFT_VERSION (GOPROXY=$(go env GOPROXY)): $download"
  log "$fix"; exit 1; }
# Build tags and version stamp as syft's own release build (.goreleaser.yaml): pure Go, no cgo
# (containers_image_openpgp: the Go OpenPGP, not gpgme; no btrfs graph driver). The version is
# what `syft version` prints and what each SBOM names as its tool.
(cd "$src" && CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly go build -trimpath \
  -tags containers_image_openpgp,exclude_graphdriver_btrfs \
  -ldflags "-s -w -X main.version=${SYFT_VERSION#v}" \
  -o "$STAGE/syft" ./cmd/syft >&2) || {
  log "FAILED: go build in $src (needs Go >= $(sed -n 's/^go //p' "$src/go.mod") and the Go module proxy, GOPROXY=$(go env GOPROXY))"
  log "$fix"; exit 1; }
has_all "$STAGE" || { log "FAILED: no syft in $STAGE"; exit 1; }
mv -f "$STAGE/syft" "$BIN_DIR/syft"
log "built in $((SECONDS - start)) s: $("$BIN_DIR/syft" version 2>/dev/null | sed -n 's/^Version: *//p' || echo "$BIN_DIR/syft")"
echo "$BIN_DIR"
