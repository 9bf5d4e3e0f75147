#!/usr/bin/env bash
# Makes sure Prometheus' promtool exists and prints its directory as the last line. The tests check
# the PrometheusRule and the Grafana dashboard's PromQL with it (`promtool check rules`) and run the
# alerts' unit tests (`promtool test rules`, tests/monitoring/); make test passes GPUDRA_PROMTOOL_DIR.
#
# Order: $GPUDRA_PROMTOOL_DIR (if it has the binary) -> the version-keyed cache -> a build of
# github.com/prometheus/prometheus's ./cmd/promtool at PROMETHEUS_VERSION from the Go module proxy
# (a few minutes on 2 cores the first time, then cached). Progress goes to stderr; only the
# directory goes to stdout.
set -euo pipefail

# The Go module's version of Prometheus 3.x: v0.<major><minor>.<patch> (v0.316.0 is Prometheus 3.16.0).
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
MODULE=github.com/prometheus/prometheus
TOOL=promtool-bin
BINARIES=(promtool)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/promtool/$PROMETHEUS_VERSION"

use_given_dir GPUDRA_PROMTOOL_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $PROMETHEUS_VERSION" GPUDRA_PROMTOOL_DIR
new_stage "$BIN_DIR"

start=$SECONDS
log "building promtool ($MODULE $PROMETHEUS_VERSION) from the Go module proxy (first time only: a few minutes on 2 cores)"
# In the module's own directory (downloaded into the module cache), so that its go.mod and go.sum
# decide every dependency (GOWORK=off: the module ships a go.work naming folders its zip leaves out).
# Not `go install ...@version`: that also asks the proxy for the module's
# version list (for deprecations), which a proxy serving pinned versions only may refuse.
fix="with Go and the proxy at hand, rerun \`make promtool\`, or set GPUDRA_PROMTOOL_DIR to a directory with promtool"
download="$(cd "$STAGE" && GOFLAGS= go mod download -json "$MODULE@$PROMETHEUS_VERSION" 2>&1)" || true
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")"
[[ "$src" == *"@$PROMETHEUS_VERSION" && -f "$src/go.mod" ]] || {
  log "FAILED: go mod download $MODULE@$PROMETHEUS_VERSION (GOPROXY=$(go env GOPROXY)): $download"
  log "$fix"; exit 1; }
# The version stamp is what `promtool --version` prints (Prometheus' own Makefile sets it the same way).
release="$(sed -E 's/^v0\.([0-9])([0-9]+)\.([0-9]+)$/\1.\2.\3/' <<<"$PROMETHEUS_VERSION")"
(cd "$src" && CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly go build -trimpath \
  -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
  -o "$STAGE/promtool" ./cmd/promtool >&2) || {
  log "FAILED: go build in $src (needs Go >= 1.26 and the Go module proxy, GOPROXY=$(go env GOPROXY))"
  log "$fix"; exit 1; }
has_all "$STAGE" || { log "FAILED: no promtool in $STAGE"; exit 1; }
mv -f "$STAGE/promtool" "$BIN_DIR/promtool"
log "built in $((SECONDS - start)) s: $("$BIN_DIR/promtool" --version 2>/dev/null | head -n 1 || echo "$BIN_DIR/promtool")"
echo "$BIN_DIR"
