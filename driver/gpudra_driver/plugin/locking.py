"""The per-node lock that serialises prepare and unprepare across agent instances.

During a DaemonSet rolling update two agents run side by side and the kubelet may send a call to
either; both read and write the same checkpoint and CDI directory. ``flock`` on one file in the
plugin directory makes their read-modify-write sections exclusive. The kernel drops the lock when
its holder dies (SIGKILL included), so a crashed agent never wedges the node.

flock belongs to an open file description, so the lock is taken with a fresh descriptor each
time; within one process calls are serialised before they get here (:mod:`.calllocks`).
:func:`node_lock_async` is the same lock for a call on the event loop: uncontended it never leaves
the loop; contended (a peer instance holds it) it waits without blocking the loop.

Not the ``filelock`` library: its acquire and release cost two orders of magnitude more than the
flock itself (bench/README.md), on the kubelet's critical path."""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

LOCK_FILE = "serialize.lock"
# How long a prepare or unprepare waits for a peer holding the lock. With the claim GET's own limit
# (plugin.CLAIM_GET_TIMEOUT, 10 s) and the writes it stays under the kubelet's 45 s per call, so a
# stuck peer turns into a per-claim error the kubelet logs and retries, not a deadline exceeded.
LOCK_TIMEOUT = 25.0


class LockTimeout(TimeoutError):
    pass


@contextmanager
def node_lock(path: Path, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing). Blocking; call it off the event loop."""
    with _lock_file(path) as fd:
        for delay in _attempts(fd, path, timeout):
            time.sleep(delay)
        yield


@asynccontextmanager
async def node_lock_async(path: Path, timeout: float = LOCK_TIMEOUT) -> AsyncIterator[None]:
    """:func:`node_lock` for a coroutine: while a peer holds the lock, the event loop keeps serving."""
    with _lock_file(path) as fd:
        for delay in _attempts(fd, path, timeout):
            await asyncio.sleep(delay)
        yield


@contextmanager
def _lock_file(path: Path) -> Iterator[int]:
    """The lock file, open; unlocked (if it was locked) and closed on the way out."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _attempts(fd: int, path: Path, timeout: float) -> Iterator[float]:
    """Try to lock ``fd``; while a peer holds the lock, yield how long to wait before the next try.
    A blocking flock cannot time out, so a contended lock is polled with a short backoff (this
    waits on a peer process, it does not synchronise anything of ours)."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # uncontended: no waiting at all
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{path} is held by another agent instance for over {timeout:.1f}s") from None
        yield delay
        delay = min(delay * 2, 0.05)
