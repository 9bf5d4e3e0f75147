"""nvmlDeviceSetMigMode in both NVML simulators, through the REAL pynvml on the mock library and
through the Python simulator, each in child processes sharing the fake driver root's state
(test_mig_instances.Machine): NVML's semantics (nvml.h; NVML's docs for nvmlDeviceSetMigMode): the
pending mode is set and activated at once on Hopper and later (an idle GPU), left pending on Ampere
with activation status RESET_REQUIRED; IN_USE while the GPU has a GPU instance; the mode seen by
every process and every MIG call."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
import yaml
from test_mig_instances import Machine, _profile_yaml

from gpudra_dev.localcluster import mockstate
from gpudra_driver.nvml.fake import FakeNvml, load_profile

ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE


@pytest.fixture
def machine(tmp_path: Path, mock_lib: Path) -> Machine:
    return Machine(tmp_path, _profile_yaml(tmp_path), mock_lib)

HOPPER = f'''
h = n.nvmlDeviceGetHandleByIndex(0)
rec("mode", n.nvmlDeviceGetMigMode, h)
gi = create("1g@0", h, 19, 0, 1)
rec("off.with.instance", n.nvmlDeviceSetMigMode, h, {OFF})
rec("mode.with.instance", n.nvmlDeviceGetMigMode, h)
n.nvmlGpuInstanceDestroy(gi)
rec("bad.mode", n.nvmlDeviceSetMigMode, h, 2)
rec("off", n.nvmlDeviceSetMigMode, h, {OFF})
rec("mode.off", n.nvmlDeviceGetMigMode, h)
rec("count.off", n.nvmlDeviceGetMaxMigDeviceCount, h)
rec("slot.off", n.nvmlDeviceGetMigDeviceHandleByIndex, h, 0)
create("create.off", h, 19, 0, 1)
rec("off.again", n.nvmlDeviceSetMigMode, h, {OFF})
rec("other.gpu", n.nvmlDeviceGetMigMode, n.nvmlDeviceGetHandleByIndex(1))
'''
ANOTHER_PROCESS = f'''
h = n.nvmlDeviceGetHandleByIndex(0)
rec("mode.seen", n.nvmlDeviceGetMigMode, h)
rec("on", n.nvmlDeviceSetMigMode, h, {ON})
rec("mode.on", n.nvmlDeviceGetMigMode, h)
gi = create("1g@0", h, 19, 0, 1)
n.nvmlGpuInstanceDestroy(gi)
'''
AMPERE = f'''
h = n.nvmlDeviceGetHandleByIndex(0)
rec("off", n.nvmlDeviceSetMigMode, h, {OFF})
rec("mode.pending", n.nvmlDeviceGetMigMode, h)
gi = create("1g@0", h, 19, 0, 1)
n.nvmlGpuInstanceDestroy(gi)
rec("back", n.nvmlDeviceSetMigMode, h, {ON})
rec("mode.back", n.nvmlDeviceGetMigMode, h)
'''


def test_hopper_switches_at_once_unless_an_instance_exists(machine: Machine) -> None:
    out = machine.both(HOPPER)
    assert out["mode"] == [ON, ON]
    assert out["off.with.instance"] == "!NVMLError_InUse" and out["mode.with.instance"] == [ON, ON]
    assert out["bad.mode"] == "!NVMLError_InvalidArgument"
    assert out["off"] == pynvml.NVML_SUCCESS and out["mode.off"] == [OFF, OFF]  # the activation status
    # MIG mode off: no MIG devices, no instances (nvml.h: NOT_SUPPORTED without MIG mode)
    assert out["count.off"] == 0 and out["slot.off"] == "!NVMLError_NotFound"
    assert out["create.off"] == "!NVMLError_NotSupported"
    assert out["off.again"] == pynvml.NVML_SUCCESS and out["other.gpu"] == [ON, ON]
    seen = machine.both(ANOTHER_PROCESS)  # each backend's own root: the mode outlives the process
    assert seen["mode.seen"] == [OFF, OFF]
    assert seen["on"] == pynvml.NVML_SUCCESS and seen["mode.on"] == [ON, ON] and seen["1g@0"] != "!NVMLError_NotSupported"
    uuid = load_profile(machine.profile).gpus[0].uuid
    assert mockstate.calls(machine.roots["mock"]) == mockstate.calls(machine.roots["fake"])
    assert [c for c in mockstate.calls(machine.roots["mock"]) if "SetMigMode" in c] == [
        f"nvml SetMigMode {uuid} {OFF}", f"nvml SetMigMode {uuid} {OFF}", f"nvml SetMigMode {uuid} {ON}"]


def test_the_simulators_share_the_mode(machine: Machine) -> None:
    machine.run("mock", HOPPER)
    machine.roots["fake"] = machine.roots["mock"]
    assert machine.run("fake", ANOTHER_PROCESS)["mode.seen"] == [OFF, OFF]
    assert machine.run("mock", 'rec("m", n.nvmlDeviceGetMigMode, n.nvmlDeviceGetHandleByIndex(0))')["m"] == [ON, ON]


def test_ampere_leaves_the_change_pending_until_a_reset(tmp_path: Path, mock_lib: Path) -> None:
    doc = {"description": "an A100 with MIG mode on and no MIG devices", "driverVersion": "570.133.20",
           "cudaDriverVersion": 12080,
           "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-5d1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f61",
                     "busId": "00000000:07:00.0", "pciDeviceId": 0x20B210DE, "brand": "NVIDIA", "architecture": "AMPERE",
                     "cudaComputeCapability": "8.0", "memoryMiB": 81920, "migCapable": True, "migMode": "enabled",
                     "maxMigDevices": 7, "migCatalog": "a100-sxm4-80gb"}]}
    profile = tmp_path / "a100.yaml"
    profile.write_text(yaml.safe_dump(doc))
    out = Machine(tmp_path, profile, mock_lib).both(AMPERE)
    assert out["off"] == pynvml.NVML_ERROR_RESET_REQUIRED
    assert out["mode.pending"] == [ON, OFF]  # still MIG until a reset: instances can still be made
    assert out["1g@0"] != "!NVMLError_NotSupported"
    assert out["back"] == pynvml.NVML_SUCCESS and out["mode.back"] == [ON, ON]  # the pending change taken back


def test_simulator_in_memory() -> None:
    nvml = FakeNvml(load_profile("h100-dynamic-mig"))
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceSetMigMode(h, OFF) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(h) == [OFF, OFF] and nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(0)) == [ON, ON]
