#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, and only those that are missing
# (checked with `dpkg -s`): `apt-get update` runs once, first, and only when something is missing.
# Prints what it installs. Needs root (or sudo) only when something is missing.
#
# One list for the whole project: append what your target needs to PACKAGES, with a comment.
set -euo pipefail

PACKAGES=(
  # make images / tests/integration/test_images.py (hack/images.sh): the engine, its OCI runtime
  # (runc; Debian's crun refuses these hybrid-cgroup machines) and the stand-in Python base image
  # (debootstrap, which downloads with wget).
  podman
  runc
  debootstrap
  wget
  # make mock-nvml: the mock libnvidia-ml.so.1 the agent-image test mounts in a fake driver root.
  gcc
  libc6-dev
  # tests/e2e/test_real_runtime.py: containerd's OCI runtime (runc, above), the test and pause
  # images' static busybox, and util-linux's unshare/nsenter for the node's mount namespace.
  busybox-static
  util-linux
  # make images-multiarch / tests/integration/test_images_arm64.py: the other architecture's RUN
  # steps under qemu's user-mode emulation (hack/emulation.sh registers it in binfmt_misc), and the
  # mock NVML cross-compiled for arm64.
  qemu-user-static
  binfmt-support
  gcc-aarch64-linux-gnu
  libc6-dev-arm64-cross
)

# The other of the images' two architectures runs under emulation: its binfmt_misc handler is
# registered (and binfmt_misc mounted) by hack/emulation.sh, which this runs every time because a
# reboot or a fresh container forgets the registration that qemu-user-static's install made.
other_arch() { case "$(uname -m)" in x86_64) echo arm64 ;; aarch64) echo amd64 ;; esac; }
emulation() {
  local arch
  arch="$(other_arch)"
  [[ -n "$arch" ]] || return 0
  "${sudo[@]}" "$(dirname "${BASH_SOURCE[0]}")/emulation.sh" "$arch"
}

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
sudo=()
if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then sudo=(sudo); fi
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "[debian-packages] all installed: ${PACKAGES[*]}" >&2
  emulation
  exit 0
fi

if [[ $(id -u) -ne 0 && ${#sudo[@]} -eq 0 ]]; then
  echo "[debian-packages] missing ${missing[*]}: run this as root" >&2; exit 1
fi
echo "[debian-packages] installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
emulation
