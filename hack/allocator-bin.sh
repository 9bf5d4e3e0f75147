#!/usr/bin/env bash
# Makes sure gpudra-allocator (operator/gpudra-allocator: Kubernetes' own DRA allocator and CEL,
# k8s.io/dynamic-resource-allocation, one binary per supported release) is built for GOOS/GOARCH
# (default: this machine's) and prints the directory that holds gpudra-allocator-1.<minor> for each
# release as the last line. `gpudra explain` and the operator run them (GPUDRA_ALLOCATOR_DIR, or
# the wheel's gpudra_operator/bin).
#
#   hack/allocator-bin.sh                      # this machine's
#   GOOS=linux GOARCH=arm64 hack/allocator-bin.sh
#   hack/allocator-bin.sh --into DIR           # also copy them into DIR (the wheel's bin/)
#   VARIANT=lean hack/allocator-bin.sh         # the operator image's: -tags notaintrules,noextendedresources
#
# The lean variant leaves out DeviceTaintRules (Kubernetes' resourceslice tracker links all of
# client-go's API types: 8 MiB more resident memory in the operator pod, which only matches
# selectors) and the claim for extended resources (kube-scheduler's DynamicResources plugin, which
# registers all of the scheduler's gates and metrics); it refuses a request that needs either.
#
# Cached under ~/.cache/gpudra/gpudra-allocator/<hash of the sources>-<os>-<arch>, else built from
# each release's pinned modules (the Go module proxy, or a warm module cache). Static (no cgo):
# a cross build needs nothing but Go. Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$(cd "$HACK_DIR/../operator/gpudra-allocator" && pwd)"
TOOL=allocator-bin
source "$HACK_DIR/lib/cached-tool.sh"

into=""
if [[ "${1:-}" == "--into" ]]; then
  into="${2:?--into needs a directory}"
fi

releases=()
for dir in "$SRC"/v1.*/; do releases+=("$(basename "$dir")"); done
BINARIES=()
for release in "${releases[@]}"; do BINARIES+=("gpudra-allocator-${release#v}"); done

# Into DIR unless it holds these very builds already (its .built file names the cache directory).
copy_into() {
  [[ -n "$into" ]] || return 0
  if [[ "$(cat "$into/.built" 2>/dev/null)" == "$1" ]] && has_all "$into"; then return 0; fi
  mkdir -p "$into"
  rm -f "$into"/gpudra-allocator-1.*
  local b
  for b in "${BINARIES[@]}"; do cp -f "$1/$b" "$into/$b"; done
  echo "$1" > "$into/.built"
  log "copied into $into"
}

variant="${VARIANT:-full}" tags=""
case "$variant" in
  full) ;;
  lean) tags="notaintrules,noextendedresources" ;;
  *) log "VARIANT=$variant: expected full or lean"; exit 2 ;;
esac
goos="${GOOS:-$(go env GOOS 2>/dev/null || uname -s | tr '[:upper:]' '[:lower:]')}"
goarch="${GOARCH:-$(go env GOARCH 2>/dev/null || echo amd64)}"
hash="$(cd "$SRC" && cat ./*.go v1.*/go.mod v1.*/go.sum v1.*/release*.go | sha256sum | cut -c1-16)"
dir="$CACHE_ROOT/gpudra-allocator/$hash-$goos-$goarch$([[ $variant == full ]] || echo "-$variant")"
if has_all "$dir"; then
  log "cached: $dir"
  copy_into "$dir"
  echo "$dir"
  exit 0
fi
require_go "gpudra-allocator" GPUDRA_ALLOCATOR_DIR
new_stage "$dir"
start=$SECONDS
for release in "${releases[@]}"; do
  log "building gpudra-allocator ${release#v} ($variant) for $goos/$goarch ($(go -C "$SRC/$release" list -m -f '{{.Path}} {{.Version}}' k8s.io/dynamic-resource-allocation))"
  (cd "$SRC/$release" && GOOS="$goos" GOARCH="$goarch" CGO_ENABLED=0 \
    go build -trimpath -mod=readonly -tags "$tags" -ldflags "-s -w" -o "$STAGE/gpudra-allocator-${release#v}" . >&2)
done
for b in "${BINARIES[@]}"; do mv -f "$STAGE/$b" "$dir/$b"; done
log "built in $((SECONDS - start)) s: $dir"
copy_into "$dir"
echo "$dir"
