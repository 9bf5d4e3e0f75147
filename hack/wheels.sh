#!/usr/bin/env bash
# Builds gpudra's distributions (`make wheels`; hack/images.sh for the images): one wheel per
# platform with that platform's gpudra-allocator binaries (Kubernetes' own DRA allocator and CEL,
# one static Go binary per supported release) in gpudra_operator/bin/, pure Python otherwise; a
# wheel without them for the agent image; and the sdist. Prints the output directory as the last
# line of stdout; progress goes to stderr.
#
#   hack/wheels.sh [--out DIR] [PLATFORM...]     (default: dist/, every platform below)
#
#   linux-amd64   gpudra-V-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.musllinux_1_1_x86_64.whl
#   linux-arm64   gpudra-V-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.musllinux_1_1_aarch64.whl
#   darwin-arm64  gpudra-V-py3-none-macosx_12_0_arm64.whl
#   any           gpudra-V-py3-none-any.whl: no binaries (the agent image's; explain needs one above)
#   sdist         gpudra-V.tar.gz: no binaries, no Go sources
#
# Why these tags: the binaries are static (CGO_ENABLED=0) and need no libc at all, so the oldest
# manylinux tag pip still knows and musllinux (Alpine) both hold; the macOS floor is the Go
# toolchain's (Go >= 1.25 needs macOS 12), which tests/integration/test_wheel.py checks against
# the binaries' own LC_BUILD_VERSION. `py3-none`: nothing depends on the Python version or ABI.
#
# VARIANT=lean (hack/images.sh, for the operator image) puts the lean binaries in: no DeviceTaintRules.
# The binaries come from hack/allocator-bin.sh (cached; the first build of a platform needs Go
# and takes a few minutes). The build runs on a copy of the sources without
# operator/gpudra_operator/bin (where `make allocator` puts this machine's binaries), with
# pinned build tools in a cached virtual environment ($PYTHON -m venv; PyPI once), and
# SOURCE_DATE_EPOCH from the last commit, so the same sources give byte-identical wheels (the sdist
# differs in its timestamps).
set -euo pipefail
shopt -s inherit_errexit

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK_DIR/.." && pwd)"
TOOL=wheels
BINARIES=()
source "$HACK_DIR/lib/cached-tool.sh"

# The build tools, pinned: a new setuptools or wheel may change what a wheel holds.
TOOLS=(build==1.6.1 setuptools==84.2.1 wheel==0.48.0)
ALL=(linux-amd64 linux-arm64 darwin-arm64 any sdist)

die() { log "error: $*"; exit 1; }

out="$REPO/dist"
platforms=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    linux-amd64|linux-arm64|darwin-arm64|any|sdist) platforms+=("$1"); shift ;;
    *) die "unknown platform $1 (${ALL[*]})" ;;
  esac
done
[[ ${#platforms[@]} -gt 0 ]] || platforms=("${ALL[@]}")
mkdir -p "$out"
out="$(cd "$out" && pwd)"

platform_tag() {  # $1: linux-amd64 | linux-arm64 | darwin-arm64
  case "$1" in
    linux-amd64) echo manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64 ;;
    linux-arm64) echo manylinux_2_17_aarch64.manylinux2014_aarch64.musllinux_1_1_aarch64 ;;
    darwin-arm64) echo macosx_12_0_arm64 ;;
  esac
}

# ---- the build tools --------------------------------------------------------------------------
tools_python() {
  local python="${PYTHON:-python3}" hash venv
  command -v "$python" >/dev/null || die "no $python to build the wheels with (set PYTHON)"
  hash="$(printf '%s\n' "${TOOLS[@]}" "$("$python" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-12)"
  venv="$CACHE_ROOT/wheel-tools/$hash"
  mkdir -p "$CACHE_ROOT/wheel-tools"
  (  # one creator at a time: make test's image builds and tests/integration/test_wheel.py may overlap
    flock 8
    if [[ ! -f "$venv/.ready" ]]; then
      log "installing ${TOOLS[*]} into $venv"
      rm -rf "$venv"
      "$python" -m venv "$venv" >&2 || die "$python -m venv failed (Debian: apt-get install python3-venv)"
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${TOOLS[@]}" >&2
      touch "$venv/.ready"
    fi
  ) 8>"$CACHE_ROOT/wheel-tools/.lock"
  echo "$venv/bin/python"
}

# ---- the sources, without any binaries --------------------------------------------------------
stage_sources() {  # $1: a new directory to copy them into
  mkdir -p "$1"
  cp "$REPO/pyproject.toml" "$REPO/README.md" "$1/"
  (cd "$REPO" && tar -cf - --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
      --exclude=operator/gpudra_operator/bin operator/gpudra_operator driver/gpudra driver/gpudra_core \
      driver/gpudra_driver) | tar -C "$1" -xf -
}

python_bin="$(tools_python)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpudra-wheels.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
if [[ -z "${SOURCE_DATE_EPOCH:-}" ]]; then
  SOURCE_DATE_EPOCH="$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || date +%s)"
fi
export SOURCE_DATE_EPOCH
export PIP_DISABLE_PIP_VERSION_CHECK=1

build() {  # $1: wheel | sdist, $2: source dir, $3: output dir
  "$python_bin" -m build --no-isolation --"$1" --outdir "$3" "$2" >"$tmp/build.log" 2>&1 \
    || { tail -n 30 "$tmp/build.log" >&2; die "building the $1 failed (log above)"; }
}

start=$SECONDS
for platform in "${platforms[@]}"; do
  src="$tmp/src-$platform" built="$tmp/out-$platform"
  stage_sources "$src"
  case "$platform" in
    sdist)
      build sdist "$src" "$built" ;;
    any)
      build wheel "$src" "$built" ;;
    *)
      # Each release's binary for the platform, executable, in the package's bin/.
      bin_dir="$(GOOS="${platform%-*}" GOARCH="${platform#*-}" "$HACK_DIR/allocator-bin.sh" | tail -n 1)"
      [[ -n "$bin_dir" ]] || die "hack/allocator-bin.sh printed no directory for $platform"
      mkdir -p "$src/operator/gpudra_operator/bin"
      for binary in "$bin_dir"/gpudra-allocator-1.*; do
        install -m 0755 "$binary" "$src/operator/gpudra_operator/bin/"
      done
      build wheel "$src" "$built"
      "$python_bin" -m wheel tags --remove --platform-tag "$(platform_tag "$platform")" "$built"/*.whl >/dev/null ;;
  esac
  for file in "$built"/*; do
    mv -f "$file" "$out/"
    log "$platform: $out/$(basename "$file") ($(du -h "$out/$(basename "$file")" | cut -f1))"
  done
done
log "built in $((SECONDS - start)) s"
echo "$out"
