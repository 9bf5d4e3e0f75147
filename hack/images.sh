#!/usr/bin/env bash
# Builds gpudra's container images (`make images`, `make base-image`, and `make test` before the
# image tests), skipping any whose inputs have not changed; prints their references, space-separated,
# as the last line of stdout. Progress goes to stderr.
#
#   hack/images.sh [operator] [agent] [base]     (default: operator agent)
#
#   operator  images/operator.Dockerfile -> $IMAGE_REGISTRY/gpudra-operator:$IMAGE_TAG
#   agent     images/agent.Dockerfile    -> $IMAGE_REGISTRY/gpudra:$IMAGE_TAG
#   base      the stand-in Python base   -> localhost/gpudra-python-base:bookworm (see below)
#
# Environment: IMAGE_REGISTRY (ghcr.io/gpudra), IMAGE_TAG (pyproject's version), PLATFORM
# (linux/amd64 or linux/arm64; default: this machine's), CONTAINER_ENGINE (podman or docker;
# default: podman if installed, else docker if its daemon answers), PYTHON_IMAGE (the
# Dockerfiles' base; default below), DEBIAN_MIRROR (for the stand-in base).
#
# The build context is a directory of wheels made by hack/wheels.sh (the Dockerfiles say why):
# the operator image gets the wheel of its platform, with that platform's gpudra-allocator
# binaries; the agent image the pure wheel, without them.
#
# Another architecture (PLATFORM=linux/arm64 on an x86_64 machine): the images are tagged
# <tag>-<arch> (arm64, amd64) so they never replace this machine's, and their RUN steps (and the
# stand-in base's debootstrap) run under qemu-user-static through binfmt_misc; see
# docs/deploy.md, "Building the images" (Debian: apt-get install qemu-user-static binfmt-support).
#
# Cache by content: every image carries the label io.gpudra.inputs = a hash of what went into it
# (its Dockerfile, pyproject.toml, README.md, operator/ and driver/ minus bytecode and minus
# operator/gpudra_operator/bin, this script, hack/wheels.sh, the platform, the base image's ID, and
# for the operator the platform's gpudra-allocator binaries). An image whose label matches is kept;
# one elsewhere in the store with that label is re-tagged; otherwise it is built, and this
# target's older untagged builds are removed.
#
# The base. Unless PYTHON_IMAGE says otherwise, the Dockerfiles' own default (the official
# python:<patch>-slim-bookworm, what releases use) if it is present or can be pulled. Where it
# cannot (no Docker Hub, as on the project's CI machines), a stand-in with the same interface:
# Debian bookworm's python3 (3.11) from `debootstrap --variant=minbase` + `<engine> import`, with a
# virtual environment at /usr/local, so `python3` and `pip` on PATH (/usr/local/bin) install into
# /usr/local/lib/python3.11/site-packages and never into Debian's own /usr/lib/python3 (no
# --break-system-packages needed). Built once per recipe, tagged
# localhost/gpudra-python-base:bookworm-<recipe hash> and :bookworm. Needs root (debootstrap).
#
# podman runs with hack/podman/containers.conf (CONTAINERS_CONF): runc, cgroupfs and rlimits within
# what these VMs allow. Missing podman/runc/debootstrap: hack/debian-packages.sh installs them.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/gpudra}"
IMAGE_TAG="${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml")}"
CACHE_ROOT="${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}"
LABEL=io.gpudra.inputs
STANDIN_REPO=localhost/gpudra-python-base
ROOTFS_REPO=localhost/gpudra-debian-minbase
SUITE=bookworm
FIX="hack/debian-packages.sh"

log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] error: %s\n' "$*" >&2; exit 1; }

# ---- the platform --------------------------------------------------------------------------------
case "$(uname -m)" in
  x86_64|amd64) HOST_ARCH=amd64 ;;
  aarch64|arm64) HOST_ARCH=arm64 ;;
  *) HOST_ARCH="$(uname -m)" ;;
esac
PLATFORM="${PLATFORM:-linux/$HOST_ARCH}"
case "$PLATFORM" in
  linux/amd64|linux/arm64) ARCH="${PLATFORM#linux/}" ;;
  *) die "PLATFORM=$PLATFORM: the images are built for linux/amd64 or linux/arm64" ;;
esac
FOREIGN=""  # set for another architecture than this machine's: tags get -<arch>, RUN is emulated
[[ "$ARCH" == "$HOST_ARCH" ]] || FOREIGN="-$ARCH"

# Running the other architecture's programs (RUN steps, debootstrap's second stage) needs a
# binfmt_misc handler for it with the F flag, which containers use: hack/emulation.sh registers
# qemu-user-static's (as root), or names the command that does.
check_emulation() {
  [[ -n "$FOREIGN" ]] || return 0
  "$REPO/hack/emulation.sh" "$ARCH" || die "building for $PLATFORM on $HOST_ARCH runs $ARCH programs under emulation (above)"
}

# ---- the engine ---------------------------------------------------------------------------------
if [[ -z "${CONTAINER_ENGINE:-}" ]]; then
  if command -v podman >/dev/null; then CONTAINER_ENGINE=podman
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then CONTAINER_ENGINE=docker
  else die "no container engine: podman is not installed and no docker daemon answers. Run $FIX (as root: installs podman, runc, debootstrap), or set CONTAINER_ENGINE."
  fi
fi
ENGINE="$CONTAINER_ENGINE"
command -v "$ENGINE" >/dev/null || die "CONTAINER_ENGINE=$ENGINE is not installed (podman: run $FIX)"
if [[ "$(basename "$ENGINE")" == docker ]]; then
  "$ENGINE" info >/dev/null 2>&1 || die "CONTAINER_ENGINE=$ENGINE: its daemon does not answer ('$ENGINE info' fails)"
fi
BUILD_FLAGS=()
if [[ "$(basename "$ENGINE")" == podman ]]; then
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/hack/podman/containers.conf}"
  command -v runc >/dev/null || die "podman needs runc here (crun refuses hybrid cgroups): run $FIX"
  BUILD_FLAGS=(--layers=false)  # no intermediate images to clean up; a changed input reruns pip anyway
fi

# Machines whose HTTPS goes through an intercepting proxy trust its CA in the host's bundle, and so
# must the `pip wheel` step: with podman, the host's bundle (PIP_CERT, REQUESTS_CA_BUNDLE,
# SSL_CERT_FILE or Debian's) is mounted over the build containers' system bundle during RUN steps
# (not part of any layer). Debian's pip reads the system bundle, as does pip >= 24.2 (truststore).
ca_build_flags() {
  [[ "$(basename "$ENGINE")" == podman ]] || return 0
  local c
  for c in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [[ -n "$c" && -f "$c" ]]; then
      printf '%s\n' -v "$(readlink -f "$c"):/etc/ssl/certs/ca-certificates.crt:ro"; return 0
    fi
  done
}

exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
# `make images-multiarch` (hack/image-manifests.sh) gives this machine's image's name to a manifest
# list of both architectures, the image keeping <tag>-<arch>. The list resolves to the image (run,
# inspect, save), so a current image is found through it; a rebuilt or re-tagged one takes the name
# back: the list, which names the old image, goes, and so does the old image's <tag>-<arch>.
drop_list() {  # $1: a reference of this machine's architecture
  [[ "$(basename "$ENGINE")" == podman ]] || return 0
  "$ENGINE" manifest exists "$1" 2>/dev/null || return 0
  log "$1: removing the manifest list of make images-multiarch (rebuild it with make images-multiarch)"
  "$ENGINE" manifest rm "$1" >/dev/null
  if exists "$1-$ARCH"; then "$ENGINE" untag "$1-$ARCH" "$1-$ARCH"; fi
}
arch_of() { "$ENGINE" image inspect --format '{{.Architecture}}' "$1" 2>/dev/null || true; }
exists_for_arch() { [[ "$(arch_of "$1")" == "$ARCH" ]]; }
image_id() { "$ENGINE" image inspect --format '{{.Id}}' "$1"; }
label_of() { "$ENGINE" image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null || true; }

# ---- the stand-in base --------------------------------------------------------------------------
# Its Containerfile; the recipe hash covers it, the debootstrap command and the cleanup below.
# python3-venv (and the pip/setuptools wheels it brings) is purged once the venv exists, so the
# images carry no wheel files; the venv keeps its own pip, which the Dockerfiles' final stage removes.
BASE_CONTAINERFILE='ARG ROOTFS
FROM ${ROOTFS}
ENV LANG=C.UTF-8 \
    PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
RUN set -eux; \
    printf "%s\n" "path-exclude=/usr/share/doc/*" "path-include=/usr/share/doc/*/copyright" \
      "path-exclude=/usr/share/man/*" "path-exclude=/usr/share/info/*" "path-exclude=/usr/share/locale/*" \
      > /etc/dpkg/dpkg.cfg.d/gpudra-slim; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3 python3-venv ca-certificates netbase tzdata; \
    python3 -m venv /usr/local; \
    apt-get purge -y python3-venv python3.11-venv python3-pip-whl python3-setuptools-whl; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log /var/cache/debconf/*-old; \
    hash -r; test "$(command -v python3)" = /usr/local/bin/python3; \
    test "$(command -v pip)" = /usr/local/bin/pip; \
    python3 --version; pip --version
CMD ["python3"]
'
DEBOOTSTRAP_ARGS=(--variant=minbase "$SUITE")
# Another architecture: debootstrap runs its second stage in the new root under emulation. This
# machine's keeps the arguments (and so the recipe hash) it always had.
[[ -z "$FOREIGN" ]] || DEBOOTSTRAP_ARGS=(--arch="$ARCH" "${DEBOOTSTRAP_ARGS[@]}")
BASE_SUITE="$SUITE$FOREIGN"  # the stand-in's tags: bookworm-<hash> here, bookworm-arm64-<hash> for arm64
ROOTFS_CLEAN=(var/cache/apt/archives/*.deb var/lib/apt/lists/* usr/share/doc usr/share/man usr/share/info usr/share/locale var/log/bootstrap.log)

rootfs_hash() { printf '%s\n' "${DEBOOTSTRAP_ARGS[@]}" "${ROOTFS_CLEAN[@]}" | sha256sum | cut -c1-12; }
standin_hash() { { rootfs_hash; printf '%s' "$BASE_CONTAINERFILE"; } | sha256sum | cut -c1-12; }

debian_mirror() {
  [[ -n "${DEBIAN_MIRROR:-}" ]] && { echo "$DEBIAN_MIRROR"; return; }
  local m=""
  if [[ -r /etc/apt/sources.list ]]; then
    m="$(awk -v s="$SUITE" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while (i <= NF && $(i-1) !~ /\]$/) i++; if ($(i+1) == s) { print $i; exit } }' /etc/apt/sources.list)"
  fi
  if [[ -z "$m" ]]; then
    # deb822 (*.sources): the first stanza of Types deb whose Suites include the suite itself.
    m="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v s="$SUITE" '
      function flush() { if (deb && suite && uri != "") { print uri; found = 1; exit } deb = 0; suite = 0; uri = "" }
      /^[[:space:]]*$/ { flush(); next }
      /^Types:/ { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == s) suite = 1 }
      /^URIs:/ { uri = $2 }
      END { if (!found) flush() }')"
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

build_standin() {  # $1: the tag to build
  local tag="$1" h rootfs tmp mirror start
  h="$(standin_hash)"
  rootfs="$ROOTFS_REPO:$BASE_SUITE-$(rootfs_hash)"
  if ! exists "$rootfs"; then
    command -v debootstrap >/dev/null || die "the stand-in Python base needs debootstrap: run $FIX"
    [[ $(id -u) -eq 0 ]] || die "the stand-in Python base needs root (debootstrap); or pass PYTHON_IMAGE=<an image with python3 and pip>"
    mirror="$(debian_mirror)"
    tmp="$(mktemp -d "${TMPDIR:-/var/tmp}/gpudra-debootstrap.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    start=$SECONDS
    log "debootstrap ${DEBOOTSTRAP_ARGS[*]} from $mirror (about 80 s${FOREIGN:+; about 5 min under emulation})"
    debootstrap "${DEBOOTSTRAP_ARGS[@]}" "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1 \
      || { tail -n 30 "$tmp/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
    (cd "$tmp/root" && shopt -s nullglob && rm -rf ${ROOTFS_CLEAN[*]})
    log "importing the root file system as $rootfs"
    tar -C "$tmp/root" --numeric-owner -cf - . | "$ENGINE" import --arch "$ARCH" --change 'CMD ["/bin/bash"]' --change 'LABEL io.gpudra.image=debian-minbase' - "$rootfs" >/dev/null
    rm -rf "$tmp"; trap - EXIT
    log "debootstrap + import: $((SECONDS - start)) s"
  fi
  log "building $tag (python3 + a venv at /usr/local) on $rootfs"
  tmp="$(mktemp -d)"
  printf '%s' "$BASE_CONTAINERFILE" >"$tmp/Containerfile"
  "$ENGINE" build "${BUILD_FLAGS[@]}" --platform "$PLATFORM" --network=host --build-arg "ROOTFS=$rootfs" --label "$LABEL=standin-$h" --label io.gpudra.image=python-base \
    -t "$tag" -f "$tmp/Containerfile" "$tmp" >&2 || { rm -rf "$tmp"; die "building $tag failed"; }
  rm -rf "$tmp"
  # Earlier recipes' stand-ins and root file systems (kept while an image still uses them).
  local old
  for old in $("$ENGINE" images --format '{{.Repository}}:{{.Tag}}' | grep -E "^($STANDIN_REPO|$ROOTFS_REPO):$BASE_SUITE-[0-9a-f]+$" || true); do
    [[ "$old" == "$tag" || "$old" == "$rootfs" ]] || "$ENGINE" rmi "$old" >/dev/null 2>&1 || true
  done
  "$ENGINE" image prune -f --filter label=io.gpudra.image=python-base >/dev/null 2>&1 || true
  "$ENGINE" image prune -f --filter label=io.gpudra.image=debian-minbase >/dev/null 2>&1 || true
}

standin_base() {  # prints the stand-in's reference, building it when missing
  local h tag
  h="$(standin_hash)"
  tag="$STANDIN_REPO:$BASE_SUITE-$h"
  if [[ "$(label_of "$tag")" != "standin-$h" ]]; then
    check_emulation
    build_standin "$tag"
  fi
  "$ENGINE" tag "$tag" "$STANDIN_REPO:$BASE_SUITE"
  echo "$tag"
}

official_base() {  # $1: Dockerfile; prints its ARG PYTHON_IMAGE default
  sed -n 's/^ARG PYTHON_IMAGE=\(.*\)$/\1/p' "$1" | head -n 1
}

resolve_base() {  # $1: Dockerfile; prints the base image reference to build on
  local official marker
  if [[ -n "${PYTHON_IMAGE:-}" ]]; then
    if [[ "$PYTHON_IMAGE" == "$STANDIN_REPO" || "$PYTHON_IMAGE" == "$STANDIN_REPO:"* ]]; then
      if ! exists "$PYTHON_IMAGE"; then standin_base >/dev/null; fi
      exists "$PYTHON_IMAGE" || die "PYTHON_IMAGE=$PYTHON_IMAGE: no such stand-in; use $STANDIN_REPO:$BASE_SUITE"
    fi
    exists_for_arch "$PYTHON_IMAGE" || timeout 120 "$ENGINE" pull -q --platform "$PLATFORM" "$PYTHON_IMAGE" >/dev/null 2>&1 \
      || die "PYTHON_IMAGE=$PYTHON_IMAGE: not an image for $PLATFORM here, nor one to pull"
    echo "$PYTHON_IMAGE"; return
  fi
  official="$(official_base "$1")"
  [[ -n "$official" ]] || die "$1 has no ARG PYTHON_IMAGE default"
  # The store holds one image per name: the official base of the other architecture is pulled
  # over this one's, and back, as the platform changes.
  if exists_for_arch "$official"; then echo "$official"; return; fi
  # Remember a failed pull for an hour, so a warm run does not wait on an unreachable registry.
  marker="$CACHE_ROOT/images/unpullable-$ARCH-$(printf '%s' "$official" | tr -c 'A-Za-z0-9._-' _)"
  if [[ -z "$(find "$marker" -mmin -60 2>/dev/null)" ]]; then
    if timeout 120 "$ENGINE" pull -q --platform "$PLATFORM" "$official" >/dev/null 2>&1; then echo "$official"; return; fi
    mkdir -p "$(dirname "$marker")" && touch "$marker"
  fi
  log "the official base $official cannot be pulled here: using the stand-in $STANDIN_REPO:$BASE_SUITE (releases use the official one)"
  standin_base
}

# ---- the gpudra images --------------------------------------------------------------------------
# The wheel's sources (not the allocator's Go sources, nor the host's binaries in
# operator/gpudra_operator/bin: the operator's own binaries come in as $4, the directory that
# holds them for the platform).
inputs_hash() {  # $1: target, $2: Dockerfile (relative), $3: base image ID, $4: binaries dir or ""
  { printf 'target %s\nplatform %s\nbase %s\n' "$1" "$PLATFORM" "$3"
    (cd "$REPO" && find pyproject.toml README.md "$2" hack/images.sh hack/wheels.sh operator driver \
       \( -name __pycache__ -o -name '*.egg-info' -o -name .mypy_cache -o -name .pytest_cache \
          -o -path operator/gpudra_operator/bin -o -path operator/gpudra-allocator \) -prune \
       -o -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    if [[ -n "$4" ]]; then (cd "$4" && sha256sum gpudra-allocator-1.*); fi
  } | sha256sum | cut -c1-16
}

build_app() {  # $1: operator | agent; prints the image reference
  local target="$1" dockerfile ref base base_id h found start ca_flags wheel bin_dir="" context
  dockerfile="images/$target.Dockerfile"
  case "$target" in
    # The operator only matches selectors: its image carries the lean gpudra-allocator (no
    # DeviceTaintRules: 8 MiB less resident memory; hack/allocator-bin.sh).
    operator) ref="$IMAGE_REGISTRY/gpudra-operator:$IMAGE_TAG$FOREIGN" wheel="linux-$ARCH"
              bin_dir="$(VARIANT=lean GOOS=linux GOARCH="$ARCH" "$REPO/hack/allocator-bin.sh" | tail -n 1)"
              [[ -n "$bin_dir" ]] || die "hack/allocator-bin.sh printed no directory for linux/$ARCH" ;;
    agent) ref="$IMAGE_REGISTRY/gpudra:$IMAGE_TAG$FOREIGN" wheel=any ;;
  esac
  base="$(resolve_base "$REPO/$dockerfile")" || exit 1
  base_id="$(image_id "$base")" || die "base image $base: not found"
  h="$(inputs_hash "$target" "$dockerfile" "$base_id" "$bin_dir")"
  if [[ "$(label_of "$ref")" == "$h" ]]; then
    log "$ref is up to date (inputs $h)"
    echo "$ref"; return
  fi
  [[ -n "$FOREIGN" ]] || drop_list "$ref"
  found="$("$ENGINE" images -q --filter "label=$LABEL=$h" | head -n 1)"
  if [[ -n "$found" ]]; then
    log "$ref: re-tagging $found (inputs $h)"
    "$ENGINE" tag "$found" "$ref"
    echo "$ref"; return
  fi
  check_emulation
  log "building $ref for $PLATFORM from $dockerfile on $base (inputs $h)"
  start=$SECONDS
  # The context: the one wheel this image installs (hack/wheels.sh; the operator's with the
  # platform's binaries, the agent's without), in a directory of its own.
  context="$(mktemp -d "${TMPDIR:-/tmp}/gpudra-image-context.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$context'" EXIT
  VARIANT="$([[ $target == operator ]] && echo lean || echo full)" \
    "$REPO/hack/wheels.sh" --out "$context" "$wheel" >/dev/null || die "hack/wheels.sh $wheel failed"
  mapfile -t ca_flags < <(ca_build_flags)
  "$ENGINE" build "${BUILD_FLAGS[@]}" "${ca_flags[@]}" --platform "$PLATFORM" --network=host --build-arg "PYTHON_IMAGE=$base" \
     --label "$LABEL=$h" --label "io.gpudra.image=$target" --label "io.gpudra.base=$base" \
     -f "$REPO/$dockerfile" -t "$ref" "$context" >&2 || die "building $ref failed"
  rm -rf "$context"; trap - EXIT
  log "built $ref in $((SECONDS - start)) s"
  # This target's earlier builds, now untagged (their cache entries are gone with them).
  "$ENGINE" image prune -f --filter "label=io.gpudra.image=$target" >/dev/null 2>&1 || true
  echo "$ref"
}

# One build at a time per store (make test, an e2e test and a `make images` may overlap): a second
# run waits, then finds the first one's images up to date.
mkdir -p "$CACHE_ROOT/images"
exec 9>"$CACHE_ROOT/images/lock"
if ! flock -n 9; then
  log "waiting for another hack/images.sh run to finish"
  flock 9
fi

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(operator agent)
refs=()
for t in "${targets[@]}"; do
  case "$t" in
    operator|agent) ref="$(build_app "$t")" || exit 1; refs+=("$ref") ;;
    base) ref="$(standin_base)" || exit 1; refs+=("$ref") ;;
    *) die "unknown target $t (operator, agent or base)" ;;
  esac
done
echo "${refs[*]}"
