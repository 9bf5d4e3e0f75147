#!/usr/bin/env bash
# Makes sure a helm binary exists (for the chart tests) and prints its path as the last line.
#
# Order: $GPUDRA_HELM -> the version-keyed cache -> a build of helm.sh/helm/v3 at HELM_VERSION
# from the Go module proxy (about 10 minutes on 2 cores the first time, then cached).
# Progress goes to stderr; only the path goes to stdout.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}"
BIN_DIR="$CACHE_ROOT/helm/$HELM_VERSION"

log() { printf '[helm-bin] %s\n' "$*" >&2; }

if [[ -n "${GPUDRA_HELM:-}" && -x "${GPUDRA_HELM}" ]]; then
  log "using \$GPUDRA_HELM=$GPUDRA_HELM"
  echo "$GPUDRA_HELM"; exit 0
fi
if [[ -x "$BIN_DIR/helm" ]]; then
  log "cached: $BIN_DIR/helm"
  echo "$BIN_DIR/helm"; exit 0
fi
command -v go >/dev/null || { log "no Go toolchain to build helm $HELM_VERSION: install Go, or set GPUDRA_HELM to a helm binary"; exit 1; }
mkdir -p "$BIN_DIR"
STAGE="$(mktemp -d "$BIN_DIR/.stage.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
log "building helm $HELM_VERSION from the Go module proxy (first time only)"
# Outside any module, so the pinned version's own go.mod decides every dependency.
(cd "$STAGE" && GOFLAGS=-mod=mod GOBIN="$STAGE" go install \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2)
mv "$STAGE/helm" "$BIN_DIR/helm"
log "built: $BIN_DIR/helm ($("$BIN_DIR/helm" version --short 2>/dev/null || echo '?'))"
echo "$BIN_DIR/helm"
