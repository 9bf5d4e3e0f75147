#!/usr/bin/env bash
# The Helm chart (manifests/helm/gpudra) as an OCI artifact: `make chart-package`, `make chart-push`.
#
#   hack/chart.sh package   helm lint --strict, then helm package into $CHART_OUT (default build/chart)
#                           at $CHART_VERSION (default: Chart.yaml's version; appVersion stays Chart.yaml's
#                           unless $CHART_APP_VERSION is set); prints the .tgz's path as the last line.
#   hack/chart.sh push      package, then helm push to $CHART_REGISTRY (oci://host/path: the chart lands
#                           at oci://host/path/gpudra:<version>); $CHART_PUSH_FLAGS go to helm push
#                           (e.g. --ca-file ca.crt); prints helm's "Pushed:" and "Digest:" lines.
# helm: hack/helm-bin.sh (pinned, cached; $GPUDRA_HELM wins). Credentials: `helm registry login`,
# or a docker login (helm falls back to ~/.docker/config.json), as the release workflow does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CHART=manifests/helm/gpudra
CHART_OUT="${CHART_OUT:-build/chart}"
CHART_VERSION="${CHART_VERSION:-$(sed -n 's/^version: *//p' "$CHART/Chart.yaml")}"
log() { printf '[chart] %s\n' "$*" >&2; }

helm="$(hack/helm-bin.sh | tail -n 1)"
[[ -n "$CHART_VERSION" ]] || { log "no version: Chart.yaml has none and CHART_VERSION is unset"; exit 1; }

package() {
  "$helm" lint --strict "$CHART" ${KUBE_VERSION:+--kube-version "$KUBE_VERSION"} >&2
  mkdir -p "$CHART_OUT"
  rm -f "$CHART_OUT/gpudra-$CHART_VERSION.tgz"
  "$helm" package "$CHART" --destination "$CHART_OUT" --version "$CHART_VERSION" \
    ${CHART_APP_VERSION:+--app-version "$CHART_APP_VERSION"} >&2
  local tgz="$CHART_OUT/gpudra-$CHART_VERSION.tgz"
  [[ -f "$tgz" ]] || { log "FAILED: helm package wrote no $tgz"; exit 1; }
  log "packaged $tgz (sha256 $(sha256sum "$tgz" | cut -c1-64))"
  echo "$tgz"
}

case "${1:-}" in
  package) package ;;
  push)
    [[ "${CHART_REGISTRY:-}" == oci://?* ]] || {
      log "CHART_REGISTRY must name an OCI registry path, e.g. make chart-push CHART_REGISTRY=oci://ghcr.io/gpudra/charts (got '${CHART_REGISTRY:-}')"
      exit 1; }
    tgz="$(package | tail -n 1)"
    # shellcheck disable=SC2086  # CHART_PUSH_FLAGS is a list of flags
    "$helm" push "$tgz" "$CHART_REGISTRY" ${CHART_PUSH_FLAGS:-} 2>&1
    ;;
  *) log "usage: hack/chart.sh package|push"; exit 2 ;;
esac
