"""Unix socket paths longer than ``sun_path`` allows (108 bytes).

The kubelet's own directories are short (/var/lib/kubelet/...), but a kubelet root configured
deep, or a test's temporary directory, is not. On Linux a socket can be bound or connected through
the directory's ``/proc/self/fd/<n>`` entry, which keeps the address short while the socket file
lands in the real directory. :class:`SocketAddress` does that only when the path needs it."""

from __future__ import annotations

import os
from pathlib import Path

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class SocketAddress:
    """A gRPC ``unix:`` target for ``path``; close() releases the directory handle if one was used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dir_fd: int | None = None
        if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
            self.address = os.fspath(path)
        else:
            self._dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self.address = f"/proc/self/fd/{self._dir_fd}/{path.name}"
            if len(os.fsencode(self.address)) > MAX_SOCKET_PATH:
                self.close()
                raise ValueError(f"unix socket name {path.name!r} is too long")

    @property
    def target(self) -> str:
        return f"unix:{self.address}"

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> SocketAddress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
