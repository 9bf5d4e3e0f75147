"""The mock nvidia-smi's MIG side (tests/mocknvml/nvidia_smi.c) against the REAL pynvml's view of the
same state: ``nvidia-smi -L`` lists each GPU's MIG devices, ``nvidia-smi mig -lgi`` / ``-lci`` the
instances made through NVML, in the real tool's formats.

A GPU reset (``nvidia-smi -r -i <id>``): what a
reset or a reload of the NVIDIA kernel module does to MIG, seen by the REAL pynvml on the mock
libnvidia-ml.so.1 and by the Python simulator on the same kind of root, in other processes: every GPU
and compute instance of that GPU gone, the other GPU's kept, MIG mode kept, an instance made again at
the same place gets the same IDs and a new UUID; refused, as the real tool refuses a GPU in use,
while an MPS control daemon runs for the GPU. Needs ``make mock-nvml mock-nvidia-smi mock-mps-control``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_mig_instances import BACKENDS, Machine
from test_mock_sharing_tools import mps_env, start

from gpudra_driver.nvml.fake import load_profile, mig_uuid
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.fakedriverroot import make_driver_root

PROFILE = "h100-dynamic-mig"  # two H100s, MIG enabled, no MIG devices
GPU0, GPU1 = (g.uuid for g in load_profile(PROFILE).gpus)

MAKE = r'''
h1 = n.nvmlDeviceGetHandleByIndex(1)
for key, handle, profile_id, start, size, ci_index in (("3g@4", h, 9, 4, 4, 2), ("1g@0", h, 19, 0, 1, 0),
                                                       ("gpu1.2g@0", h1, 14, 0, 2, 1)):
    g = create(key, handle, profile_id, start, size)
    rec(key + ".ci", n.nvmlGpuInstanceCreateComputeInstance, g,
        n.nvmlGpuInstanceGetComputeInstanceProfileInfo(g, ci_index, 0).id)
rec("migs", mig_devices, h)
'''

AFTER = r'''
h1 = n.nvmlDeviceGetHandleByIndex(1)
rec("migs", mig_devices, h)
rec("gpu1.migs", mig_devices, h1)
rec("3g", gpu_instances, h, 9)
rec("migMode", n.nvmlDeviceGetMigMode, h)
g = create("3g@4.again", h, 9, 4, 4)
rec("3g@4.again.ci", n.nvmlGpuInstanceCreateComputeInstance, g, n.nvmlGpuInstanceGetComputeInstanceProfileInfo(g, 2, 0).id)
rec("migs.again", mig_devices, h)
'''


def smi(root: Path, *args: str, env_dev: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The root's mock nvidia-smi; ``env_dev``: where it looks for device nodes instead of /dev."""
    env = {k: v for k, v in os.environ.items() if k not in (mockstate.STATE_ENV, "GPUDRA_MOCK_DEV_DIR")}
    if env_dev is not None:
        env["GPUDRA_MOCK_DEV_DIR"] = str(env_dev)
    return subprocess.run([str(root / "usr/bin/nvidia-smi"), *args], capture_output=True, text=True, timeout=30,
                          env=env)


@pytest.fixture
def machine(tmp_path: Path, mock_lib: Path) -> Machine:  # noqa: F811 - the fixture
    machine = Machine(tmp_path, PROFILE, mock_lib)
    for root in machine.roots.values():
        if not (root / "usr/bin/nvidia-smi").read_bytes().startswith(b"\x7fELF"):
            pytest.fail("the mock nvidia-smi is not built: make mock-nvidia-smi", pytrace=False)
    return machine


def test_a_reset_destroys_every_instance_of_the_gpu_and_keeps_its_mig_mode(machine: Machine) -> None:
    before = machine.both(MAKE)
    assert [(d["gi"], d["ci"], d["uuid"]) for d in before["migs"] if isinstance(d, dict)] == [
        (2, 0, mig_uuid(GPU0, 2, 0)), (7, 0, mig_uuid(GPU0, 7, 0))]
    for backend in BACKENDS:
        done = smi(machine.roots[backend], "-r", "-i", "0")
        assert (done.returncode, done.stdout, done.stderr) == (
            0, "GPU 00000000:18:00.0 was successfully reset.\nAll done.\n", ""), done
        assert mockstate.calls(machine.roots[backend], "nvidia-smi") == [f"nvidia-smi -r {GPU0}"]
    after = machine.both(AFTER)
    nf = "!NVMLError_NotFound"
    assert after["migs"] == [nf] * 7 and after["3g"] == []  # every instance of GPU 0 gone
    assert [d["gi"] for d in after["gpu1.migs"] if isinstance(d, dict)] == [3]  # GPU 1's kept
    assert after["migMode"] == [1, 1]  # MIG mode is the GPU's setting: kept
    # made again at the same place: the same IDs (the placement's), another UUID
    (again,) = [d for d in after["migs.again"] if isinstance(d, dict)]
    assert (again["gi"], again["ci"], again["uuid"]) == (2, 0, mig_uuid(GPU0, 2, 0, 1))
    assert again["uuid"] != mig_uuid(GPU0, 2, 0)


def test_a_reset_is_refused_while_an_mps_daemon_holds_the_gpu_and_of_a_mig_device(machine: Machine,
                                                                                  tmp_path: Path) -> None:
    root = machine.roots["mock"]
    machine.run("mock", MAKE)
    pid = start(root, mps_env(tmp_path, devices="0"))
    try:
        refused = smi(root, "-r", "-i", GPU0)
        assert refused.returncode == 255 and "GPU 00000000:18:00.0: In use by another client" in refused.stderr
        assert smi(root, "-r", "-i", "1").returncode == 0  # the daemon holds GPU 0 only
    finally:
        os.kill(pid, 9)
        assert mockstate.wait_exited(pid, 10)
    assert [d["gi"] for d in machine.run("mock", "rec('migs', mig_devices, h)")["migs"] if isinstance(d, dict)] == [2, 7]
    assert smi(root, "-r", "-i", "7").returncode == 6  # no such GPU
    assert smi(root, "-r", "-i", "0", "-c", "3").returncode == 2
    assert mockstate.calls(root, "nvidia-smi") == [f"nvidia-smi -r {GPU1}"]


# -- the listings ----------------------------------------------------------------------------------

SEEN = r'''
out["gpus"] = []
for index in range(n.nvmlDeviceGetCount()):
    g = n.nvmlDeviceGetHandleByIndex(index)
    gis, cis = [], []
    for profile in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = n.nvmlDeviceGetGpuInstanceProfileInfo(g, profile)
        except n.NVMLError:
            continue
        count = ctypes.c_uint(0)
        buf = (n.c_nvmlGpuInstance_t * 8)()
        n.nvmlDeviceGetGpuInstances(g, info.id, buf, ctypes.byref(count))
        for i in range(count.value):
            gi = n.nvmlGpuInstanceGetInfo(buf[i])
            name = norm(info.name).removeprefix("MIG ")
            gis.append([gi.id, name, info.id, gi.placement.start, gi.placement.size])
            for cp in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    cinfo = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(buf[i], cp, 0)
                except n.NVMLError:
                    continue
                for ci in compute_instances(buf[i], cinfo.id):
                    cis.append([gi.id, name, cinfo.id, ci, 0, cinfo.sliceCount])
    migs = [[d["uuid"], d["name"].rsplit(" ", 1)[-1]] if isinstance(d, dict) else None for d in mig_devices(g)]
    out["gpus"].append({"gis": sorted(gis), "cis": sorted(cis), "migs": migs})
'''


def test_the_listings_show_what_nvml_shows(machine: Machine, mock_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    # a root whose dev/ holds every node, capability nodes included: the host's view through -L
    root = make_driver_root(tmp_path / "dev-root", PROFILE, library=mock_lib, device_nodes=True, mig_caps=True)
    machine.roots["mock"] = root
    machine.run("mock", MAKE)
    seen = machine.run("mock", SEEN)["gpus"]

    gi_rows = [f"|{index:4d}  {'MIG ' + name:<20}{pid:2d}{gi:9d}{start:11d}:{size:<6d}|"
               for index, gpu in enumerate(seen) for gi, name, pid, start, size in gpu["gis"]]
    assert len(gi_rows) == 3
    lgi = smi(root, "mig", "-lgi")
    assert lgi.returncode == 0, lgi
    rule = "+" + "-" * 55 + "+"
    assert lgi.stdout.splitlines() == [
        rule, "| GPU instances:" + " " * 40 + "|", "| GPU   Name             Profile  Instance   Placement  |",
        "|                          ID       ID       Start:Size |", "|" + "=" * 55 + "|",
        *[line for row in gi_rows for line in (row, rule)]]
    assert "|   0  MIG 3g.40gb          9        2          4:4     |" in lgi.stdout  # the real tool's columns

    ci_rows = [f"|{index:4d}{gi:7d}       {'MIG ' + name:<20}{pid:2d}{ci:10d}{start:11d}:{size:<6d}|"
               for index, gpu in enumerate(seen) for gi, name, pid, ci, start, size in gpu["cis"]]
    lci = smi(root, "mig", "-lci", "-i", "0")
    assert lci.returncode == 0, lci
    assert [x for x in lci.stdout.splitlines() if x.startswith("|   0")] == [r for r in ci_rows if r.startswith("|   0")]
    assert "|   0      2       MIG 3g.40gb          2         0          0:3     |" in lci.stdout

    listing = smi(root, "-L", env_dev=root / "dev")
    assert listing.returncode == 0, listing
    lines = listing.stdout.splitlines()[1:]
    expected = []
    for index, (gpu, spec) in enumerate(zip(seen, load_profile(PROFILE).gpus)):
        expected.append(f"GPU {index}: {spec.name} (UUID: {spec.uuid}) /dev/nvidia{spec.minor}")
        expected += [f"  MIG {name:<12}Device {slot:2d}: (UUID: {uuid})"
                     for slot, found in enumerate(gpu["migs"]) if found for uuid, name in [found]]
    assert lines == expected
    assert lines[1] == f"  MIG 3g.40gb     Device  0: (UUID: {mig_uuid(GPU0, 2, 0)})"

    # after a reset: nothing to list, and the tool says so as the real one does
    assert smi(root, "-r", "-i", "0").returncode == 0
    empty = smi(root, "mig", "-lgi", "-i", "0")
    assert (empty.returncode, empty.stdout) == (6, "No GPU instances found: Not Found\n")
    assert [x for x in smi(root, "-L", env_dev=root / "dev").stdout.splitlines() if "MIG" in x][0].startswith(
        "  MIG 2g.20gb")  # GPU 1's only
