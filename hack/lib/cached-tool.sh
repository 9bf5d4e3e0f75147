# Sourced by the hack/*-bin.sh scripts that build a pinned Go tool once and cache it:
#   TOOL=<name> (log prefix) and BINARIES=(...) set by the caller, then
#   use_given_dir VAR    -> prints $VAR and exits when that directory holds every binary
#   use_cached DIR       -> prints DIR and exits when it holds every binary
#   require_go WHAT VAR  -> exits with the fix when there is no Go toolchain
#   new_stage DIR        -> STAGE, a scratch dir inside DIR removed on exit (moves into DIR are atomic)
# The cache root is the one every script and test uses: $GPUDRA_CACHE, else $XDG_CACHE_HOME/gpudra,
# else ~/.cache/gpudra. Progress goes to stderr; the scripts print only the directory on stdout.
CACHE_ROOT="${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}"

log() { printf '[%s] %s\n' "$TOOL" "$*" >&2; }

has_all() {
  local dir="$1" b
  for b in "${BINARIES[@]}"; do [[ -x "$dir/$b" ]] || return 1; done
}

use_given_dir() {
  local var="$1" dir="${!1:-}"
  [[ -n "$dir" ]] || return 0
  if has_all "$dir"; then
    log "using \$$var=$dir"
    echo "$dir"; exit 0
  fi
  log "\$$var=$dir lacks one of: ${BINARIES[*]}; falling back"
}

use_cached() {
  if has_all "$1"; then
    log "cached: $1"
    echo "$1"; exit 0
  fi
}

require_go() {
  command -v go >/dev/null || { log "no Go toolchain to build $1: install Go >= 1.26, or set $2 to a directory with ${BINARIES[*]}"; exit 1; }
}

new_stage() {
  mkdir -p "$1"
  STAGE="$(mktemp -d "$1/.stage.XXXXXX")"
  trap 'rm -rf "$STAGE"' EXIT
}

# build_pinned_go_tool SRC NAME VAR MODULE [CACHE]: the whole job for one binary built from the
# pinned Go module in SRC (main.go, go.mod, go.sum): $VAR if it has it (VAR may be empty), else the
# cache ($CACHE_ROOT/CACHE, CACHE defaulting to SRC's name) keyed by a hash of those sources (the
# tests compute the same path), else a build; prints the directory.
build_pinned_go_tool() {
  local src="$1" name="$2" var="$3" module="$4" cache="${5:-$(basename "$1")}" hash start
  hash="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-16)"
  local dir="$CACHE_ROOT/$cache/$hash"
  [[ -z "$var" ]] || use_given_dir "$var"
  use_cached "$dir"
  require_go "$name" "$var"
  new_stage "$dir"
  start=$SECONDS
  log "building $name ($(go -C "$src" list -m -f '{{.Path}} {{.Version}}' "$module")) from the Go module proxy"
  (cd "$src" && CGO_ENABLED=0 go build -trimpath -mod=readonly -ldflags "-s -w" -o "$STAGE/$name" . >&2)
  mv -f "$STAGE/$name" "$dir/$name"
  log "built in $((SECONDS - start)) s: $dir/$name"
  echo "$dir"
}
