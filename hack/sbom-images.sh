#!/usr/bin/env bash
# `make sbom-images`: a CycloneDX SBOM (JSON, spec 1.6) of each container image, per platform, by
# Anchore's syft (hack/syft-bin.sh): the Debian packages of the base (dpkg's database), the Python
# packages installed in it (gpudra among them, with its version), and in the operator image the Go
# modules of the gpudra-allocator binaries (their embedded build information). syft reads the image
# as `podman save --format oci-archive` writes it: no daemon, no registry. Prints the SBOMs' paths,
# space-separated, as the last line of stdout; progress goes to stderr.
#
#   hack/sbom-images.sh [operator] [agent]     (default: operator agent)
#
#   operator  <SBOM_OUT>/gpudra-operator-image-<version>-<arch>.cdx.json
#   agent     <SBOM_OUT>/gpudra-image-<version>-<arch>.cdx.json
#
# Environment: SBOM_OUT (default dist), PLATFORMS (default "linux/amd64 linux/arm64", as
# hack/image-manifests.sh; the other architecture's images are built under emulation unless
# `make images-multiarch` did it already), IMAGE_REGISTRY and IMAGE_TAG (as hack/images.sh), VENV
# (the development virtualenv, whose cyclonedx-python-lib validates each SBOM; default .venv).
#
# The images are hack/images.sh's for each platform, cached by content: after `make images` or
# `make images-multiarch` nothing is rebuilt, and the SBOM describes the image that is pushed (its
# image ID, the digest of its config, is the SBOM's metadata.component.version). Podman only.
set -euo pipefail
shopt -s inherit_errexit

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/gpudra}"
IMAGE_TAG="${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}"
SBOM_OUT="${SBOM_OUT:-dist}"
DEV="${VENV:-.venv}"
export IMAGE_REGISTRY IMAGE_TAG

log() { printf '[sbom-images] %s\n' "$*" >&2; }
die() { printf '[sbom-images] error: %s\n' "$*" >&2; exit 1; }

read -r -a platforms <<<"${PLATFORMS:-linux/amd64 linux/arm64}"
[[ ${#platforms[@]} -gt 0 ]] || die "PLATFORMS is empty"
for p in "${platforms[@]}"; do
  case "$p" in linux/amd64|linux/arm64) ;; *) die "PLATFORMS: $p (linux/amd64 or linux/arm64)" ;; esac
done
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(operator agent)
for t in "${targets[@]}"; do
  case "$t" in operator|agent) ;; *) die "unknown image $t (operator or agent)" ;; esac
done
if [[ "$(basename "${CONTAINER_ENGINE:-podman}")" != podman ]]; then
  die "CONTAINER_ENGINE=$CONTAINER_ENGINE: the images are read from podman's store (podman save)"
fi
command -v podman >/dev/null || die "no podman: run hack/debian-packages.sh (as root), then make images"
[[ -x "$DEV/bin/python" ]] || die "no $DEV/bin/python to validate the SBOMs with: run make venv"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/hack/podman/containers.conf}"
syft_dir="$("$REPO/hack/syft-bin.sh" | tail -n 1)" || die "no syft (above): make syft"
syft="$syft_dir/syft"

work="$(mktemp -d "${TMPDIR:-/tmp}/gpudra-sbom-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$SBOM_OUT"
written=()
for p in "${platforms[@]}"; do
  arch="${p#linux/}"
  built="$(PLATFORM="$p" "$REPO/hack/images.sh" "${targets[@]}" | tail -n 1)" || die "hack/images.sh for $p failed (above)"
  read -r -a refs <<<"$built"
  [[ ${#refs[@]} -eq ${#targets[@]} ]] || die "hack/images.sh for $p printed '$built', expected ${#targets[@]} references"
  for i in "${!targets[@]}"; do
    ref="${refs[$i]}" start=$SECONDS
    case "${targets[$i]}" in
      operator) name=gpudra-operator ;;
      agent) name=gpudra ;;
    esac
    [[ "$(podman image inspect --format '{{.Architecture}}' "$ref")" == "$arch" ]] || die "$ref is not a $p image"
    # Saved by ID, the one image (through a manifest list of make images-multiarch, the name would
    # stand for this machine's image whatever the platform); the SBOM names it by its reference.
    id="$(podman image inspect --format '{{.Id}}' "$ref")"
    archive="$work/$name-$arch.tar"
    podman save --quiet --format oci-archive -o "$archive" "$id" >&2 || die "podman save $ref ($id) failed"
    out="$SBOM_OUT/$name-image-$IMAGE_TAG-$arch.cdx.json"
    # The image's packages, not the files they own (4000 more components, 4 times the size); the
    # image ID as the version, i.e. the config's digest, which the registry keeps (a manifest's
    # digest changes as layers are compressed again). No update check: no network.
    SYFT_CHECK_FOR_APP_UPDATE=false SYFT_FILE_METADATA_SELECTION=none "$syft" scan --quiet --scope squashed \
      --source-name "$IMAGE_REGISTRY/$name" --source-version "sha256:$id" \
      -o "cyclonedx-json@1.6=$out" "oci-archive:$archive" >&2 || die "syft scan of $ref failed"
    rm -f "$archive"
    log "$out: $ref ($p, sha256:$id) in $((SECONDS - start)) s"
    written+=("$out")
  done
done

# Each against the CycloneDX 1.6 schema, by the cyclonedx-python-lib of make sbom's cyclonedx-py.
"$DEV/bin/python" - "${written[@]}" <<'EOF' >&2 || die "not valid CycloneDX 1.6 (above)"
import collections, json, sys
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
validator = JsonStrictValidator(SchemaVersion.V1_6)
for path in sys.argv[1:]:
    text = open(path).read()
    if (error := validator.validate_str(text)) is not None:
        sys.exit(f"{path}: {error}")
    kinds = collections.Counter(c.get("purl", "").split("/")[0].removeprefix("pkg:") or c["type"] for c in json.loads(text)["components"])
    print(f"[sbom-images] {path}: valid CycloneDX 1.6; " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))
EOF
echo "${written[*]}"
