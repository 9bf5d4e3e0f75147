#!/usr/bin/env bash
# Makes sure NVIDIA's container toolkit CLIs (nvidia-ctk and nvidia-cdi-hook) exist and prints
# their directory as the last line. They are the reference for what a GPU container needs: the
# tests compare gpudra's CDI specs with what `nvidia-ctk cdi generate` makes of the same driver root.
#
# Order: $GPUDRA_NVIDIA_CTK_DIR (if it has both) -> the version-keyed cache -> a build of
# github.com/NVIDIA/nvidia-container-toolkit at NVIDIA_CTK_VERSION from the Go module proxy
# (cgo; about a minute cold, then cached). Progress goes to stderr; only the directory goes to stdout.
set -euo pipefail

NVIDIA_CTK_VERSION="${NVIDIA_CTK_VERSION:-v1.20.2}"
MODULE=github.com/NVIDIA/nvidia-container-toolkit
TOOL=nvidia-ctk-bin
BINARIES=(nvidia-ctk nvidia-cdi-hook)
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-tool.sh"
BIN_DIR="$CACHE_ROOT/nvidia-ctk/$NVIDIA_CTK_VERSION"

use_given_dir GPUDRA_NVIDIA_CTK_DIR
use_cached "$BIN_DIR"
require_go "$MODULE $NVIDIA_CTK_VERSION" GPUDRA_NVIDIA_CTK_DIR
command -v "$(go env CC)" >/dev/null || { log "no C compiler ($(go env CC)): nvidia-ctk needs cgo (go-nvml); install gcc"; exit 1; }

new_stage "$BIN_DIR"
# cgo writes its probe files to $TMPDIR and gcc resolves `#include "nvml.h"` there first: a stray
# nvml.h in /tmp breaks go-nvml's build. So the build gets a clean TMPDIR of its own.
mkdir "$STAGE/tmp" "$STAGE/bin"

# What upstream's Makefile passes: the version stamp and the lazy, unresolved-symbol-tolerant link
# (libnvidia-ml is dlopen'ed at run time, never linked).
pkg="$MODULE/internal/info"
ldflags="-s -w '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
ldflags+=" -X $pkg.version=${NVIDIA_CTK_VERSION#v} -X $pkg.gitCommit=module-$NVIDIA_CTK_VERSION"

start=$SECONDS
log "building ${BINARIES[*]} $NVIDIA_CTK_VERSION from the Go module proxy (cgo; about a minute cold, first time only)"
# Outside any module, so the pinned version's own go.mod decides every dependency.
(cd "$STAGE/tmp" && TMPDIR="$STAGE/tmp" GOFLAGS=-mod=mod GOBIN="$STAGE/bin" CGO_ENABLED=1 \
  go install -trimpath -ldflags "$ldflags" \
  "$MODULE/cmd/nvidia-ctk@$NVIDIA_CTK_VERSION" "$MODULE/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION" >&2)
has_all "$STAGE/bin" || { log "FAILED: missing binaries in $STAGE/bin"; exit 1; }
version="$("$STAGE/bin/nvidia-ctk" --version 2>&1 | head -n 1)"
[[ "$version" == *"${NVIDIA_CTK_VERSION#v}"* ]] || { log "FAILED: nvidia-ctk --version says '$version', want ${NVIDIA_CTK_VERSION#v}"; exit 1; }
for b in "${BINARIES[@]}"; do mv -f "$STAGE/bin/$b" "$BIN_DIR/$b"; done
log "built in $((SECONDS - start)) s: $BIN_DIR ($version)"
echo "$BIN_DIR"
