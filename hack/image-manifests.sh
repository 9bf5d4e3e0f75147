#!/usr/bin/env bash
# Builds gpudra's images for several platforms and joins each image's builds in a manifest list
# under the image's plain name (`make images-multiarch`); with --push, pushes the lists, with every
# platform's image, to their registry (`make images-push`). Prints the lists' references,
# space-separated, as the last line of stdout. Progress goes to stderr. Podman only.
#
#   hack/image-manifests.sh [--push] [operator] [agent]     (default: operator agent)
#
#   operator  $IMAGE_REGISTRY/gpudra-operator:$IMAGE_TAG
#   agent     $IMAGE_REGISTRY/gpudra:$IMAGE_TAG
#
# Environment: IMAGE_REGISTRY, IMAGE_TAG (as hack/images.sh), PLATFORMS (default "linux/amd64
# linux/arm64"), PUSH_FLAGS (extra `podman manifest push` flags, e.g. --authfile FILE or --creds
# USER:TOKEN; by default podman's login, `podman login ghcr.io`).
#
# Each platform's image comes from hack/images.sh, cached by content as there (the other
# architecture's under qemu-user-static: hack/emulation.sh). Each then also carries the name
# <tag>-<arch> (e.g. ghcr.io/gpudra/gpudra:0.1.0-arm64): this machine's image gives its plain name
# to the list and keeps that one. Locally the list stands for this machine's image (podman run,
# image inspect and save resolve it), so what uses the plain name works as before; a later
# single-platform build of a changed tree takes the name back (hack/images.sh drops the list).
# The lists are made afresh each run (a few milliseconds), so they always name the current images.
set -euo pipefail
shopt -s inherit_errexit

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/gpudra}"
IMAGE_TAG="${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml")}"
PLATFORMS="${PLATFORMS:-linux/amd64 linux/arm64}"
export IMAGE_REGISTRY IMAGE_TAG

log() { printf '[image-manifests] %s\n' "$*" >&2; }
die() { printf '[image-manifests] error: %s\n' "$*" >&2; exit 1; }

push=""
if [[ "${1:-}" == "--push" ]]; then push=1; shift; fi
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(operator agent)
for t in "${targets[@]}"; do
  case "$t" in operator|agent) ;; *) die "unknown target $t (operator or agent)" ;; esac
done
read -r -a platforms <<<"$PLATFORMS"
[[ ${#platforms[@]} -gt 0 ]] || die "PLATFORMS is empty"
for p in "${platforms[@]}"; do
  case "$p" in linux/amd64|linux/arm64) ;; *) die "PLATFORMS: $p (linux/amd64 or linux/arm64)" ;; esac
done
if [[ "$(basename "${CONTAINER_ENGINE:-podman}")" != podman ]]; then
  die "CONTAINER_ENGINE=$CONTAINER_ENGINE: manifest lists are made with podman (docker: docker buildx build --platform ... --push)"
fi
command -v podman >/dev/null || die "no podman: run hack/debian-packages.sh (as root)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/hack/podman/containers.conf}"

# refs[<platform> <target>]: hack/images.sh's reference of that build.
declare -A refs
for p in "${platforms[@]}"; do
  start=$SECONDS
  built="$(PLATFORM="$p" "$REPO/hack/images.sh" "${targets[@]}" | tail -n 1)" || die "hack/images.sh for $p failed (above)"
  read -r -a out <<<"$built"
  [[ ${#out[@]} -eq ${#targets[@]} ]] || die "hack/images.sh for $p printed '$built', expected ${#targets[@]} references"
  for i in "${!targets[@]}"; do refs["$p ${targets[$i]}"]="${out[$i]}"; done
  log "$p: ${out[*]} ($((SECONDS - start)) s)"
done

lists=()
for t in "${targets[@]}"; do
  case "$t" in operator) list="$IMAGE_REGISTRY/gpudra-operator:$IMAGE_TAG" ;; agent) list="$IMAGE_REGISTRY/gpudra:$IMAGE_TAG" ;; esac
  ids=()
  for p in "${platforms[@]}"; do
    id="$(podman image inspect --format '{{.Id}}' "${refs["$p $t"]}")"
    arch="$(podman image inspect --format '{{.Architecture}}' "$id")"
    [[ "linux/$arch" == "$p" ]] || die "${refs["$p $t"]} is a $arch image, not $p"
    podman tag "$id" "$list-$arch"  # the name it keeps once the list has the plain one
    ids+=("$id")
  done
  if podman manifest exists "$list" 2>/dev/null; then podman manifest rm "$list" >/dev/null; fi
  # This machine's image holds the plain name (hack/images.sh): a name moves to the list only once
  # no image holds it, and the image keeps <tag>-<arch>.
  if podman image exists "$list"; then
    holder="$(podman image inspect --format '{{.Id}}' "$list")"
    [[ " ${ids[*]} " == *" $holder "* ]] \
      || die "$list names image $holder, which is none of the builds for ${platforms[*]}: add this machine's platform to PLATFORMS, or podman untag $list"
    podman untag "$holder" "$list"
  fi
  podman manifest create "$list" >/dev/null
  for p in "${platforms[@]}"; do
    podman manifest add "$list" "containers-storage:$list-${p#linux/}" >/dev/null
  done
  log "$list: a manifest list of ${platforms[*]}"
  lists+=("$list")
done

if [[ -n "$push" ]]; then
  read -r -a push_flags <<<"${PUSH_FLAGS:-}"
  for list in "${lists[@]}"; do
    log "pushing $list with all its images"
    # OCI index and manifests alike (the builds' manifests are OCI), as registries and containerd expect.
    podman manifest push --all --format oci "${push_flags[@]}" "$list" "docker://$list" >&2 \
      || die "podman manifest push $list failed (logged in? podman login ${list%%/*}; or PUSH_FLAGS=--authfile FILE)"
  done
fi
echo "${lists[*]}"
