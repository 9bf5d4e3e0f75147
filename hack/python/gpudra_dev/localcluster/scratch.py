"""Scratch directories in shared memory (``/dev/shm``) that do not outlive their process for long.

etcd's data and a bench's CDI specs live in memory, and are removed when the cluster stops. A run
killed outright (SIGKILL, a CI timeout) cannot remove them, and memory is not reclaimed by a
reboot that never comes on a developer's machine: each left etcd directory holds tens of MiB.
So every such directory carries an owner lock, an ``flock`` that its process holds open until it
exits (the kernel drops it however the process ends), and the next directory created under the
same prefix removes those whose lock nobody holds any more."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
OWNER_LOCK = "owner.lock"


def in_memory_or(fallback: Path) -> Path:
    """/dev/shm where it exists, else ``fallback``."""
    return SHM if SHM.is_dir() else fallback


class ScratchDir:
    """A new directory ``<parent>/<prefix>XXXXXXXX``, owned by this process until :meth:`remove`
    or its exit; the orphans of ``prefix`` in ``parent`` are removed first."""

    def __init__(self, prefix: str, parent: Path) -> None:
        remove_orphans(parent, prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        # Locked before it has its name, so a sweep never finds it unlocked.
        staging = self.path / f".{OWNER_LOCK}"
        self._fd: int | None = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(staging, self.path / OWNER_LOCK)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_orphans(parent: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix`` directories under ``parent`` whose owner has exited; returns them.
    Only real directories of this user count (``/dev/shm`` is everybody's). A directory without an
    owner lock is left alone: its creator may be about to lock it, or it predates owner locks."""
    removed = []
    for candidate in parent.glob(f"{prefix}*"):
        try:
            info = candidate.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        try:
            fd = os.open(candidate / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # no lock (yet), not a directory, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner is alive
            continue
        finally:
            os.close(fd)  # drops our lock too, if we got it
        shutil.rmtree(candidate, ignore_errors=True)
        log.info("removed %s, left by a run that was killed", candidate)
        removed.append(candidate)
    return removed
