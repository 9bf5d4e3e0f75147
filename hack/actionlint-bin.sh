#!/usr/bin/env bash
# Makes sure rhysd/actionlint exists and prints its directory as the last line. `make actionlint`
# and tests/integration/test_release_pipeline.py check .github/workflows/*.yml with it; make test
# passes GPUDRA_ACTIONLINT_DIR.
#
# Order: $GPUDRA_ACTIONLINT_DIR (if it has the binary) -> the version-keyed cache -> a build of
# github.com/rhysd/actionlint's ./cmd/actionlint at ACTIONLINT_VERSION from the Go module proxy
# (under a minute on 2 cores the first time, then cached). Progress goes to stderr; only the
# directory goes to stdout.
set -euo pipefail

ACTIONLINT_VERSION="${ACTIONLINT_VERSION:-v1.7.12}"
MODULE=github.com/rhysd/actionlint
TOOL=actionlint-bin
BINARIES=(actionlint)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/actionlint/$ACTIONLINT_VERSION"

use_given_dir GPUDRA_ACTIONLINT_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $ACTIONLINT_VERSION" GPUDRA_ACTIONLINT_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building actionlint ($MODULE $ACTIONLINT_VERSION) from the Go module proxy (first time only)"
# In the module's own directory, so that its go.mod and go.sum decide every dependency (as
# hack/promtool-bin.sh does: no `go install ...@version`, which also asks for the version list).
fix="with Go and the proxy at hand, rerun \`make actionlint\`, or set GPUDRA_ACTIONLINT_DIR to a directory with actionlint"
download="$(cd "$STAGE" && GOFLAGS= go mod download -json "$MODULE@$ACTIONLINT_VERSION" 2>&1)" || true
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")"
[[ "$src" == *"@$ACTIONLINT_VERSION" && -f "$src/go.mod" ]] || {
  log "FAILED: go mod download $MODULE@$ACTIONLINT_VERSION (GOPROXY=$(go env GOPROXY)): $download"
  log "$fix"; exit 1; }
# The version stamp is what `actionlint -version` prints (actionlint's own release build sets it so).
(cd "$src" && CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly go build -trimpath \
  -ldflags "-s -w -X $MODULE.version=$ACTIONLINT_VERSION" \
  -o "$STAGE/actionlint" ./cmd/actionlint >&2) || {
  log "FAILED: go build in $src (needs Go >= 1.25 and the Go module proxy, GOPROXY=$(go env GOPROXY))"
  log "$fix"; exit 1; }
has_all "$STAGE" || { log "FAILED: no actionlint in $STAGE"; exit 1; }
mv -f "$STAGE/actionlint" "$BIN_DIR/actionlint"
log "built in $((SECONDS - start)) s: $("$BIN_DIR/actionlint" -version 2>/dev/null | head -n 1 || echo "$BIN_DIR/actionlint")"
echo "$BIN_DIR"
