#!/usr/bin/env bash
# Makes sure this machine runs another architecture's programs: qemu-user-static's handler for it
# registered in the kernel's binfmt_misc with the F (fix binary) flag, so that containers, whose
# root has no qemu, use it too. hack/images.sh needs it for the other architecture's RUN steps and
# debootstrap's second stage; hack/debian-packages.sh calls it after installing qemu-user-static.
#
#   hack/emulation.sh arm64|amd64      (nothing to do for this machine's own)
#
# Idempotent: as root it mounts binfmt_misc where it is not mounted and registers the handler
# (update-binfmts, from binfmt-support, reads qemu-user-static's /usr/share/binfmts/qemu-<arch>:
# fix_binary yes); otherwise it names the command that does. Exits 0 once the handler is there.
set -euo pipefail

die() { printf '[emulation] error: %s\n' "$*" >&2; exit 1; }

case "${1:-}" in
  arm64) qemu_arch=aarch64 ;;
  amd64) qemu_arch=x86_64 ;;
  *) die "usage: hack/emulation.sh arm64|amd64" ;;
esac
case "$(uname -m)" in
  x86_64|amd64) [[ "$1" != amd64 ]] || exit 0 ;;
  aarch64|arm64) [[ "$1" != arm64 ]] || exit 0 ;;
esac

MISC=/proc/sys/fs/binfmt_misc
HANDLER="$MISC/qemu-$qemu_arch"
FIX_PACKAGES="apt-get install qemu-user-static binfmt-support (or: hack/debian-packages.sh)"
FIX_MOUNT="mount -t binfmt_misc binfmt_misc $MISC"
FIX_ENABLE="update-binfmts --enable qemu-$qemu_arch"

ready() { [[ -r "$HANDLER" ]] && grep -qx enabled "$HANDLER" && grep -q '^flags:.*F' "$HANDLER"; }
ready && exit 0

[[ -e "/usr/share/binfmts/qemu-$qemu_arch" ]] && command -v update-binfmts >/dev/null \
  || die "running $1 programs needs qemu-user-static and binfmt-support: $FIX_PACKAGES (as root)"
if [[ $(id -u) -ne 0 ]]; then
  [[ -e "$MISC/status" ]] || die "binfmt_misc is not mounted: as root, $FIX_MOUNT && $FIX_ENABLE"
  die "no binfmt_misc handler for $qemu_arch with the F flag: as root, $FIX_ENABLE"
fi
if [[ ! -e "$MISC/status" ]]; then
  mount -t binfmt_misc binfmt_misc "$MISC" || die "cannot mount binfmt_misc ($FIX_MOUNT failed): a container needs the host to do it"
fi
# Registered by something else without the F flag (or disabled): remove it, then register Debian's.
if [[ -e "$HANDLER" ]]; then echo -1 >"$HANDLER"; fi
update-binfmts --enable "qemu-$qemu_arch" >&2 || die "$FIX_ENABLE failed"
ready || die "after $FIX_ENABLE, $HANDLER is not an enabled handler with the F flag: $(tr '\n' ' ' <"$HANDLER" 2>/dev/null)"
printf '[emulation] registered qemu-%s in binfmt_misc (flags F)\n' "$qemu_arch" >&2
