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
import json
import os
import re
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
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


HookVersion = tuple[int, int, int]
# nvidia-cdi-hook subcommands newer than create-symlinks and update-ldcache (toolkit 1.16+), with
# the toolkit release that brought them (its CHANGELOG). An older hook fails on an unknown
# subcommand, and a failing createContainer hook fails the container: a hook whose version is not
# known (given by --nvidia-cdi-hook, outside the driver root) gets only the two.
NEWER_HOOKS: tuple[tuple[str, HookVersion], ...] = (
    ("enable-cuda-compat", (1, 18, 0)),
    ("disable-device-node-modification", (1, 20, 0)),
    ("update-application-profile", (1, 20, 0)),
)


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
    hook_version: HookVersion | None = None  # what `nvidia-cdi-hook --version` says; None: unknown

    @cached_property
    def edits(self) -> Mapping[str, Any]:
        """:func:`common_edits` of this snapshot, built once: every claim's spec repeats them.
        Shared by every spec: read it, never change it."""
        return common_edits(self)

    @cached_property
    def edits_json_after_env(self) -> str:
        """The compact JSON of :attr:`edits` after their ``env`` member, as ``,"key":value...``:
        what every spec's ``containerEdits`` ends with (:func:`cdi.encode_spec`)."""
        body = json.dumps({k: v for k, v in self.edits.items() if k != "env"}, separators=(",", ":"))
        return "," + body[1:-1] if body != "{}" else ""


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

    def supported(name: str) -> bool:
        needed = dict(NEWER_HOOKS)[name]
        return files.hook_version is not None and files.hook_version >= needed

    links = [arg for target, link in files.soname_links for arg in ("--link", f"{target}::{link}")]
    result = [hook("create-symlinks", *links)] if links else []
    if supported("enable-cuda-compat"):
        result.append(hook("enable-cuda-compat", f"--host-driver-version={files.version}"))
    result.append(hook("update-ldcache", *(a for d in files.library_dirs for a in ("--folder", d))))
    result += [hook(name) for name in ("disable-device-node-modification", "update-application-profile")
               if supported(name)]
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


def scan_driver_files(root: DriverRoot, version: str, *, hook: str | None = None,
                      host_dev: Path = Path("/dev")) -> DriverFiles:
    """The files of driver ``version`` in ``root``. ``hook``: the host path of nvidia-cdi-hook to
    use; None looks for it in the root (a host install). ``host_dev``: where this process sees the
    host's ``/dev``, the device root when the driver root has no device nodes."""
    return _node_view(root, _versioned(root, version), hook=hook, host_dev=host_dev)


@dataclass(frozen=True)
class _Versioned:
    """What depends on the driver version only: scanned once per version."""

    version: str
    library_dirs: tuple[str, ...]
    libraries: tuple[Mount, ...]
    soname_links: tuple[tuple[str, str], ...]
    binaries: tuple[Mount, ...]
    firmware: tuple[Mount, ...]


def _versioned(root: DriverRoot, version: str) -> _Versioned:
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
    return _Versioned(version, tuple(lib_dirs[:1]), tuple(libraries[n] for n in sorted(libraries)),
                      tuple(_unique(links)), tuple(_binaries(root)), tuple(_firmware(root, version)))


def _node_view(root: DriverRoot, versioned: _Versioned, *, hook: str | None, host_dev: Path) -> DriverFiles:
    """``versioned`` with what may change under a running driver: control nodes (``nvidia-uvm``
    appears on first CUDA use), IPC sockets (persistenced, fabricmanager start later), the hook."""
    devices = _device_root(root, host_dev)
    found_hook = _find_hook(root) if hook is None else None
    return DriverFiles(
        version=versioned.version,
        library_dirs=versioned.library_dirs,
        libraries=versioned.libraries,
        soname_links=versioned.soname_links,
        binaries=versioned.binaries,
        firmware=versioned.firmware,
        ipc=tuple(m for m in (_ipc(root, p) for p in IPC_PATHS) if m is not None),
        control_nodes=tuple(p for p in CONTROL_NODES if _is_char_device(devices[1], p)),
        device_root=devices[0],
        hook=hook if hook is not None else (found_hook[0] if found_hook else None),
        hook_version=_hook_version(found_hook[1]) if found_hook else None,  # a given hook's: unknown
    )


def missing_device_nodes(root: DriverRoot, paths: list[str], host_dev: Path = Path("/dev")) -> list[str]:
    """The paths (container paths, ``/dev/...``) with no character device in the device root."""
    devices = _device_root(root, host_dev)
    return [p for p in paths if not _is_char_device(devices[1], p)]


def _device_root(root: DriverRoot, host_dev: Path) -> tuple[str, Path]:
    """(host path prefix of device nodes, the ``dev`` directory this process checks them in): the
    driver root when its ``dev/`` holds ``nvidiactl`` (as NVIDIA's driver detects it), else the
    host's ``/dev``, seen at ``host_dev`` (the DaemonSet mounts it: a container's own ``/dev`` is
    a copy made at its start, without nodes the driver creates later)."""
    if _is_char_device(root.local / "dev", "/dev/nvidiactl"):
        return ("" if root.host == "/" else root.host), root.local / "dev"
    return "", host_dev


def _is_char_device(dev: Path, path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(dev / path.removeprefix("/dev/")).st_mode)
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


def _find_hook(root: DriverRoot) -> tuple[str, Path] | None:
    """(host path, local path) of nvidia-cdi-hook in the root, if there is one."""
    for path in HOOK_PATHS:
        resolved = _resolve_quietly(root, path)
        local = root.local / resolved.lstrip("/") if resolved is not None else None
        if local is not None and local.is_file() and os.access(local, os.X_OK):
            return root.host_path(resolved), local  # type: ignore[arg-type]
    return None


_HOOK_VERSIONS: dict[tuple[Path, float], HookVersion | None] = {}


def _hook_version(local: Path) -> HookVersion | None:
    """``nvidia-cdi-hook --version`` (cached per file and mtime); None when it cannot be told."""
    try:
        key = (local, local.stat().st_mtime)
    except OSError:
        return None
    if key not in _HOOK_VERSIONS:
        try:
            out = subprocess.run([str(local), "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        match = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
        _HOOK_VERSIONS[key] = (int(match[1]), int(match[2]), int(match[3])) if match else None
    return _HOOK_VERSIONS[key]


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


# How long a look at control nodes, IPC sockets and the hook serves the next prepares: a burst of
# claims (a job's pods starting at once) costs one look; something that appears is seen within it.
VIEW_TTL = 1.0


class DriverFilesCache:
    """The driver files a claim's spec gets now. The version's files are scanned when the root's
    driver version changes (a driver container upgrade); control nodes, IPC sockets and the hook
    are looked at on every use, since they appear after the driver (``nvidia-uvm`` on first CUDA
    use, persistenced started later). Every failure is a :class:`DriverFilesError`: a per-claim,
    retryable prepare error, never an exception that fails the other claims of the call."""

    def __init__(self, root: DriverRoot, *, hook: str | None = None, host_dev: Path = Path("/dev"),
                 proc: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock
        self.hook = hook
        self.host_dev = host_dev
        self.kernel_version_file = proc / "driver/nvidia/version"
        self._lock = threading.Lock()
        self._versioned: _Versioned | None = None
        # (monotonic time, view, loaded kernel module version) of the last look
        self._view: tuple[float, DriverFiles, str | None] | None = None
        self._present_nodes: set[str] = set()  # device nodes seen present since the view was renewed

    def current(self) -> DriverFiles:
        """The view of the root, looked at again once it is VIEW_TTL old: every prepare asks."""
        try:
            with self._lock:
                now = self.clock()
                if self._view is None or now - self._view[0] >= VIEW_TTL:
                    version = driver_version(self.root)
                    if self._versioned is None or self._versioned.version != version:
                        self._versioned = _versioned(self.root, version)
                    self._view = (now, _node_view(self.root, self._versioned, hook=self.hook, host_dev=self.host_dev),
                                  self._kernel_module_version())
                    self._present_nodes = set()
                _, files, kernel = self._view
        except DriverRootError as error:  # a link out of the root, a loop
            raise DriverFilesError(str(error)) from None
        # A driver upgraded on disk but not loaded (no reboot yet): its libraries would not work
        # with the running kernel module, so a container would fail CUDA's init.
        if kernel is not None and kernel != files.version:
            raise DriverFilesError(
                f"the driver root {self.root.describe()} holds driver {files.version}, but the loaded kernel "
                f"module is {kernel} ({self.kernel_version_file}): reboot the node or reload the driver")
        return files

    def _kernel_module_version(self) -> str | None:
        """The loaded NVIDIA kernel module's version; None when none is loaded yet (the device
        nodes say so) or the file cannot be read here."""
        try:
            line = self.kernel_version_file.read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", line)
        return match.group(1) if match else None

    def check_device_nodes(self, paths: list[str]) -> None:
        """Raise :class:`DriverFilesError` unless every node in ``paths`` (and ``nvidiactl``) is a
        character device in the device root: a node whose driver is still loading has none yet.
        A node seen present is not looked at again until the view is renewed (:meth:`current`);
        a missing one is looked for on every call."""
        wanted = [p for p in (*REQUIRED_CONTROL_NODES, *paths) if p not in self._present_nodes]
        missing = missing_device_nodes(self.root, wanted, self.host_dev) if wanted else []
        self._present_nodes.update(p for p in wanted if p not in missing)
        if missing:
            prefix, dev = _device_root(self.root, self.host_dev)
            where = f"{prefix}/dev" if prefix else "/dev"
            seen = "" if str(dev) == where else f" (seen at {dev})"
            raise DriverFilesError(
                f"device node(s) {', '.join(missing)} missing in {where}{seen}: the NVIDIA driver may still "
                "be loading on this node (the kubelet retries)")


__all__ = ["LIBRARY_DIRS", "DriverFiles", "DriverFilesCache", "DriverFilesError", "Mount", "common_edits",
           "device_node", "driver_version", "missing_device_nodes", "scan_driver_files"]
