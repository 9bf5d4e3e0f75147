"""A fake NVIDIA driver root: a directory laid out like a host's driver install, whose
``libnvidia-ml.so.1`` is the mock NVML (``tests/mocknvml``, built by ``make mock-nvml``) answering
from an inventory written from a simulated-NVML profile.

So the real pynvml and NVIDIA's ``nvidia-ctk cdi generate --driver-root`` can run against the same
machine the Python simulator (:mod:`gpudra_driver.nvml.fake`) describes: the YAML profile stays the
one source of truth, and :func:`inventory_text` only translates it into the mock's line format
(documented at the top of ``tests/mocknvml/mock_nvml.c``).

Layout (x86_64, Debian multiarch), relative to the root::

    usr/lib/x86_64-linux-gnu/libnvidia-ml.so.<ver>     the mock (a copy: each root stands alone)
    usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 -> libnvidia-ml.so.<ver>
    usr/lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory
    usr/lib/x86_64-linux-gnu/lib<X>.so.<ver> + soname links   (extras: libcuda, ptxjitcompiler, ...)
    usr/bin/nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control/-server
    run/gpudra-mock/                                   the mocks' shared state and calls.log (made on first use)
    lib/firmware/nvidia/<ver>/gsp_ga10x.bin, gsp_tu10x.bin
    dev/nvidia<minor>, nvidiactl, nvidia-modeset, nvidia-uvm, nvidia-uvm-tools, nvidia-caps/nvidia-cap<N>
    proc/driver/nvidia-caps/mig-minors                 (mig_caps: the kernel driver's capability table)
    proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>[/ci<c>]/access   (mig_caps: per MIG instance)

MIG capabilities (``mig_caps``): a real node has, for each GPU instance and compute instance, a
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access`` (and ``.../gi<g>/ci<c>/access``) naming
its ``/dev/nvidia-caps/nvidia-cap<N>`` minor (``DeviceFileMinor: <N>``, what
:func:`gpudra_driver.plugin.devicenodes.read_mig_cap_minor` reads). The root has them, and the nodes,
for the inventory's MIG devices and for every instance that can be created on a GPU with a MIG catalog
and MIG mode enabled (:func:`gpudra_driver.nvml.fake.creatable_instances`: each GPU instance ID a
placement gets, compute instances 0 to its most compute slices minus one), so a prepare that creates
instances finds them wherever NVML puts them. Minors follow the driver's fixed layout
(:func:`~gpudra_driver.plugin.devicenodes.mig_cap_minor_fallback`, the one ``mig-minors`` lists).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import pynvml

from gpudra_dev import REPO
from gpudra_driver.nvml.fake import GpuSpec, MigCatalog, Profile, creatable_instances, load_profile
from gpudra_driver.plugin.devicenodes import _GIS_PER_GPU, _MINORS_PER_GI, mig_cap_minor_fallback

__all__ = [
    "INVENTORY_ENV",
    "INVENTORY_FILE",
    "LIB_DIR",
    "MOCK_NVML_ENV",
    "inventory_text",
    "make_driver_root",
    "make_pci_sysfs",
    "mig_instances",
    "mock_nvml_library",
    "write_inventory",
]

MOCK_NVML_ENV = "GPUDRA_MOCK_NVML"  # path of a built mock, overriding <repo>/build/mock-nvml
INVENTORY_ENV = "GPUDRA_MOCK_NVML_INVENTORY"  # read by the mock itself
INVENTORY_FILE = "gpudra-mock-nvml.inventory"  # the mock's default: next to the library file
LIB_DIR = Path("usr/lib/x86_64-linux-gnu")

_BUILT = REPO / "build" / "mock-nvml" / "libnvidia-ml.so"

NVIDIA_MAJOR = 195  # /dev/nvidia<minor>, nvidiactl (255), nvidia-modeset (254)
UVM_MAJOR = 510  # dynamic on a real host; any unused number here
CAPS_MAJOR = 511  # nvidia-caps, dynamic too

# Driver libraries besides NVML: lib<X> -> the soname's version suffix.
_EXTRA_LIBS = {
    "libcuda": "1",
    "libnvidia-ptxjitcompiler": "1",
    "libnvidia-nvvm": "4",
    "libnvidia-cfg": "1",
    "libnvidia-opencl": "1",
    "libnvidia-allocator": "1",
    "libnvidia-gpucomp": "1",
}
_BINARIES = (
    "nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
)
_MOCK_TOOLS = ("nvidia-smi", "nvidia-cuda-mps-control")  # built from tests/mocknvml when available
_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")


def mock_nvml_library() -> Path:
    """The built mock: ``$GPUDRA_MOCK_NVML`` if set, else ``<repo>/build/mock-nvml/libnvidia-ml.so``."""
    env = os.environ.get(MOCK_NVML_ENV)
    path = Path(env) if env else _BUILT
    if not path.is_file():
        where = f"${MOCK_NVML_ENV}={env}" if env else str(path)
        raise RuntimeError(f"the mock NVML library {where} is not built: run `make mock-nvml` (needs a C compiler)")
    return path


# -- the inventory ------------------------------------------------------------------------------


def _error_code(name: str) -> int:
    """``GpuIsLost`` -> 15, from pynvml's own exception classes."""
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    for code, known in pynvml.NVMLError._valClassMapping.items():
        if known is cls:
            return int(code)
    raise ValueError(f"unknown NVML error {name!r}")


def _fault_lines(fail: dict[str, str]) -> list[str]:
    # The mock names each call without its _vN suffix, as the simulator's fault keys do.
    return [f"fail {re.sub(r'_v[0-9]+$', '', call)} {_error_code(err)}" for call, err in fail.items()]


def _one_line(where: str, value: str) -> str:
    if "\n" in value or "\r" in value or not value.strip():
        raise ValueError(f"{where}: {value!r} cannot be written as one inventory line")
    return value


def _catalog_lines(catalog: MigCatalog | None) -> list[str]:
    """``migCatalog`` and one ``migProfile`` per GPU instance profile (format: tests/mocknvml/mock_nvml.c)."""
    if catalog is None:
        return []
    return [f"migCatalog {_one_word('migCatalog', catalog.model)} {catalog.memory_slices} {catalog.compute_slices}"] + [
        f"migProfile {p.index} {p.id} {p.slices} {p.instances} {p.multiprocessors} {p.copy_engines} {p.decoders} "
        f"{p.encoders} {p.jpeg} {p.ofa} {p.memory_mib} {_one_word('migProfile name', p.name)} {p.placement_size} "
        f"{','.join(str(start) for start in p.placement_starts)}"
        for p in catalog.profiles
    ]


def _one_word(where: str, value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{where}: {value!r} cannot be written as one inventory word")
    return value


def inventory_text(profile: Profile) -> str:
    """The mock NVML's inventory for ``profile`` (format: the header of tests/mocknvml/mock_nvml.c)."""
    lines = [
        f"# gpudra mock NVML inventory, written from profile {profile.name}",
        f"driverVersion {_one_line('driverVersion', profile.driver_version)}",
        f"cudaDriverVersion {profile.cuda_driver_version}",
    ]
    if profile.init_error:
        lines.append(f"initError {_error_code(profile.init_error)}  # {profile.init_error}")
    for index, gpu in enumerate(profile.gpus):
        lines += [
            f"# GPU {index}",
            "gpu",
            f"name {_one_line('name', gpu.name)}",
            f"uuid {_one_line('uuid', gpu.uuid)}",
            f"brand {gpu.brand}",
            f"architecture {gpu.architecture}",
            f"cudaComputeCapability {gpu.compute_capability[0]} {gpu.compute_capability[1]}",
            f"memoryMiB {gpu.memory_mib}",
            f"memoryUsedMiB {gpu.memory_used_mib}",
            f"minor {gpu.minor}",
            f"busId {_one_line('busId', gpu.bus_id)}",
            f"pciDeviceId {gpu.pci_device_id}",
            f"pciSubSystemId {gpu.pci_subsystem_id}",
        ]
        if gpu.numa_node is not None:
            lines.append(f"numaNode {gpu.numa_node}")
        lines += [
            f"migCapable {int(gpu.mig_capable)}",
            f"migMode {gpu.mig_mode[0]} {gpu.mig_mode[1]}",
            f"maxMigDevices {gpu.max_mig_devices}",
            *_fault_lines(gpu.fail),
            *_catalog_lines(gpu.mig_catalog),
        ]
        for slot, mig in sorted(gpu.migs.items()):
            attrs = " ".join(str(mig.attributes.get(name, 0)) for name, _ in pynvml.c_nvmlDeviceAttributes._fields_)
            lines += [
                f"mig {slot}",
                f"uuid {_one_line('uuid', mig.uuid)}",
                f"profile {_one_line('profile', mig.profile)}",
                f"gpuInstanceId {mig.gpu_instance_id}",
                f"computeInstanceId {mig.compute_instance_id}",
                f"attributes {attrs}",
                *_fault_lines(mig.fail),
            ]
    return "\n".join(lines) + "\n"


def write_inventory(path: Path, profile: Profile | str) -> Path:
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    path.write_text(inventory_text(prof))
    return path


# -- the driver root ----------------------------------------------------------------------------


def _symlink(link: Path, target: str) -> None:
    """A relative symlink ``link -> target`` (replaced if present)."""
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _copy(src: Path, dst: Path) -> None:
    if dst.is_symlink():
        dst.unlink()
    shutil.copyfile(src, dst)
    dst.chmod(0o755)


def _mknod(path: Path, major: int, minor: int) -> None:
    want = os.makedev(major, minor)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return
        path.unlink()
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, want)
    except PermissionError as exc:
        raise PermissionError(
            f"cannot create the device node {path} ({exc.strerror}): making a fake driver root with device "
            "nodes needs root (CAP_MKNOD); run the tests as root or pass device_nodes=False"
        ) from exc


def mig_minors_text(gpu_minors: list[int]) -> str:
    """``/proc/driver/nvidia-caps/mig-minors`` as the kernel driver writes it, for these GPU minors
    (nvidia-ctk reads it to find a MIG device's capability nodes)."""
    lines = ["config 1", "monitor 2"]
    for gpu in gpu_minors:
        for gi in range(_GIS_PER_GPU):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_cap_minor_fallback(gpu, gi, None)}")
            for ci in range(_MINORS_PER_GI - 1):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {mig_cap_minor_fallback(gpu, gi, ci)}")
    return "\n".join(lines) + "\n"


def mig_instances(gpu: GpuSpec) -> dict[int, set[int]]:
    """GPU instance ID -> its compute instance IDs: the inventory's MIG devices, and every instance
    the simulators can create on the GPU (a MIG catalog and MIG mode enabled)."""
    out: dict[int, set[int]] = {}
    for mig in gpu.migs.values():
        out.setdefault(mig.gpu_instance_id, set()).add(mig.compute_instance_id)
    if gpu.mig_catalog is not None and gpu.mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
        for gi, slices in creatable_instances(gpu.mig_catalog).items():
            out.setdefault(gi, set()).update(range(slices))
    return out


def _access_text(minor: int) -> str:
    """A capability's ``access`` file as the kernel driver writes it (mode 0444: 292)."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


def make_driver_root(
    root: Path,
    profile: Profile | str,
    *,
    library: Path | None = None,
    device_nodes: bool = True,
    mig_caps: bool = True,
    extras: bool = True,
) -> Path:
    """Lay out a fake driver root for ``profile`` (a :class:`Profile`, or a name or YAML path
    :func:`load_profile` accepts) under ``root``, with ``library`` (default: :func:`mock_nvml_library`)
    as its NVML. Calling it again on the same root brings it up to date. Returns ``root``."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    lib = library if library is not None else mock_nvml_library()
    ver = prof.driver_version
    if not re.fullmatch(r"[0-9A-Za-z.]+", ver):
        raise ValueError(f"profile {prof.name}: driver version {ver!r} cannot name driver files")

    root.mkdir(parents=True, exist_ok=True)
    libdir = root / LIB_DIR
    libdir.mkdir(parents=True, exist_ok=True)
    _copy(lib, libdir / f"libnvidia-ml.so.{ver}")
    _symlink(libdir / "libnvidia-ml.so.1", f"libnvidia-ml.so.{ver}")
    write_inventory(libdir / INVENTORY_FILE, prof)
    if extras:
        # Any ELF of this architecture will do: nothing loads them, tools only find them.
        for name, soname_version in _EXTRA_LIBS.items():
            _copy(lib, libdir / f"{name}.so.{ver}")
            _symlink(libdir / f"{name}.so.{soname_version}", f"{name}.so.{ver}")
        _symlink(libdir / "libcuda.so", "libcuda.so.1")

    bindir = root / "usr" / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    # The static mock tools next to the mock library when built (`make mock-nvidia-smi
    # mock-mps-control`), with this root's inventory appended (text, its length as 8 little-endian
    # bytes, b"GPUDRAIN"; tests/mocknvml/mock_inventory.h): nvidia-smi lists the GPUs whose
    # /dev/nvidia<minor> exist where it runs and sets compute modes and time slices;
    # nvidia-cuda-mps-control is an MPS control daemon and client. Both share the root's state
    # (gpudra_dev.localcluster.mockstate). The others are shell-script stand-ins.
    for tool in _BINARIES:
        path = bindir / tool
        mock = lib.parent / tool
        path.unlink(missing_ok=True)  # not rewritten in place: a running daemon keeps its file
        if tool in _MOCK_TOOLS and mock.is_file():
            inventory = inventory_text(prof).encode()
            path.write_bytes(mock.read_bytes() + inventory + len(inventory).to_bytes(8, "little") + b"GPUDRAIN")
        else:
            path.write_text(f"#!/bin/sh\necho '{tool}: part of a gpudra fake driver root (profile {prof.name})' >&2\nexit 0\n")
        path.chmod(0o755)

    firmware = root / "lib" / "firmware" / "nvidia" / ver
    firmware.mkdir(parents=True, exist_ok=True)
    for blob in _FIRMWARE:
        (firmware / blob).write_bytes(b"gpudra fake GSP firmware\n")

    if mig_caps:
        proc_caps = root / "proc" / "driver" / "nvidia-caps"
        proc_caps.mkdir(parents=True, exist_ok=True)
        (proc_caps / "mig-minors").write_text(mig_minors_text(sorted(g.minor for g in prof.gpus)))
        for gpu in prof.gpus:
            mig_dir = root / "proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig"
            for gi, cis in mig_instances(gpu).items():
                for ci in (None, *sorted(cis)):
                    where = mig_dir / f"gi{gi}" / (f"ci{ci}" if ci is not None else "")
                    where.mkdir(parents=True, exist_ok=True)
                    (where / "access").write_text(_access_text(mig_cap_minor_fallback(gpu.minor, gi, ci)))

    if device_nodes:
        dev = root / "dev"
        dev.mkdir(exist_ok=True)
        for gpu in prof.gpus:
            _mknod(dev / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor)
        _mknod(dev / "nvidiactl", NVIDIA_MAJOR, 255)
        _mknod(dev / "nvidia-modeset", NVIDIA_MAJOR, 254)
        _mknod(dev / "nvidia-uvm", UVM_MAJOR, 0)
        _mknod(dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
        if mig_caps:
            caps = dev / "nvidia-caps"
            caps.mkdir(exist_ok=True)
            for gpu in prof.gpus:
                for gi, cis in mig_instances(gpu).items():
                    for ci in (None, *sorted(cis)):
                        minor = mig_cap_minor_fallback(gpu.minor, gi, ci)
                        _mknod(caps / f"nvidia-cap{minor}", CAPS_MAJOR, minor)
    return root


def make_pci_sysfs(sysfs: Path, profile: Profile | str) -> Path:
    """A sysfs with the profile's GPUs on its PCI bus (``bus/pci/devices/<address>/{vendor,class,
    numa_node}``): what tells the agent this is a GPU node, whatever NVML says. Returns ``sysfs``."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    for gpu in prof.gpus:
        device = sysfs / "bus/pci/devices" / gpu.bus_id.lower()[4:]  # NVML's 8-digit domain -> sysfs's 4
        device.mkdir(parents=True, exist_ok=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x030200\n")
        (device / "numa_node").write_text(f"{gpu.numa_node if gpu.numa_node is not None else -1}\n")
    return sysfs

