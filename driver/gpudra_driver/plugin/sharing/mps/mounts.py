"""The mounts of an MPS claim's directories (:mod:`gpudra_driver.plugin.sharing.mps.supervisor`), and the removal
of what a tenant left in them without walking more of it than a bounded tmpfs can hold.

Each claim's ``pipe`` and ``shm`` are tmpfs mounts of a fixed size and number of inodes: a tenant
(root in its containers, which mount both read-write) fills its own bound, never the kubelet's
disk, and whatever tree it builds there is at most that many entries deep and wide. ``pipe`` is
also ``nosymfollow``: a link planted there (``control`` at another claim's socket, the PID file at
a file of the supervisor's) is followed by no one, so the supervisor's client calls need no view
of their own.

``python -m gpudra_driver.plugin.sharing.mps.mounts [--shm DIR] -- PROGRAM ARGS...`` is how the supervisor starts
a daemon: a fresh single-threaded process (no ``preexec_fn`` in a threaded supervisor) that waits
for one line on stdin (the supervisor sends it once its record of this PID is written: a
supervisor that dies before that closes the pipe, and the helper exits without starting
anything), then, with ``--shm``, enters a mount namespace of its own with DIR at ``/dev/shm``
(``nosymfollow``), and execs PROGRAM: the same PID and start time, so the record names the daemon.
The line is ``go`` and, after a space, PROGRAM's environment as a JSON object: the helper's own
Python runs with the supervisor's environment, not with the driver root's ``LD_LIBRARY_PATH``
(on a node, the host's libc and libffi, which the image's Python may not load), and only PROGRAM
gets it."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PIPE_SIZE = 1 * 2**20  # bytes: MPS keeps sockets, a lock and a PID file there (its logs go to log/)
PIPE_INODES = 256  # files and directories in a claim's pipe directory, the tmpfs root included
VIEW_FAILED = 125  # the helper's exit status when its mount namespace could not be set up
MAX_GO_LINE = 1 * 2**20  # bytes: the helper's "go" line with the program's environment

_CLONE_NEWNS = 0x20000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 0x2, 0x4, 0x8, 0x20
_MS_NOSYMFOLLOW, _MS_BIND, _MS_REC, _MS_SLAVE = 0x100, 0x1000, 0x4000, 0x80000
_MNT_DETACH = 0x2
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ok: bool, what: str) -> None:
    if not ok:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def shm_inodes(size: int) -> int:
    """Inodes of a claim's /dev/shm tmpfs: one per page of its size (a file holding data takes a
    page anyway), so empty files cannot cost more kernel memory than the size allows."""
    return max(1024, size // 4096)


def mount_tmpfs(path: Path, size: int, inodes: int, mode: int, *, nosymfollow: bool = False) -> None:
    """A tmpfs of ``size`` bytes and ``inodes`` inodes at ``path``, as a container runtime mounts
    /dev/shm: no devices, set-user-ID or executables."""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | (_MS_NOSYMFOLLOW if nosymfollow else 0)
    options = f"size={size},nr_inodes={inodes},mode={mode:o}".encode()
    _check(_libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) == 0,
           f"mounting a tmpfs of {size} bytes at {path}")


def unmount(path: Path) -> None:
    """Unmount what is mounted at ``path`` (lazily: a container may still hold it open)."""
    for _ in range(8):  # a stack, should one have formed; each round takes the top
        if not os.path.ismount(path):
            return
        if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
            log.warning("unmounting %s failed: %s", path, os.strerror(ctypes.get_errno()))
            return


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class EmptyingStopped(OSError):
    """A directory was not emptied within its bound: someone (a tenant's container, which mounts
    it read-write) keeps writing into it faster than it is emptied."""


def empty_directory(directory: Path, *, max_ops: int | None = None, deadline: float | None = None) -> None:
    """Remove what ``directory`` holds, following no symlink, without recursion (a tenant's tree
    may be deeper than Python's stack) and with one directory descriptor open per level. What
    cannot be removed (a mount point) is left.

    With ``max_ops`` (directory scans and entries removed or tried) or ``deadline`` (a
    :func:`time.monotonic` time), :class:`EmptyingStopped` once either is spent: a tenant that
    keeps creating directories with a file in each (``d1/f``, ``d2/f``, ...) while this runs
    would otherwise keep it going for as long as it likes."""
    ops = 0

    def spend() -> None:
        nonlocal ops
        ops += 1
        if max_ops is not None and ops > max_ops:
            raise EmptyingStopped(f"{directory} still not empty after {max_ops} operations: "
                                  "something keeps writing into it")
        if deadline is not None and time.monotonic() > deadline:
            raise EmptyingStopped(f"{directory} still not empty at its deadline: "
                                  "something keeps writing into it")

    stack: list[tuple[int, set[str]]] = [(os.open(directory, _DIRECTORY), set())]
    try:
        while stack:
            fd, emptied = stack[-1]
            child = None
            spend()
            with os.scandir(fd) as entries:
                for entry in entries:
                    spend()
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            os.unlink(entry.name, dir_fd=fd)
                            continue
                        try:
                            os.rmdir(entry.name, dir_fd=fd)
                        except OSError:
                            if entry.name not in emptied:  # not empty: empty it first, then try again
                                emptied.add(entry.name)
                                child = os.open(entry.name, _DIRECTORY, dir_fd=fd)
                                break
                    except FileNotFoundError:
                        continue
            if child is not None:
                stack.append((child, set()))
            else:
                os.close(stack.pop()[0])  # emptied: its parent's next scan removes it
    finally:
        for fd, _ in stack:
            os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove ``path`` and what it holds (without recursion, following no symlink); gone already is fine."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        empty_directory(path)
        os.rmdir(path)
    except FileNotFoundError:
        pass


def _bind_nosymfollow(source: bytes, target: bytes, flags: int) -> None:
    _check(_libc.mount(source, target, None, _MS_BIND, None) == 0, f"binding {source!r} to {target!r}")
    _check(_libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSYMFOLLOW | flags, None) == 0,
           f"remounting {target!r} nosymfollow")


def _enter_view(shm: str) -> None:
    """A private mount namespace with ``shm`` at /dev/shm, following no symlink."""
    _check(_libc.unshare(_CLONE_NEWNS) == 0, "unshare(CLONE_NEWNS)")
    # a slave: what this namespace mounts stays in it, and a claim's tmpfs the supervisor unmounts
    # goes from it at once (a private copy would hold its pages until the directory went)
    _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) == 0, "making / a slave")
    _bind_nosymfollow(os.fsencode(shm), b"/dev/shm", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def helper_command(program: str, args: list[str], shm: Path | None) -> list[str]:
    """The command line that starts ``program`` through this module's helper."""
    return [sys.executable, "-m", __name__, *(["--shm", str(shm)] if shm is not None else []), "--", program, *args]


def main(argv: list[str]) -> int:
    shm = None
    if argv[:1] == ["--shm"]:
        shm, argv = argv[1], argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m gpudra_driver.plugin.sharing.mps.mounts [--shm DIR] -- PROGRAM ARGS...", file=sys.stderr)
        return 2
    line = sys.stdin.buffer.readline(MAX_GO_LINE)
    if line == b"go\n":
        env = dict(os.environ)
    elif line.startswith(b"go ") and line.endswith(b"\n"):
        try:  # the program's environment: this Python's is the supervisor's own (no driver root libraries)
            given = json.loads(line[3:])
        except ValueError:
            given = None
        if not isinstance(given, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in given.items()):
            print("gpudra_driver.plugin.sharing.mps.mounts: the environment is not an object of strings", file=sys.stderr)
            return 2
        env = given
    else:
        return 1  # the supervisor went before it recorded this process: start nothing
    try:
        if shm is not None:
            _enter_view(shm)
    except OSError as error:
        print(f"gpudra_driver.plugin.sharing.mps.mounts: {error}", file=sys.stderr)
        return VIEW_FAILED
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.execve(argv[1], argv[1:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
