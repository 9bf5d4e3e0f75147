"""The NVIDIA driver root: where the driver's user-space files are, and how to find them safely.

A driver root is a directory laid out like a host's ``/``: ``/`` for a driver installed on the host,
``/run/nvidia/driver`` for the GPU Operator's driver container, ``/home/kubernetes/bin/nvidia`` on
GKE. The agent sees it at another path (``/driver-root`` in its pod), so two paths are kept apart:

* ``host``: the root as the host (and so the container runtime) sees it; CDI host paths use it;
* ``local``: where this process can read it (the same path for a host process).

Every file is looked up with symlinks resolved *inside* the root: an absolute link target is taken
relative to the root (as the host or the driver container would resolve it), and a link that climbs
out of the root with ``..`` is an error, never followed. That is what a driver container's root
needs: its ``libnvidia-ml.so.1`` links to ``/usr/lib/...`` inside the container, not on the host.

The library search follows NVIDIA's own lookup (nvidia-container-toolkit ``internal/lookup``
``NewLibraryLocator``: a fixed list of lib dirs, then the root's ``/etc/ld.so.cache``), so a root
that ``nvidia-ctk cdi generate --driver-root`` accepts is a root the agent accepts.
"""

from __future__ import annotations

import os
import platform
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NVML_LIBRARY = "libnvidia-ml.so.1"

# nvidia-container-toolkit internal/lookup/library.go (NewLibraryLocator), relative to the root,
# in its order; "usr/lib" and "lib" added for distributions that put the driver there.
LIBRARY_DIRS: tuple[str, ...] = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
    "usr/lib",
    "lib",
)

_MAX_LINKS = 40  # the kernel's own limit on symlinks in one lookup (MAXSYMLINKS)

# ELF e_machine values (elf.h) of the architectures NVIDIA ships drivers for.
_ELF_MACHINES = {62: "x86_64", 183: "aarch64", 3: "i386", 40: "arm", 21: "ppc64le"}
_HOST_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21}


class DriverRootError(RuntimeError):
    """The driver root cannot be used as it is; the message names the root and what was tried."""


@dataclass(frozen=True)
class DriverRoot:
    host: str  # as the host sees it: the base of every CDI hostPath
    local: Path  # where this process reads it

    @classmethod
    def at(cls, host: str, local: str | Path | None = None) -> DriverRoot:
        if not host.startswith("/"):
            raise DriverRootError(f"driver root {host!r} is not an absolute path")
        return cls(os.path.normpath(host), Path(local if local is not None else host))

    def describe(self) -> str:
        return self.host if str(self.local) == self.host else f"{self.host} (read at {self.local})"

    def host_path(self, path: str) -> str:
        """The host's path of ``path`` (a path inside the root, e.g. ``/usr/bin/nvidia-smi``)."""
        return path if self.host == "/" else self.host + path

    def check(self) -> None:
        """A missing or empty root is a configuration error, said once at start-up."""
        if not self.local.is_dir():
            raise DriverRootError(f"driver root {self.describe()} does not exist or is not a directory")
        try:
            with os.scandir(self.local) as entries:
                empty = not any(entries)
        except OSError as error:
            raise DriverRootError(f"driver root {self.describe()} cannot be read: {error}") from None
        if empty:
            raise DriverRootError(f"driver root {self.describe()} is empty: is the driver (container) "
                                  "installed, and is driverRoot the right path?")

    def resolve(self, path: str) -> str | None:
        """``path`` (inside the root) with every symlink resolved inside the root; None when it does
        not exist. Raises :class:`DriverRootError` for a link that leaves the root or loops."""
        return resolve_in_root(self.local, path)

    def find_library(self, name: str, dirs: tuple[str, ...] = LIBRARY_DIRS) -> tuple[str, str] | None:
        """(the path found, its resolved path), both inside the root, or None. The soname link is
        what is looked up; the resolved file carries the version (``libcuda.so.580.95.05``). A link
        that leads out of the root is skipped like a missing file, and the search goes on; when
        nothing is found, :class:`DriverRootError` names the links that were refused."""
        refused: list[str] = []

        def candidates() -> Iterator[str]:
            yield from (f"/{d}/{name}" for d in dirs)
            cached = ld_cache_lookup(self.local, name)  # read only when the dirs have nothing
            if cached:
                yield cached

        for candidate in candidates():
            try:
                resolved = self.resolve(candidate)
            except DriverRootError as error:
                refused.append(str(error))
                continue
            if resolved is not None and (self.local / resolved.lstrip("/")).is_file():
                return candidate, resolved
        if refused:
            raise DriverRootError("; ".join(refused))
        return None

    def searched(self, name: str) -> list[str]:
        return [f"{self.local / d / name}" for d in LIBRARY_DIRS] + [f"{self.local / 'etc/ld.so.cache'}"]


@dataclass(frozen=True)
class NvmlLibrary:
    path: Path  # the file to open, by full path (inside the local root)
    version: str | None  # from the resolved file name, libnvidia-ml.so.<version>


def locate_nvml(root: DriverRoot) -> NvmlLibrary:
    """``libnvidia-ml.so.1`` in the driver root, checked to be a loadable ELF for this machine."""
    root.check()
    found = root.find_library(NVML_LIBRARY)
    if found is None:
        raise DriverRootError(
            f"{NVML_LIBRARY} was not found in driver root {root.describe()}; searched: "
            + ", ".join(root.searched(NVML_LIBRARY))
            + ". Is the NVIDIA driver installed there (driverRoot: / for a host install, "
            "/run/nvidia/driver for the GPU Operator's driver container)?")
    _, resolved = found
    path = root.local / resolved.lstrip("/")
    check_elf(path, root)
    return NvmlLibrary(path, library_version(resolved, "libnvidia-ml.so"))


def library_version(resolved: str, stem: str) -> str | None:
    """``580.95.05`` from ``.../libnvidia-ml.so.580.95.05``; None for a file named otherwise."""
    name = PurePosixPath(resolved).name
    match = re.fullmatch(re.escape(stem) + r"\.(\d+\.\d+(?:\.\d+)?)", name)
    return match.group(1) if match else None


def check_elf(path: Path, root: DriverRoot) -> None:
    """A library this process can load: ELF, 64-bit, this machine's architecture."""
    try:
        with path.open("rb") as file:
            header = file.read(20)
    except OSError as error:
        raise DriverRootError(f"{path} in driver root {root.describe()} cannot be read: {error}") from None
    if len(header) < 20 or header[:4] != b"\x7fELF":
        raise DriverRootError(f"{path} in driver root {root.describe()} is not an ELF shared library")
    bits = {1: 32, 2: 64}.get(header[4], 0)
    endian = "<" if header[5] == 1 else ">"
    (machine,) = struct.unpack(endian + "H", header[18:20])
    here = platform.machine()
    expected = _HOST_MACHINES.get(here)
    if bits != 64 or (expected is not None and machine != expected):
        arch = _ELF_MACHINES.get(machine, f"e_machine {machine}")
        raise DriverRootError(
            f"{path} in driver root {root.describe()} is a {bits}-bit {arch} library; this agent runs "
            f"on 64-bit {here}: the driver root holds another architecture's driver (a wrong image or "
            "driverRoot for this node)")


def resolve_in_root(root: Path, path: str) -> str | None:
    """Resolve ``path`` under ``root`` as if ``root`` were ``/``. Returns the resolved absolute path
    (inside the root) or None when a component does not exist; raises :class:`DriverRootError` for
    a symlink that climbs out of the root or too many links."""
    parts = [p for p in path.split("/") if p and p != "."]
    base = os.fspath(root).rstrip("/")  # strings, not Paths: this runs on every prepare
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if not done:
                raise DriverRootError(f"{path} in driver root {root} leads out of the root ('..' above it)")
            done.pop()
            continue
        current = "/".join((base, *done, part))
        try:
            target = os.readlink(current)
        except FileNotFoundError:
            return None
        except OSError:  # not a link (EINVAL), or a path through a non-directory (ENOTDIR)
            if not os.path.lexists(current):
                return None
            done.append(part)
            continue
        links += 1
        if links > _MAX_LINKS:
            raise DriverRootError(f"{path} in driver root {root}: too many levels of symbolic links")
        target_parts = [p for p in target.split("/") if p and p != "."]
        if target.startswith("/"):
            done = []
        else:
            depth = len(done)
            for p in target_parts:  # a relative link may not climb above the root
                depth = depth - 1 if p == ".." else depth + 1
                if depth < 0:
                    raise DriverRootError(
                        f"{'/' + '/'.join([*done, part])} in driver root {root} is a symlink to "
                        f"{target!r}, which leads out of the root; it is not followed")
        parts = target_parts + parts
    return "/" + "/".join(done)


# -- /etc/ld.so.cache (glibc's "glibc-ld.so.cache1.1" format), as NVIDIA's lookup also reads it ----

_NEW_MAGIC = b"glibc-ld.so.cache1.1"


def ld_cache_lookup(root: Path, name: str) -> str | None:
    """The path the root's ld.so.cache gives for ``name`` (a 64-bit entry), or None."""
    try:
        data = (root / "etc/ld.so.cache").read_bytes()
    except OSError:
        return None
    start = data.find(_NEW_MAGIC)
    if start < 0:
        return None
    try:
        (count,) = struct.unpack_from("<I", data, start + 20)
        entries = start + 48  # magic(20) nlibs(4) len_strings(4) flags(1) pad(3) extension(4) unused(3*4)
        for i in range(count):  # entries: flags, key, value, osversion (int32 each), hwcap (uint64)
            _flags, key, value, _osversion, _hwcap = struct.unpack_from("<iIIIQ", data, entries + i * 24)
            if _cstring(data, start + key) == name:  # the file's architecture is checked by the caller
                path = _cstring(data, start + value)
                if path.startswith("/"):
                    return path
    except struct.error:
        return None
    return None


def _cstring(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    return data[offset:end if end >= 0 else len(data)].decode(errors="replace")
