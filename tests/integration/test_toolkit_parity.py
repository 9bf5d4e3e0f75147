"""Parity with NVIDIA's own toolkit: on the same fake driver root, with the mock NVML answering
``nvidia-ctk cdi generate --driver-root``, a gpudra claim on GPU N gives a container what the
toolkit's device N plus its common edits give it. Both specs go through the official CDI library
(``cdi-validate``), which injects each device into an OCI spec: the comparison is of what a
container actually gets. The deliberate differences (docs/cdi.md) are the only ones allowed:

* ``NVIDIA_VISIBLE_DEVICES``: the toolkit's device specs say ``void`` (for an NVIDIA runtime in
  legacy mode); gpudra's names the claim's GPU UUIDs;
* the toolkit's ``/dev/null`` -> ``/var/run/nvidia-container-devices/void`` marker mount (the same
  legacy-runtime concern);
* the per-device ``apply-cuda-memory-limits`` hook, which applies ``NVIDIA_GPU_MEMORY_REQUEST``
  (memory limits belong to gpudra's sharing modes).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cdispec import validate_with_cdi_library

from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.plugin.cdi import CdiDir, cdi_device_id
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.driverfiles import DriverFilesCache
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.plan import plan_prepare
from gpudra_dev.localcluster.fakedriverroot import make_driver_root

REPO = Path(__file__).resolve().parents[2]
DRIVER = "gpu.gpudra.io"
HOOK = "/usr/bin/nvidia-cdi-hook"  # where the toolkit points its hooks when the hook is not on PATH
TOOLKIT_ONLY_MOUNTS = {"/var/run/nvidia-container-devices/void"}
TOOLKIT_ONLY_HOOKS = {"apply-cuda-memory-limits"}


def nvidia_ctk() -> Path:
    given = os.environ.get("GPUDRA_NVIDIA_CTK_DIR")
    if given and (Path(given) / "nvidia-ctk").is_file():
        return Path(given) / "nvidia-ctk"
    built = subprocess.run([str(REPO / "hack/nvidia-ctk-bin.sh")], capture_output=True, text=True)
    lines = built.stdout.strip().splitlines()
    if built.returncode != 0 or not lines or not (Path(lines[-1]) / "nvidia-ctk").is_file():
        pytest.fail(f"nvidia-ctk is not built: run `cd {REPO} && make nvidia-ctk`\n{built.stderr[-2000:]}",
                    pytrace=False)
    return Path(lines[-1]) / "nvidia-ctk"


def toolkit_spec(root: Path, out: Path) -> Path:
    """``nvidia-ctk cdi generate`` on ``root``. For MIG the toolkit reads the capability minors from
    the host's ``/proc/driver/nvidia-caps/mig-minors``, never from the driver root: it runs in a
    mount namespace of its own (``unshare --mount``, private propagation) where a tmpfs over
    /proc/driver holds the fake root's table. Nothing of it is seen outside."""
    scratch = out.parent / "ctk-tmp"  # the tool writes nothing to a shared /tmp
    scratch.mkdir(exist_ok=True)
    command = [str(nvidia_ctk()), "cdi", "generate", "--driver-root", str(root), "--output", str(out),
               "--nvidia-cdi-hook-path", str(root / "usr/bin/nvidia-cdi-hook")]
    table = root / "proc/driver/nvidia-caps/mig-minors"
    if table.is_file():
        script = ('mount -t tmpfs gpudra-proc-driver /proc/driver && mkdir /proc/driver/nvidia-caps && '
                  'cp "$0" /proc/driver/nvidia-caps/mig-minors && exec "$@"')
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(table), *command]
    generated = subprocess.run(command, capture_output=True, text=True, timeout=60,
                               env={**os.environ, "TMPDIR": str(scratch)})
    assert generated.returncode == 0, generated.stderr
    return out


def container_view(oci: dict[str, Any]) -> dict[str, Any]:
    linux = oci.get("linux") or {}
    hooks = [h for phase in (oci.get("hooks") or {}).values() for h in phase]
    return {
        "devices": sorted(d["path"] for d in linux.get("devices") or []),
        "mounts": sorted(m["destination"] for m in oci.get("mounts") or []),
        "sources": {m["destination"]: m["source"] for m in oci.get("mounts") or []},
        "hooks": sorted({h["args"][1] for h in hooks}),
        "hook_paths": {h["path"] for h in hooks},
        "env": dict(e.split("=", 1) for e in (oci.get("process") or {}).get("env") or []),
    }


@pytest.mark.parametrize("profile", ["l4x2", "dgx-h100", "a100-80gb-mig"])
def test_a_claim_on_gpu_n_gets_what_nvidia_ctk_gives_gpu_n(tmp_path: Path, profile: str) -> None:
    root = make_driver_root(tmp_path / "root", profile)
    # NVIDIA's own hook, as a host install of the toolkit puts it: gpudra finds it in the root and
    # asks its version (1.20.2: every hook kind), the toolkit is pointed at the same file
    shutil.copy(nvidia_ctk().parent / "nvidia-cdi-hook", root / "usr/bin/nvidia-cdi-hook")
    toolkit = toolkit_spec(root, tmp_path / "nvidia.yaml")
    files = DriverFilesCache(DriverRoot.at(str(root)))
    cdi = CdiDir(tmp_path / "cdi", DRIVER, files)

    from gpudra_driver.discovery import scan
    from gpudra_driver.nvml.fake import FakeNvml, load_profile
    from gpudra_driver.plugin.devicenodes import node_devices

    devices = node_devices(scan(FakeNvml(load_profile(profile))).devices)
    specs = []
    for index, name in enumerate(sorted(devices)):
        uid = f"0c1d2e3f-0000-4000-8000-{index:012d}"
        claim = {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": "n", "device": name}]}}}}
        prepared = plan_prepare(ClaimRef("ns", f"c{index}", uid), claim, devices, Checkpoint("b"),
                                node="n", driver=DRIVER).claim
        specs.append((index, uid, name, cdi.write(prepared)))
    injected = validate_with_cdi_library([toolkit, *(path for *_, path in specs)])
    assert specs
    for index, uid, name, _ in specs:
        ours = container_view(injected[cdi_device_id(DRIVER, uid, name)])
        theirs = container_view(injected[f"nvidia.com/gpu={devices[name].uuid}"])  # GPU-… or MIG-…
        assert ours["devices"] == theirs["devices"], (name, ours["devices"], theirs["devices"])
        assert ours["mounts"] == sorted(set(theirs["mounts"]) - TOOLKIT_ONLY_MOUNTS)
        assert all(ours["sources"][m] == theirs["sources"][m] for m in ours["mounts"])
        assert ours["hooks"] == sorted(set(theirs["hooks"]) - TOOLKIT_ONLY_HOOKS)
        assert ours["hook_paths"] == theirs["hook_paths"] == {str(root / "usr/bin/nvidia-cdi-hook")}
        assert {k: v for k, v in ours["env"].items() if k != "NVIDIA_VISIBLE_DEVICES"} == \
            {k: v for k, v in theirs["env"].items() if k != "NVIDIA_VISIBLE_DEVICES"}
        assert theirs["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert ours["env"]["NVIDIA_VISIBLE_DEVICES"] == next(
            d.uuid for d in devices.values() if d.name == name)


def test_without_the_hook_libraries_are_loadable_by_soname_from_mounts_alone(tmp_path: Path) -> None:
    """No nvidia-cdi-hook on the node: no hooks, and each library is mounted at its soname too."""
    root = make_driver_root(tmp_path / "root", "l4x2")
    files = DriverFilesCache(DriverRoot.at(str(root))).current()
    assert files.hook is None
    hooked = dataclasses.replace(files, hook=HOOK, hook_version=(1, 20, 2))
    from gpudra_driver.plugin.driverfiles import common_edits

    plain, with_hook = common_edits(files), common_edits(hooked)
    assert "hooks" not in plain and {h["args"][1] for h in with_hook["hooks"]} == {
        "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification",
        "update-application-profile"}
    extra = {m["containerPath"] for m in plain["mounts"]} - {m["containerPath"] for m in with_hook["mounts"]}
    lib = "/usr/lib/x86_64-linux-gnu"
    assert {f"{lib}/libcuda.so.1", f"{lib}/libnvidia-ml.so.1", f"{lib}/libcuda.so", f"{lib}/libnvidia-nvvm.so.4"} <= extra
