"""Atomic file replacement: a reader, or an agent restarted after a crash, sees the old content or
the new, never a mix.

Temp file in the same directory, written, then renamed over the target. Nothing is fsync'd: the
files written here promise to survive the agent process, not the kernel (docs/kubelet-plugin.md,
"Durability"). A killed process never loses the page cache, so the rename is already durable
against it; a kernel crash or power loss is a reboot, which voids the checkpoint (boot ID) and
makes the kubelet prepare every claim again.
"""

from __future__ import annotations

import os
from pathlib import Path

TEMP_MARK = ".tmp-"


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (temp file ``.<name>.tmp-<pid>``, then rename).
    Callers serialise writers of one path (the node lock), so one temp name per process is enough."""
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def read_file(path: Path) -> bytes | None:
    """The file's bytes, None when it does not exist."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def remove(path: Path) -> bool:
    """Unlink ``path``; False when it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
