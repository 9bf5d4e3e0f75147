#!/usr/bin/env bash
# Makes sure the control-plane binaries exist and prints their directory as the last line.
#
# Order: $KUBEBUILDER_ASSETS (if it has everything) -> the version-keyed cache -> the official
# release binaries (fails fast when unreachable) -> a build from the pinned Go modules in
# hack/kube-tools and hack/etcd-tools. Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}"
BIN_DIR="${KUBE_BIN_DIR:-$CACHE_ROOT/kube/$KUBE_VERSION-etcd$ETCD_VERSION}"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)

log() { printf '[kube-bin] %s\n' "$*" >&2; }

has_all() {
  local dir="$1" b
  for b in "${BINARIES[@]}"; do [[ -x "$dir/$b" ]] || return 1; done
}

stamped_ok() {  # the apiserver in $1 reports the pinned version
  [[ "$("$1/kube-apiserver" --version 2>/dev/null)" == "Kubernetes $KUBE_VERSION" ]]
}

# The release's own Go settings: the `godebug` lines of its go.mod (1.36 and later: default=go1.26,
# whose net/url refuses an http(s) host with two colons), so that what we build behaves as the
# released binaries do. The committed hack/kube-tools carries the pinned release's; any other's
# comes from its go.mod on the Go module proxy.
pinned_version() {
  go -C "$HACK_DIR/kube-tools" list -m -f '{{.Version}}' k8s.io/kubernetes
}

upstream_go_mod() {
  if [[ "$(pinned_version)" == "$KUBE_VERSION" ]]; then echo "$HACK_DIR/kube-tools/go.mod"; return; fi
  (cd / && GOFLAGS= go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
}

godebug_of() {  # the godebug directive(s) of the go.mod $1, one-line or block form
  awk '/^godebug \(/ {block = 1} block || /^godebug / {print} block && /^\)/ {block = 0}' "$1"
}

# Binaries built before the stamp: the pinned release's recipe is unchanged, so only theirs count.
recipe_ok() {  # $1 was built (or downloaded) with the release's own Go settings
  command -v go >/dev/null || return 0  # no Go, no build to redo: what is there serves
  local go_mod want; go_mod="$(upstream_go_mod)" && want="$(godebug_of "$go_mod")" || return 1
  if [[ ! -f "$1/.godebug" ]] && [[ "$go_mod" == "$HACK_DIR/kube-tools/go.mod" ]]; then
    printf '%s\n' "$want" > "$1/.godebug"
  fi
  [[ -f "$1/.godebug" && "$(cat "$1/.godebug")" == "$want" ]]
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
  if has_all "$KUBEBUILDER_ASSETS"; then
    log "using \$KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS ($("$KUBEBUILDER_ASSETS/kube-apiserver" --version))"
    echo "$KUBEBUILDER_ASSETS"; exit 0
  fi
  log "\$KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks one of: ${BINARIES[*]} (scheduler, controller-manager and kubelet are needed too); falling back"
fi

if has_all "$BIN_DIR" && stamped_ok "$BIN_DIR" && recipe_ok "$BIN_DIR"; then
  log "cached: $BIN_DIR"
  echo "$BIN_DIR"; exit 0
fi

mkdir -p "$BIN_DIR"
STAGE="$(mktemp -d "$BIN_DIR/.stage.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT

download() {
  command -v curl >/dev/null || return 1
  local base="https://dl.k8s.io/release/$KUBE_VERSION/bin/linux/amd64" b
  local etcd_url="https://github.com/etcd-io/etcd/releases/download/$ETCD_VERSION/etcd-$ETCD_VERSION-linux-amd64.tar.gz"
  log "trying the official release binaries (5 s connect timeout)"
  curl -fsS --connect-timeout 5 --max-time 10 -o /dev/null -r 0-0 "$base/kubectl" 2>/dev/null || { log "release downloads unreachable"; return 1; }
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
    log "downloading $b $KUBE_VERSION"
    curl -fsSL --connect-timeout 5 --max-time 600 -o "$STAGE/$b" "$base/$b" || return 1
    chmod +x "$STAGE/$b"
  done
  log "downloading etcd $ETCD_VERSION"
  curl -fsSL --connect-timeout 5 --max-time 600 "$etcd_url" | tar -xz -C "$STAGE" --strip-components=1 "etcd-$ETCD_VERSION-linux-amd64/etcd" || return 1
}

# The committed hack/kube-tools pins KUBE_VERSION's default. For any other release, generate the
# same module from that release's own go.mod: every `k8s.io/x => ./staging/...` becomes `k8s.io/x v0.MINOR.PATCH`.
kube_tools_dir() {
  local pinned; pinned="$(pinned_version)"
  if [[ "$pinned" == "$KUBE_VERSION" ]]; then echo "$HACK_DIR/kube-tools"; return; fi
  local dir="$CACHE_ROOT/kube-tools-$KUBE_VERSION" upstream staging="v0.${KUBE_VERSION#v1.}"
  log "KUBE_VERSION=$KUBE_VERSION is not the pinned $pinned: generating $dir from upstream's go.mod"
  mkdir -p "$dir"
  rm -f "$dir/go.mod" "$dir/go.sum"
  upstream="$(upstream_go_mod)"
  [[ -f "$upstream" ]] || { log "k8s.io/kubernetes@$KUBE_VERSION is not served by the Go module proxy"; return 1; }
  { printf 'module gpudra.io/hack/kube-tools\n\n%s\n\n%s\n\ntool (\n' "$(grep -m1 '^go ' "$upstream")" "$(godebug_of "$upstream")"
    printf '\tk8s.io/kubernetes/cmd/%s\n' kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet
    printf ')\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$KUBE_VERSION"
    sed -n 's/^[[:space:]]*\(k8s.io\/[a-z0-9-]*\) => .\/staging\/.*/\t\1 => \1 '"$staging"'/p' "$upstream"
    echo ")"; } > "$dir/go.mod"
  (cd "$dir" && go mod tidy >&2) || return 1
  echo "$dir"
}

build() {
  command -v go >/dev/null || { log "no Go toolchain: install Go >= 1.26 (or give internet access, or set KUBEBUILDER_ASSETS)"; return 1; }
  local tools; tools="$(kube_tools_dir)" || return 1
  local pkg=k8s.io/component-base/version cpkg=k8s.io/client-go/pkg/version
  local minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
  local commit; commit="$(go -C "$tools" list -m -f '{{.Version}}' k8s.io/kubernetes)"
  local ldflags="-s -w" p
  for p in "$pkg" "$cpkg"; do
    ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.gitCommit=module-$commit -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  local start=$SECONDS
  log "building etcd $ETCD_VERSION from Go modules (cold: 1-3 min on 2 cores)"
  (cd "$HACK_DIR/etcd-tools" && CGO_ENABLED=0 go build -trimpath -mod=readonly -o "$STAGE/etcd" go.etcd.io/etcd/server/v3)
  log "etcd built in $((SECONDS - start)) s"
  start=$SECONDS
  log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet $KUBE_VERSION from Go modules"
  log "a cold build takes about 10-15 minutes on 2 cores (warm Go cache: under a minute); progress follows per package group"
  (cd "$tools" && CGO_ENABLED=0 go build -trimpath -mod=readonly -ldflags "$ldflags" -o "$STAGE/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet) &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 30 & wait $! || true
    kill -0 "$pid" 2>/dev/null && log "still compiling Kubernetes... $((SECONDS - start)) s elapsed"
  done
  wait "$pid"
  log "Kubernetes binaries built in $((SECONDS - start)) s"
}

if ! download; then
  rm -f "$STAGE"/*
  build || { log "FAILED: could not obtain the control-plane binaries"; exit 1; }
fi
has_all "$STAGE" || { log "FAILED: missing binaries in $STAGE"; exit 1; }
stamped_ok "$STAGE" || { log "FAILED: kube-apiserver --version is '$("$STAGE/kube-apiserver" --version)', want $KUBE_VERSION"; exit 1; }
for b in "${BINARIES[@]}"; do mv -f "$STAGE/$b" "$BIN_DIR/$b"; done
godebug_of "$(upstream_go_mod)" > "$BIN_DIR/.godebug"
log "ready: $("$BIN_DIR/kube-apiserver" --version), $("$BIN_DIR/etcd" --version | head -1)"
echo "$BIN_DIR"
