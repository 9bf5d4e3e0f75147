#!/usr/bin/env bash
# `make sbom`: a CycloneDX SBOM (JSON, spec 1.6) of gpudra's Python distribution: gpudra itself (the
# root component, from pyproject.toml) and every package that `pip install gpudra` brings, as pip
# resolves [project].dependencies now, into a virtualenv of its own (build/sbom/venv, without pip,
# so that the SBOM lists the dependencies and nothing else). By PyPI's cyclonedx-bom (cyclonedx-py,
# in the test extras of the development venv). Prints the SBOM's path as the last line.
#   SBOM_OUT   directory of the SBOM (default dist): <SBOM_OUT>/gpudra-<version>.cdx.json
#   PYTHON     the interpreter of the SBOM's virtualenv (default python3)
#   VENV       the development virtualenv with cyclonedx-py (default .venv; make venv)
# Not in it: gpudra-allocator's Go modules (in the platform wheels and the operator image; the
# images' SBOMs, `make sbom-images` (hack/sbom-images.sh), list those of the operator image).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SBOM_OUT="${SBOM_OUT:-dist}"
DEV="${VENV:-.venv}"
WORK=build/sbom
log() { printf '[sbom] %s\n' "$*" >&2; }

[[ -x "$DEV/bin/cyclonedx-py" ]] || { log "no $DEV/bin/cyclonedx-py: run make venv (it installs the test extras)"; exit 1; }
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
# The dependencies as written in pyproject.toml: what a user's pip resolves.
mapfile -t requirements < <("$DEV/bin/python" -c '
import tomllib
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(requirement)')
[[ ${#requirements[@]} -gt 0 ]] || { log "FAILED: no [project].dependencies in pyproject.toml"; exit 1; }

# Reused while the dependencies and the interpreter are the same (a release runs on a fresh machine).
stamp="$(printf '%s\n' "${requirements[@]}" "$("${PYTHON:-python3}" --version 2>&1)" | sha256sum | cut -c1-16)"
if [[ "$(cat "$WORK/venv/.stamp" 2>/dev/null)" != "$stamp" ]]; then
  log "resolving ${#requirements[@]} dependencies into $WORK/venv"
  rm -rf "$WORK/venv"
  mkdir -p "$WORK"
  "${PYTHON:-python3}" -m venv --without-pip "$WORK/venv"
  "$DEV/bin/python" -m pip --python "$WORK/venv/bin/python" install --quiet --disable-pip-version-check \
    --no-input "${requirements[@]}" >&2
  echo "$stamp" >"$WORK/venv/.stamp"
fi

mkdir -p "$SBOM_OUT"
out="$SBOM_OUT/gpudra-$version.cdx.json"
# Reproducible: no random serial number; the timestamp is the commit's.
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}" \
  "$DEV/bin/cyclonedx-py" environment --pyproject pyproject.toml --mc-type application --sv 1.6 --of JSON \
  --output-reproducible --validate -o "$out" "$WORK/venv/bin/python" >&2
log "wrote $out ($("$DEV/bin/python" -c 'import json, sys; print(len(json.load(open(sys.argv[1])).get("components", [])))' "$out") components)"
echo "$out"
