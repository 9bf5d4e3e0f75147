"""Health in the simulation: the REAL pynvml against the mock libnvidia-ml.so.1 and the Python
simulator run one scenario of injected health (mockstate: XIDs, ECC, a lost GPU, the recovery
action, recovery) and must answer alike; then the health monitor's probe on the simulator (the integration tests run it on the mock)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.devicehealth.plan import Probe
from gpudra_driver.devicehealth.apply import probe
from gpudra_driver.nvml import load_nvml
from gpudra_dev.localcluster.fakedriverroot import make_driver_root

SECOND_GPU = """
  - name: NVIDIA A100-SXM4-80GB
    uuid: GPU-00000000-0000-4000-8000-000000000002
    brand: NVIDIA
    architecture: AMPERE
    cudaComputeCapability: "8.0"
    memoryMiB: 81920
    pciDeviceId: 0x20B210DE
    busId: "00000000:0F:00.0"
    migCapable: true
    migMode: disabled
"""

# Runs against whatever NVML `n` is and records each answer (or the NVMLError class); `inject(kind,
# uuid, *args)` appends to the root's events file between the calls.
SCENARIO = r'''
def scenario(n, inject):
    out = []
    def rec(key, fn, *args):
        try:
            v = fn(*args)
        except n.NVMLError as e:
            out.append([key, "!" + type(e).__name__])
            return None
        out.append([key, v])
        return v
    def event(key, s, timeout):
        try:
            d = n.nvmlEventSetWait_v2(s, timeout)
        except n.NVMLError as e:
            out.append([key, "!" + type(e).__name__])
            return
        out.append([key, [n.nvmlDeviceGetUUID(d.device), d.eventType, d.eventData, d.gpuInstanceId,
                          d.computeInstanceId]])
    def action(key, h):
        try:
            (v,) = n.nvmlDeviceGetFieldValues(h, [230, 1])[:1]
        except n.NVMLError as e:
            out.append([key, "!" + type(e).__name__])
            return
        out.append([key, [v.fieldId, v.nvmlReturn, v.valueType, v.value.uiVal]])

    n.nvmlInit()
    early = n.nvmlEventSetCreate()  # made before the injections below: gets none of them
    gpus = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
    uuids = [n.nvmlDeviceGetUUID(h) for h in gpus]
    mig = n.nvmlDeviceGetMigDeviceHandleByIndex(gpus[0], 0) if n.nvmlDeviceGetMaxMigDeviceCount(gpus[0]) else None
    mig_uuid = n.nvmlDeviceGetUUID(mig)
    rec("supported", n.nvmlDeviceGetSupportedEventTypes, gpus[0])
    rec("supported.mig", n.nvmlDeviceGetSupportedEventTypes, mig)
    inject("xid", uuids[0], 31)  # before the set: not delivered
    s = n.nvmlEventSetCreate()
    rec("register.bad", n.nvmlDeviceRegisterEvents, gpus[0], 1 << 40, s)
    rec("register", n.nvmlDeviceRegisterEvents, gpus[0], 0x8 | 0x2, s)
    rec("register.early", n.nvmlDeviceRegisterEvents, gpus[-1], 0x8, early)
    event("none", s, 50)
    inject("xid", uuids[-1], 48)  # a GPU not registered: not delivered
    inject("xid", mig_uuid, 94)
    inject("ecc", uuids[0])
    inject("xid", uuids[0], 79)
    for i in range(3):
        event(f"event.{i}", s, 1000)
    event("drained", s, 50)
    action("action.none", gpus[0])
    inject("action", uuids[0], 1)
    action("action.reset", gpus[0])
    action("action.mig", mig)
    inject("lost", uuids[0])
    event("lost.wait", s, 1000)
    rec("lost.by_uuid", n.nvmlDeviceGetHandleByUUID, uuids[0])
    rec("lost.by_index", n.nvmlDeviceGetHandleByIndex, 0)
    rec("lost.name", n.nvmlDeviceGetName, gpus[0])
    rec("lost.mig", n.nvmlDeviceGetUUID, mig)
    rec("other.name", n.nvmlDeviceGetName, gpus[-1])
    rec("other.uuid", n.nvmlDeviceGetUUID, gpus[-1])
    inject("recover", uuids[0])
    rec("recovered.uuid", n.nvmlDeviceGetUUID, gpus[0])
    action("recovered.action", gpus[0])
    event("early.wait", early, 50)  # the XID 48 on gpus[-1], which only this set registered
    rec("free", n.nvmlEventSetFree, s)
    rec("free.early", n.nvmlEventSetFree, early)
    rec("freed.wait", n.nvmlEventSetWait_v2, s, 10)
    n.nvmlShutdown()
    return out
'''

CHILD = SCENARIO + r'''
import json, sys
import pynvml
from pathlib import Path
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.nvml import load_nvml
from gpudra_dev.localcluster import mockstate

root = Path(sys.argv[1])
INJECT = {"xid": mockstate.inject_xid, "ecc": mockstate.inject_ecc, "lost": mockstate.lose_gpu,
          "action": mockstate.set_recovery_action, "recover": mockstate.recover_gpu}
n = load_nvml("real", DriverRoot.at(str(root)))
result = scenario(n, lambda kind, *args: INJECT[kind](root, *args))
print(json.dumps(result, default=lambda v: "<" + type(v).__name__ + ">"))
'''


def _injector(root: Path) -> Any:
    from gpudra_dev.localcluster import mockstate

    table: dict[str, Callable[..., None]] = {"xid": mockstate.inject_xid, "ecc": mockstate.inject_ecc, "lost": mockstate.lose_gpu,
             "action": mockstate.set_recovery_action, "recover": mockstate.recover_gpu}
    return lambda kind, *args: table[kind](root, *args)


@pytest.fixture
def profile(tmp_path: Path) -> str:
    """The shipped MIG A100 (events on a MIG device carry its GI/CI) plus a full GPU."""
    from importlib import resources

    path = tmp_path / "a100-mig-plus-one.yaml"
    path.write_text((resources.files("gpudra_driver") / "profiles" / "a100-80gb-mig.yaml").read_text() + SECOND_GPU)
    return str(path)


def test_real_pynvml_on_the_mock_and_the_simulator_see_the_same_health(mock_lib: Path, tmp_path: Path,
                                                                      profile: str) -> None:
    real_root = make_driver_root(tmp_path / "real", profile, library=mock_lib, device_nodes=False)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(real_root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout)

    sim_root = make_driver_root(tmp_path / "sim", profile, library=mock_lib, device_nodes=False)
    namespace: dict[str, Any] = {}
    exec(SCENARIO, namespace)  # noqa: S102 - the same scenario text the child ran
    scenario: Callable[..., Any] = namespace["scenario"]
    sim = json.loads(json.dumps(
        scenario(load_nvml(f"fake:{profile}", DriverRoot.at(str(sim_root))), _injector(sim_root)),
        default=lambda v: "<" + type(v).__name__ + ">"))
    assert [k for k, _ in real] == [k for k, _ in sim]
    for (key, r), (_, s) in zip(real, sim):
        assert r == s, key

    answers = dict(real)
    gpu0 = answers["event.2"][0]
    assert answers["none"] == "!NVMLError_Timeout" and answers["drained"] == "!NVMLError_Timeout"
    assert answers["supported"] == 0xB and answers["supported.mig"] == "!NVMLError_NotSupported"
    assert answers["register.bad"] == "!NVMLError_NotSupported"
    mig_event, ecc_event, xid_event = answers["event.0"], answers["event.1"], answers["event.2"]
    assert mig_event[:3] == [gpu0, pynvml.nvmlEventTypeXidCriticalError, 94] and mig_event[3] != 0xFFFFFFFF
    assert ecc_event == [gpu0, pynvml.nvmlEventTypeDoubleBitEccError, 0, 0xFFFFFFFF, 0xFFFFFFFF]
    assert xid_event == [gpu0, pynvml.nvmlEventTypeXidCriticalError, 79, 0xFFFFFFFF, 0xFFFFFFFF]
    assert answers["action.none"] == [230, 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 0]
    assert answers["action.reset"][3] == answers["action.mig"][3] == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert {answers[k] for k in ("lost.wait", "lost.by_uuid", "lost.by_index", "lost.name", "lost.mig")} == \
        {"!NVMLError_GpuIsLost"}
    assert answers["other.name"] != "!NVMLError_GpuIsLost" and answers["recovered.uuid"] == gpu0
    assert answers["recovered.action"][3] == 0
    assert answers["freed.wait"] == "!NVMLError_InvalidArgument"
    assert answers["early.wait"][:3] == [answers["other.uuid"], pynvml.nvmlEventTypeXidCriticalError, 48]


def test_the_simulator_probe_sees_a_lost_gpu_and_the_recovery_action(mock_lib: Path, tmp_path: Path,
                                                                     profile: str) -> None:
    root = make_driver_root(tmp_path / "root", profile, library=mock_lib, device_nodes=False)
    inject = _injector(root)
    nvml = load_nvml(f"fake:{profile}", DriverRoot.at(str(root)))
    nvml.nvmlInit()
    uuids = [str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(nvml.nvmlDeviceGetCount())]
    inject("lost", uuids[0])
    inject("action", uuids[-1], 2)
    assert probe(nvml, [*uuids, "GPU-gone"]) == [
        Probe(uuids[0], lost=True), *(Probe(u, lost=False, recovery_action=0) for u in uuids[1:-1]),
        Probe(uuids[-1], lost=False, recovery_action=2), Probe("GPU-gone", lost=True)]
    nvml.nvmlShutdown()
