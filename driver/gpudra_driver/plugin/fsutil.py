"""Crash-safe file replacement: after a crash a reader sees the old content or the new, never a mix.

Temp file in the same directory → write → fsync → rename over the target → fsync the directory
(so the rename itself survives power loss)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, fsync: bool = True, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically. ``fsync``/``sync_dir`` add durability across power
    loss; without them the replacement is still atomic for every reader and survives the writer's
    own crash (the kernel's page cache outlives any process)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync_dir:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> bool:
    """Unlink ``path``; False when it was already gone. The caller fsyncs the directory."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
