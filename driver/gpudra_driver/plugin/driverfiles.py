"""What a GPU container needs besides its device nodes: the running driver's user space.

A container given ``/dev/nvidia0`` alone cannot run CUDA: ``libcuda.so.1``, ``libnvidia-ml.so.1``
and ``nvidia-smi`` come from the node's driver, which the image does not ship. The NVIDIA Container
Toolkit's CDI generator (``nvidia-ctk cdi generate``, package ``pkg/nvcdi``) defines what to give
it, and gpudra gives the same (docs/cdi.md lists the deliberate differences):

* **libraries**: every ``*.so.<driver version>`` in the directories of ``libcuda.so.1`` and their
  ``vdpau/`` (``getVersionLibs``), mounted at the same path in the container;
* **binaries**: nvidia-smi, nvidia-debugdump, nvidia-persistenced, the MPS control daemon and
  server, the IMEX daemon and its CLI (``newDriverBinariesDiscoverer``);
* **GSP firmware** ``lib/firmware[/updates]/nvidia/<version>/{gsp,ucodes}*.bin``;
* **IPC sockets** of nvidia-persistenced and nvidia-fabricmanager, and the MPS pipe directory;
* **control device nodes** ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``
  where present (``nvidiactl`` is required);
* **hooks** run by the runtime with ``nvidia-cdi-hook`` when the node has it: ``create-symlinks``
  (soname links, ``libcuda.so``), ``enable-cuda-compat``, ``update-ldcache``,
  ``disable-device-node-modification`` and ``update-application-profile``. Without the hook each library is also mounted at its
  soname (and ``libcuda.so``), so ``dlopen("libcuda.so.1")`` resolves through the loader's default
  search path of multiarch distributions, with no ld.so.cache entry;
* ``NVIDIA_CTK_LIBCUDA_DIR``: the container's directory of ``libcuda.so.1``.

Host and container paths: a file at ``<driverRoot>/usr/lib/...`` is mounted at ``/usr/lib/...``.
Mount sources are the *resolved* files (resolved inside the root): the runtime resolves a source
on the host, where an absolute link of a driver container's root would point at the host's own
files. Device nodes come from the *device root*: ``<driverRoot>/dev`` when it holds
``nvidiactl``, else the host's ``/dev`` (as NVIDIA's driver detects it).

:func:`scan_driver_files` reads the root (I/O); :func:`common_edits` turns the result into CDI
container edits (pure). :class:`DriverFilesCache` rescans only when the driver version under the
agent changes (a driver container upgrade), checked on every use by resolving one symlink.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpudra_driver.driverroot import (LIBRARY_DIRS, NVML_LIBRARY, DriverRoot, DriverRootError, library_version)

MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
CUDA_LIBRARY = "libcuda.so.1"
REQUIRED_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")  # stems that must exist at the driver version
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server", "nvidia-imex", "nvidia-imex-ctl")
BINARY_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin", "usr/local/sbin")
FIRMWARE_DIRS = ("lib/firmware/updates/nvidia", "lib/firmware/nvidia")
FIRMWARE_PATTERNS = ("gsp*.bin", "ucodes*.bin")
IPC_PATHS = ("/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket",
             "/run/nvidia-fabricmanager/socket", "/var/run/nvidia-fabricmanager/socket", "/tmp/nvidia-mps")
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
REQUIRED_CONTROL_NODES = ("/dev/nvidiactl",)
# Where the toolkit's hook is installed: a host package, the GPU Operator's toolkit container.
HOOK_NAME = "nvidia-cdi-hook"
HOOK_PATHS = ("/usr/bin/nvidia-cdi-hook", "/usr/local/bin/nvidia-cdi-hook",
              "/usr/local/nvidia/toolkit/nvidia-cdi-hook")


class DriverFilesError(OSError):
    """The driver root cannot give a container what it needs right now (a per-claim, retryable
    prepare error): files of the running version missing, device nodes not created yet."""


@dataclass(frozen=True)
class Mount:
    host: str  # the host's path of the resolved file
    container: str


@dataclass(frozen=True)
class DriverFiles:
    """One driver version's files in one root, as the host and a container see them."""

    version: str
    library_dirs: tuple[str, ...]  # container directories of the libraries (libcuda's first)
    libraries: tuple[Mount, ...]
    soname_links: tuple[tuple[str, str], ...]  # (link target name, container link path)
    binaries: tuple[Mount, ...]
    firmware: tuple[Mount, ...]
    ipc: tuple[Mount, ...]
    control_nodes: tuple[str, ...]  # container paths of the control nodes present
    device_root: str  # host path prefix of device nodes: "" for /dev, else the driver root
    hook: str | None  # host path of nvidia-cdi-hook, None when the node has none


def common_edits(files: DriverFiles) -> dict[str, Any]:
    """The CDI containerEdits every container given any of this node's GPUs gets (pure)."""
    mounts = [*files.libraries]
    hooks: list[dict[str, Any]] = []
    if files.hook is None:
        by_name = {PurePosixPath(m.container).name: m for m in files.libraries}
        via = {PurePosixPath(link).name: target for target, link in files.soname_links}  # libcuda.so -> .so.1
        for target, link in files.soname_links:
            library = by_name.get(target) or by_name.get(via.get(target, ""))
            if library is not None:
                mounts.append(Mount(library.host, link))
    else:
        hooks = _hooks(files)
    mounts += [*files.binaries, *files.firmware, *files.ipc]
    edits: dict[str, Any] = {
        "env": [f"NVIDIA_CTK_LIBCUDA_DIR={files.library_dirs[0]}"],
        "deviceNodes": [device_node(p, files.device_root) for p in files.control_nodes],
        "mounts": [{"hostPath": m.host, "containerPath": m.container, "options": list(MOUNT_OPTIONS)}
                   for m in mounts],
    }
    if hooks:
        edits["hooks"] = hooks
    return edits


def device_node(path: str, device_root: str) -> dict[str, str]:
    node = {"path": path}
    if device_root:  # the host's node lives under the driver root (e.g. /run/nvidia/driver)
        node["hostPath"] = device_root + path
    return node


def _hooks(files: DriverFiles) -> list[dict[str, Any]]:
    assert files.hook is not None

    def hook(*args: str) -> dict[str, Any]:
        return {"hookName": "createContainer", "path": files.hook, "args": [HOOK_NAME, *args]}

    links = [arg for target, link in files.soname_links for arg in ("--link", f"{target}::{link}")]
    result = [hook("create-symlinks", *links)] if links else []
    result.append(hook("enable-cuda-compat", f"--host-driver-version={files.version}"))
    result.append(hook("update-ldcache", *(a for d in files.library_dirs for a in ("--folder", d))))
    result.append(hook("disable-device-node-modification"))
    result.append(hook("update-application-profile"))
    return result


# -- reading the root (I/O) ---------------------------------------------------------------------


def driver_version(root: DriverRoot) -> str:
    """The version of the driver whose files the root holds, from ``libnvidia-ml.so.1``'s target."""
    found = root.find_library(NVML_LIBRARY)
    if found is None:
        raise DriverFilesError(f"{NVML_LIBRARY} is not in driver root {root.describe()}; searched: "
                               + ", ".join(root.searched(NVML_LIBRARY)))
    version = library_version(found[1], "libnvidia-ml.so")
    if version is None:
        raise DriverFilesError(f"cannot tell the driver version from {found[0]} -> {found[1]} in driver "
                               f"root {root.describe()} (expected libnvidia-ml.so.<version>)")
    return version


def scan_driver_files(root: DriverRoot, version: str, *, hook: str | None = None) -> DriverFiles:
    """The files of driver ``version`` in ``root``. ``hook``: the host path of nvidia-cdi-hook to
    use; None looks for it in the root (a host install)."""
    cuda = root.find_library(CUDA_LIBRARY)
    if cuda is None:
        raise DriverFilesError(f"{CUDA_LIBRARY} is not in driver root {root.describe()} (driver "
                               f"{version}); searched: {', '.join(root.searched(CUDA_LIBRARY))}")
    lib_dirs = _unique([str(PurePosixPath(cuda[1]).parent), str(PurePosixPath(cuda[0]).parent)])
    libraries: dict[str, Mount] = {}
    links: list[tuple[str, str]] = []
    for directory in lib_dirs:
        for folder in (directory, f"{directory}/vdpau"):
            for name, resolved in _versioned_files(root, folder, version):
                libraries.setdefault(name, Mount(root.host_path(resolved), f"{folder}/{name}"))
            links += _soname_links(root, folder, version)
    missing = [stem for stem in REQUIRED_LIBRARIES if f"{stem}.{version}" not in libraries]
    if missing:
        raise DriverFilesError(
            f"driver root {root.describe()} has no {', '.join(f'{s}.{version}' for s in missing)} in "
            f"{', '.join(lib_dirs)}: the driver version {version} (from {NVML_LIBRARY}) has no matching "
            "library files; is the driver installation complete?")
    if f"libcuda.so.{version}" in libraries:
        links.append(("libcuda.so.1", f"{lib_dirs[0]}/libcuda.so"))
    devices = _device_root(root)
    control = [p for p in CONTROL_NODES if _is_char_device(devices, p)]
    return DriverFiles(
        version=version,
        library_dirs=tuple(lib_dirs[:1]),
        libraries=tuple(libraries[n] for n in sorted(libraries)),
        soname_links=tuple(_unique(links)),
        binaries=tuple(_binaries(root)),
        firmware=tuple(_firmware(root, version)),
        ipc=tuple(m for m in (_ipc(root, p) for p in IPC_PATHS) if m is not None),
        control_nodes=tuple(control),
        device_root=devices[0],
        hook=hook if hook is not None else _find_hook(root),
    )


def missing_device_nodes(root: DriverRoot, paths: list[str]) -> list[str]:
    """The paths (container paths, ``/dev/...``) with no character device in the device root."""
    devices = _device_root(root)
    return [p for p in paths if not _is_char_device(devices, p)]


def _device_root(root: DriverRoot) -> tuple[str, Path]:
    """(host path prefix of device nodes, where this process sees them): the driver root when its
    ``dev/`` holds ``nvidiactl``, else the host's ``/dev`` (a privileged pod sees the host's)."""
    if _is_char_device((root.host, root.local), "/dev/nvidiactl"):
        return ("" if root.host == "/" else root.host), root.local
    return "", Path("/")


def _is_char_device(device_root: tuple[str, Path], path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(device_root[1] / path.lstrip("/")).st_mode)
    except OSError:
        return False


def _versioned_files(root: DriverRoot, folder: str, version: str) -> list[tuple[str, str]]:
    """(name, resolved path) of the regular files named ``*.so.<version>`` in ``folder``."""
    found = []
    for name in _listdir(root, folder):
        if not name.endswith(f".so.{version}"):
            continue
        resolved = root.resolve(f"{folder}/{name}")
        if resolved is not None and (root.local / resolved.lstrip("/")).is_file():
            found.append((name, resolved))
    return found


def _soname_links(root: DriverRoot, folder: str, version: str) -> list[tuple[str, str]]:
    """(target, link) for each ``lib*.so.<N>`` link in ``folder`` to a ``*.so.<version>`` file."""
    links = []
    for name in _listdir(root, folder):
        stem, _, suffix = name.partition(".so.")
        if not suffix or suffix == version or not suffix.isdigit():
            continue
        if not (root.local / folder.lstrip("/") / name).is_symlink():
            continue
        try:
            resolved = root.resolve(f"{folder}/{name}")
        except DriverRootError:
            continue
        target = PurePosixPath(resolved).name if resolved else ""
        if target == f"{stem}.so.{version}":
            links.append((target, f"{folder}/{name}"))
    return links


def _binaries(root: DriverRoot) -> list[Mount]:
    found = []
    for name in BINARIES:
        for directory in BINARY_DIRS:
            path = f"/{directory}/{name}"
            resolved = _resolve_quietly(root, path)
            if resolved is not None and os.access(root.local / resolved.lstrip("/"), os.X_OK) \
                    and (root.local / resolved.lstrip("/")).is_file():
                found.append(Mount(root.host_path(resolved), path))
                break
    return found


def _firmware(root: DriverRoot, version: str) -> list[Mount]:
    found: dict[str, Mount] = {}
    for directory in FIRMWARE_DIRS:
        folder = f"/{directory}/{version}"
        for name in _listdir(root, folder):
            if any(fnmatch.fnmatch(name, p) for p in FIRMWARE_PATTERNS) and name not in found:
                resolved = _resolve_quietly(root, f"{folder}/{name}")
                if resolved is not None:
                    found[name] = Mount(root.host_path(resolved), f"{folder}/{name}")
    return list(found.values())


def _ipc(root: DriverRoot, path: str) -> Mount | None:
    resolved = _resolve_quietly(root, path)
    if resolved is None:
        return None
    return Mount(root.host_path(resolved), path)


def _find_hook(root: DriverRoot) -> str | None:
    for path in HOOK_PATHS:
        resolved = _resolve_quietly(root, path)
        if resolved is not None and os.access(root.local / resolved.lstrip("/"), os.X_OK):
            return root.host_path(resolved)
    return None


def _listdir(root: DriverRoot, folder: str) -> list[str]:
    """The names in ``folder`` (inside the root), sorted; none when it cannot be read."""
    try:
        return sorted(os.listdir(root.local / folder.lstrip("/")))
    except OSError:
        return []


def _resolve_quietly(root: DriverRoot, path: str) -> str | None:
    """A file the root may have; a link out of the root is treated as absent (never followed)."""
    try:
        return root.resolve(path)
    except DriverRootError:
        return None


def _unique(items: list[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


class DriverFilesCache:
    """The driver files in use, rescanned when the root's driver version changes."""

    def __init__(self, root: DriverRoot, *, hook: str | None = None) -> None:
        self.root = root
        self.hook = hook
        self._lock = threading.Lock()
        self._files: DriverFiles | None = None

    def current(self) -> DriverFiles:
        version = driver_version(self.root)
        with self._lock:
            if self._files is None or self._files.version != version:
                self._files = scan_driver_files(self.root, version, hook=self.hook)
            return self._files

    def check_device_nodes(self, paths: list[str]) -> None:
        """Raise :class:`DriverFilesError` unless every node in ``paths`` (and ``nvidiactl``) is a
        character device in the device root: a node whose driver is still loading has none yet."""
        missing = missing_device_nodes(self.root, [*REQUIRED_CONTROL_NODES, *paths])
        if missing:
            devices = _device_root(self.root)
            where = devices[0] + "/dev" if devices[0] else "/dev"
            raise DriverFilesError(
                f"device node(s) {', '.join(missing)} missing in {where}: the NVIDIA driver may still be "
                "loading on this node (the kubelet retries)")


__all__ = ["LIBRARY_DIRS", "DriverFiles", "DriverFilesCache", "DriverFilesError", "Mount", "common_edits",
           "device_node", "driver_version", "missing_device_nodes", "scan_driver_files"]
