#!/usr/bin/env bash
# Builds the previous release (`make previous-release`; tests/e2e/test_upgrade.py): the commit that
# hack/previous-release pins, checked out as a git worktree under the cache, its images built by its
# own hack/images.sh and its chart packaged by helm, so the upgrade and rollback tests install
# exactly what users of that release run. Prints, as its last lines on stdout, key=value lines:
#
#   commit=<sha>  version=<release>  tree=<worktree>  image_tag=<tag>
#   operator_image=<ref>  agent_image=<ref>  chart=<packaged chart .tgz>  chart_version=<semver>
#
# The images are tagged previous-<sha12> (never the tree's own tag, which may be the same version),
# the chart versioned <version>-previous.<sha12>, so both releases live side by side in podman's
# store and in one registry. Everything is cached: the worktree by commit, the images by their
# inputs (hack/images.sh's content label), the chart by commit.
#
# Needs the pinned commit in this clone: a shallow clone lacks it (git fetch --unshallow).
set -euo pipefail
shopt -s inherit_errexit

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_ROOT="${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}"
PIN="$REPO/hack/previous-release"

log() { printf '[previous-release] %s\n' "$*" >&2; }
die() { printf '[previous-release] error: %s\n' "$*" >&2; exit 1; }

commit="$(sed -n 's/^commit=//p' "$PIN")"
version="$(sed -n 's/^version=//p' "$PIN")"
[[ "$commit" =~ ^[0-9a-f]{40}$ ]] || die "$PIN: commit= must be a full 40-hex commit, got '$commit'"
[[ -n "$version" ]] || die "$PIN: no version="
git -C "$REPO" cat-file -e "$commit^{commit}" 2>/dev/null \
  || die "commit $commit (hack/previous-release) is not in this clone: git -C $REPO fetch --unshallow (or fetch the release tag)"

short="${commit:0:12}"
tree="$CACHE_ROOT/previous-release/$short"
# A worktree of this clone at the pinned commit. One left by another clone (the cache outlives
# checkouts) is not this clone's: replace it.
if [[ "$(git -C "$tree" rev-parse HEAD 2>/dev/null || true)" != "$commit" ]] \
   || [[ "$(git -C "$tree" rev-parse --git-common-dir 2>/dev/null || true)" != "$(git -C "$REPO" rev-parse --path-format=absolute --git-common-dir)" ]]; then
  log "checking out $commit as a worktree in $tree"
  rm -rf "$tree"
  git -C "$REPO" worktree prune
  mkdir -p "$(dirname "$tree")"
  git -C "$REPO" worktree add --force --detach "$tree" "$commit" >&2
fi

tag="previous-$short"
log "images of $version ($short), tagged $tag (its own hack/images.sh; cached by content)"
refs="$(IMAGE_TAG="$tag" "$tree/hack/images.sh" operator agent | tail -n 1)"
operator_image="" agent_image=""
for ref in $refs; do
  case "$ref" in
    */gpudra-operator:*) operator_image="$ref" ;;
    */gpudra:*) agent_image="$ref" ;;
  esac
done
[[ -n "$operator_image" && -n "$agent_image" ]] || die "its hack/images.sh printed '$refs', not both images"

helm="$("$REPO/hack/helm-bin.sh" | tail -n 1)"
chart_version="$version-previous.$short"
chart_dir="$CACHE_ROOT/previous-release/charts"
chart="$chart_dir/gpudra-$chart_version.tgz"
if [[ ! -f "$chart" ]]; then
  log "packaging its chart as $chart_version"
  mkdir -p "$chart_dir"
  "$helm" package "$tree/manifests/helm/gpudra" --version "$chart_version" --app-version "$version" \
    --destination "$chart_dir" >&2
fi

printf 'commit=%s\nversion=%s\ntree=%s\nimage_tag=%s\noperator_image=%s\nagent_image=%s\nchart=%s\nchart_version=%s\n' \
  "$commit" "$version" "$tree" "$tag" "$operator_image" "$agent_image" "$chart" "$chart_version"
