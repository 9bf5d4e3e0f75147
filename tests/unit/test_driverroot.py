"""The driver root: libraries found by NVIDIA's search, symlinks resolved inside the root, and an
error that names the root and every path searched."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from gpudra_driver.driverroot import (LIBRARY_DIRS, DriverRoot, DriverRootError, ld_cache_lookup, library_version,
                                      locate_nvml, resolve_in_root)

VERSION = "580.95.05"


def elf(machine: int = 62, bits: int = 2) -> bytes:
    """An ELF header: class (1: 32-bit, 2: 64-bit), little-endian, e_type ET_DYN, ``machine``."""
    return b"\x7fELF" + bytes([bits, 1, 1]) + bytes(9) + struct.pack("<HH", 3, machine) + bytes(44)


def install(root: Path, directory: str, content: bytes | None = None, *, version: str = VERSION) -> Path:
    folder = root / directory
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"libnvidia-ml.so.{version}"
    target.write_bytes(content if content is not None else elf())
    (folder / "libnvidia-ml.so.1").symlink_to(target.name)
    return target


@pytest.mark.parametrize("directory", ["usr/lib/x86_64-linux-gnu", "usr/lib64", "lib64", "usr/lib/aarch64-linux-gnu",
                                       "usr/lib", "usr/lib/x86_64-linux-gnu/nvidia/current"])
def test_the_library_is_found_in_each_lib_dir_of_nvidias_search(tmp_path: Path, directory: str) -> None:
    install(tmp_path, directory)
    library = locate_nvml(DriverRoot.at(str(tmp_path)))
    assert library.path == tmp_path / directory / f"libnvidia-ml.so.{VERSION}"
    assert library.version == VERSION


def test_a_missing_library_names_the_root_and_every_path_searched(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    with pytest.raises(DriverRootError) as info:
        locate_nvml(DriverRoot.at(str(tmp_path)))
    message = str(info.value)
    assert str(tmp_path) in message and "libnvidia-ml.so.1 was not found" in message
    for directory in LIBRARY_DIRS:
        assert str(tmp_path / directory / "libnvidia-ml.so.1") in message
    assert str(tmp_path / "etc/ld.so.cache") in message


def test_a_missing_or_empty_root_is_said_so(tmp_path: Path) -> None:
    with pytest.raises(DriverRootError, match="does not exist"):
        locate_nvml(DriverRoot.at(str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DriverRootError, match="is empty"):
        locate_nvml(DriverRoot.at(str(tmp_path / "empty")))
    with pytest.raises(DriverRootError, match="not an absolute path"):
        DriverRoot.at("run/nvidia/driver")


def test_an_absolute_link_resolves_inside_the_root_like_a_driver_container(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / f"libnvidia-ml.so.{VERSION}").write_bytes(elf())
    # the driver container's own absolute link: /usr/lib/... inside the container, not the host's
    (lib / "libnvidia-ml.so.1").symlink_to(f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}")
    assert locate_nvml(DriverRoot.at(str(tmp_path))).path == lib / f"libnvidia-ml.so.{VERSION}"


def test_a_link_out_of_the_root_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    install(outside, "lib")
    root = tmp_path / "root"
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").symlink_to(f"../../../../outside/lib/libnvidia-ml.so.{VERSION}")
    with pytest.raises(DriverRootError, match="leads out of the root"):
        locate_nvml(DriverRoot.at(str(root)))
    with pytest.raises(DriverRootError, match="out of the root"):
        resolve_in_root(root, "/../outside/lib")


def test_a_dangling_link_is_a_missing_library(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{VERSION}")
    with pytest.raises(DriverRootError, match="was not found"):
        locate_nvml(DriverRoot.at(str(tmp_path)))


def test_a_link_loop_is_an_error_not_a_hang(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.1")
    with pytest.raises(DriverRootError, match="too many levels"):
        locate_nvml(DriverRoot.at(str(tmp_path)))


@pytest.mark.parametrize(("content", "expected"), [
    (elf(machine=183), "64-bit aarch64 library"),
    (elf(bits=1, machine=3), "32-bit i386 library"),
    (b"not an elf at all, just text.......", "not an ELF shared library"),
])
def test_a_library_of_another_architecture_is_refused_before_loading(tmp_path: Path, content: bytes,
                                                                     expected: str) -> None:
    install(tmp_path, "usr/lib/x86_64-linux-gnu", content)
    with pytest.raises(DriverRootError, match=expected) as info:
        locate_nvml(DriverRoot.at(str(tmp_path)))
    assert str(tmp_path) in str(info.value)


def test_the_host_root_works_as_a_host_install() -> None:
    root = DriverRoot.at("/")
    assert root.host_path("/usr/bin/nvidia-smi") == "/usr/bin/nvidia-smi"
    assert DriverRoot.at("/run/nvidia/driver/", "/driver-root").host_path("/usr/bin/x") == "/run/nvidia/driver/usr/bin/x"


def test_library_versions() -> None:
    assert library_version("/usr/lib64/libnvidia-ml.so.580.95.05", "libnvidia-ml.so") == "580.95.05"
    assert library_version("/usr/lib64/libnvidia-ml.so.1", "libnvidia-ml.so") is None
    assert library_version("/usr/lib64/libnvidia-ml.so.550.54", "libnvidia-ml.so") == "550.54"


def _ld_cache(entries: dict[str, str]) -> bytes:
    """A glibc-ld.so.cache1.1 file with ``entries`` (name -> path)."""
    strings = b""
    offsets = []
    header_size = 48 + 24 * len(entries)
    for name, path in entries.items():
        key = header_size + len(strings)
        strings += name.encode() + b"\0"
        value = header_size + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((key, value))
    header = b"glibc-ld.so.cache1.1" + struct.pack("<II", len(entries), len(strings)) + bytes(4) + bytes(4) + bytes(12)
    table = b"".join(struct.pack("<iIIIQ", 0x0303, k, v, 0, 0) for k, v in offsets)
    return header + table + strings


def test_the_roots_ld_so_cache_is_consulted_last(tmp_path: Path) -> None:
    install(tmp_path, "opt/nvidia/lib")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.cache").write_bytes(_ld_cache({
        "libfoo.so.1": "/usr/lib/libfoo.so.1", "libnvidia-ml.so.1": "/opt/nvidia/lib/libnvidia-ml.so.1"}))
    assert ld_cache_lookup(tmp_path, "libnvidia-ml.so.1") == "/opt/nvidia/lib/libnvidia-ml.so.1"
    assert locate_nvml(DriverRoot.at(str(tmp_path))).path == tmp_path / f"opt/nvidia/lib/libnvidia-ml.so.{VERSION}"


def test_no_library_dir_of_the_root_goes_on_ld_library_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading by full path leaves the loader's search path alone (the host's glibc stays out)."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    install(tmp_path, "usr/lib64")
    locate_nvml(DriverRoot.at(str(tmp_path)))
    assert "LD_LIBRARY_PATH" not in os.environ
