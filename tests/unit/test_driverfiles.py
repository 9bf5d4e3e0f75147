"""The driver's user space a claim's container gets: read from the driver root, following the
running driver's version, never a spec with a device node that is not there."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cdispec import load_and_validate
from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.driverfiles import DriverFilesCache, DriverFilesError, scan_driver_files
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.state import DeviceState
from gpudra_dev.localcluster.fakedriverroot import make_driver_root

LIB = "usr/lib/x86_64-linux-gnu"
A = "0c1d2e3f-0000-4000-8000-00000000000a"
B = "0c1d2e3f-0000-4000-8000-00000000000b"


def upgrade(root: Path, old: str, new: str) -> None:
    """What a driver container upgrade leaves: the new version's files, the links moved to them."""
    lib = root / LIB
    for path in sorted(lib.glob(f"*.so.{old}")):
        shutil.copy(path, lib / path.name.replace(old, new))
        path.unlink()
    for link in lib.iterdir():
        if link.is_symlink() and os.readlink(link).endswith(old):
            target = os.readlink(link).replace(old, new)
            link.unlink()
            link.symlink_to(target)
    (root / "lib/firmware/nvidia" / old).rename(root / "lib/firmware/nvidia" / new)


def test_a_driver_upgrade_under_a_running_agent_is_followed_once_the_view_is_renewed(tmp_path: Path) -> None:
    from gpudra_driver.plugin.driverfiles import VIEW_TTL

    root = make_driver_root(tmp_path / "root", "dgx-h100")
    now = [0.0]
    cache = DriverFilesCache(DriverRoot.at(str(root)), clock=lambda: now[0])
    before = cache.current()
    scanned = cache._versioned
    now[0] += VIEW_TTL
    assert cache.current() == before and cache._versioned is scanned  # same version: nothing rescanned
    upgrade(root, before.version, "590.10.01")
    assert cache.current() == before  # within the view's life, every prepare gets the same view
    now[0] += VIEW_TTL
    after = cache.current()
    assert after.version == "590.10.01"
    containers = {m.container for m in after.libraries}
    assert f"/{LIB}/libcuda.so.590.10.01" in containers and f"/{LIB}/libcuda.so.{before.version}" not in containers
    assert {m.container for m in after.firmware} == {f"/lib/firmware/nvidia/590.10.01/{n}"
                                                     for n in ("gsp_ga10x.bin", "gsp_tu10x.bin")}


def test_a_version_without_its_libraries_names_what_is_missing(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "l4x2")
    version = DriverFilesCache(DriverRoot.at(str(root))).current().version
    (root / LIB / f"libcuda.so.{version}").unlink()
    (root / LIB / "libcuda.so.1").unlink()
    (root / LIB / "libcuda.so.1").symlink_to("libcuda.so.550.1")  # an older install's leftover
    (root / LIB / "libcuda.so.550.1").write_bytes(b"\x7fELF")
    with pytest.raises(DriverFilesError, match=rf"has no libcuda.so.{version} in /{LIB}: the driver version {version}"):
        scan_driver_files(DriverRoot.at(str(root)), version)


def test_a_driver_containers_absolute_links_mount_its_own_files(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "run-nvidia-driver", "l4x2", device_nodes=False)
    version = DriverFilesCache(DriverRoot.at(str(root))).current().version
    link = root / LIB / "libcuda.so.1"
    link.unlink()
    link.symlink_to(f"/{LIB}/libcuda.so.{version}")  # absolute, as inside the container
    files = DriverFilesCache(DriverRoot.at("/run/nvidia/driver", root)).current()
    cuda = next(m for m in files.libraries if m.container == f"/{LIB}/libcuda.so.{version}")
    assert cuda.host == f"/run/nvidia/driver/{LIB}/libcuda.so.{version}"  # the host's path of its file
    assert files.device_root == ""  # no device nodes in the root: the host's /dev


def test_missing_device_nodes_fail_that_claim_only_and_write_nothing(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "dgx-h100")
    (root / "dev/nvidia3").unlink()  # the driver is still creating its nodes
    cdi = CdiDir(tmp_path / "cdi", DRIVER, DriverFilesCache(DriverRoot.at(str(root))))
    state = DeviceState(tmp_path / "plugin", cdi, driver=DRIVER, node=NODE, boot_id="b")
    state.recover()
    state.set_devices(devices())

    import asyncio

    out = asyncio.run(state.prepare([(ClaimRef("ns", "a", A), claim(A, name="a", results=[result("gpu-3")])),
                                     (ClaimRef("ns", "b", B), claim(B, name="b", results=[result("gpu-4")]))]))
    assert out[A].error == (f"ResourceClaim ns/a (UID {A}): device node(s) /dev/nvidia3 missing in {root}/dev: "
                            "the NVIDIA driver may still be loading on this node (the kubelet retries)")
    assert out[B].error is None
    assert sorted(os.listdir(tmp_path / "cdi")) == [f"k8s.{DRIVER}-claim_{B}.json"]
    load_and_validate(tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{B}.json")


def test_a_device_node_is_looked_for_until_seen_then_again_once_the_view_is_renewed(tmp_path: Path) -> None:
    from gpudra_driver.plugin.driverfiles import VIEW_TTL

    root = make_driver_root(tmp_path / "root", "dgx-h100")
    node = root / "dev/nvidia3"
    mode, rdev = node.stat().st_mode, node.stat().st_rdev
    node.unlink()  # the driver is still creating its nodes
    now = [0.0]
    cache = DriverFilesCache(DriverRoot.at(str(root)), clock=lambda: now[0])
    cache.current()
    with pytest.raises(DriverFilesError, match="nvidia3 missing"):
        cache.check_device_nodes(["/dev/nvidia3"])
    os.mknod(node, mode, rdev)
    cache.check_device_nodes(["/dev/nvidia3"])  # created: seen at once, no waiting for the view
    node.unlink()
    cache.check_device_nodes(["/dev/nvidia3"])  # seen present within this view: not looked at again
    now[0] += VIEW_TTL
    cache.current()
    with pytest.raises(DriverFilesError, match="nvidia3 missing"):
        cache.check_device_nodes(["/dev/nvidia3"])


def test_control_nodes_and_sockets_that_appear_later_are_in_the_next_spec(tmp_path: Path) -> None:
    """nvidia-uvm is created on the first CUDA use on a host install, persistenced starts after the
    driver: neither waits for a new driver version to be noticed."""
    root = make_driver_root(tmp_path / "root", "l4x2")
    (root / "dev/nvidia-uvm").unlink()
    now = [0.0]
    cache = DriverFilesCache(DriverRoot.at(str(root)), clock=lambda: now[0])
    assert "/dev/nvidia-uvm" not in cache.current().control_nodes
    os.mknod(root / "dev/nvidia-uvm", 0o20666, os.makedev(510, 0))
    (root / "run/nvidia-persistenced").mkdir(parents=True)
    (root / "run/nvidia-persistenced/socket").write_text("")  # a socket in life; any file will do here
    assert "/dev/nvidia-uvm" not in cache.current().control_nodes  # a burst of prepares: one look
    now[0] += 1.0
    files = cache.current()
    assert "/dev/nvidia-uvm" in files.control_nodes
    assert "/run/nvidia-persistenced/socket" in {m.container for m in files.ipc}


def test_a_driver_upgraded_on_disk_but_not_loaded_fails_prepares_until_a_reboot(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "l4x2")
    proc = tmp_path / "proc"
    (proc / "driver/nvidia").mkdir(parents=True)
    version = DriverFilesCache(DriverRoot.at(str(root)), proc=proc).current().version  # no module file: fine
    (proc / "driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    with pytest.raises(DriverFilesError, match=rf"holds driver {version}, but the loaded kernel module is 550.54.15"):
        DriverFilesCache(DriverRoot.at(str(root)), proc=proc).current()
    (proc / "driver/nvidia/version").write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build\n")
    assert DriverFilesCache(DriverRoot.at(str(root)), proc=proc).current().version == version


def test_a_link_out_of_the_root_is_a_per_claim_error_not_an_exception(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "dgx-h100")
    cache = DriverFilesCache(DriverRoot.at(str(root)))
    link = root / LIB / "libcuda.so.1"
    link.unlink()
    link.symlink_to("../../../../../../../etc/passwd")
    with pytest.raises(DriverFilesError, match="leads out of the root"):
        cache.current()


def test_the_hooks_follow_what_the_nodes_nvidia_cdi_hook_supports(tmp_path: Path) -> None:
    import dataclasses

    from gpudra_driver.plugin.driverfiles import common_edits

    files = DriverFilesCache(DriverRoot.at(str(make_driver_root(tmp_path / "root", "l4x2")))).current()

    def kinds(version: tuple[int, int, int] | None) -> list[str]:
        edits = common_edits(dataclasses.replace(files, hook="/usr/bin/nvidia-cdi-hook", hook_version=version))
        return [h["args"][1] for h in edits["hooks"]]

    basic = ["create-symlinks", "update-ldcache"]
    assert kinds(None) == basic  # a hook of unknown version (--nvidia-cdi-hook): only what every one has
    assert kinds((1, 17, 4)) == basic
    assert kinds((1, 18, 0)) == ["create-symlinks", "enable-cuda-compat", "update-ldcache"]
    assert kinds((1, 20, 2)) == ["create-symlinks", "enable-cuda-compat", "update-ldcache",
                                 "disable-device-node-modification", "update-application-profile"]


def test_a_start_while_the_driver_is_not_ready_keeps_the_specs_and_serves(tmp_path: Path) -> None:
    """The agent restarts while the driver container is being replaced: the stale-spec rewrite
    cannot build a spec now, so it keeps the one on disk and says so, instead of crash-looping
    (running pods need their unprepare)."""
    import asyncio

    root = make_driver_root(tmp_path / "root", "dgx-h100")
    cdi = CdiDir(tmp_path / "cdi", DRIVER, DriverFilesCache(DriverRoot.at(str(root))))
    state = DeviceState(tmp_path / "plugin", cdi, driver=DRIVER, node=NODE, boot_id="b")
    state.recover()
    state.set_devices(devices())
    out = asyncio.run(state.prepare([(ClaimRef("ns", "a", A), claim(A, name="a", results=[result("gpu-3")]))]))
    assert out[A].error is None
    spec = (tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{A}.json").read_bytes()
    shutil.rmtree(root / "dev")  # the driver is being reloaded
    again = DeviceState(tmp_path / "plugin", CdiDir(tmp_path / "cdi", DRIVER, DriverFilesCache(DriverRoot.at(str(root)))),
                        driver=DRIVER, node=NODE, boot_id="b")
    again.recover()
    assert (tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{A}.json").read_bytes() == spec
    assert again.prepared_count == 1
