"""The REAL pynvml (nvidia-ml-py) against the mock libnvidia-ml.so.1 (tests/mocknvml, `make mock-nvml`)
in a fake driver root (gpudra_dev.localcluster.fakedriverroot), checked against the Python simulator.

pynvml keeps one loaded library per process (``pynvml.nvmlLib`` and a function-pointer cache), so each
scenario runs in its own interpreter, which points pynvml at the root's ``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from gpudra_driver.discovery import NvmlUnavailable, scan
from gpudra_driver.nvml import load_nvml, profile_names
from gpudra_driver.nvml.fake import MigProfileSpec, load_mig_catalog, load_profile
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback, read_mig_cap_minor
from gpudra_driver.deviceapi import device_to_api
from gpudra_dev.localcluster import fakedriverroot, mockstate
from gpudra_dev.localcluster.fakedriverroot import INVENTORY_FILE, LIB_DIR, make_driver_root, mock_nvml_library

# Runs the same calls against whatever NVML `n` is (real pynvml or the simulator) and records each
# answer, or the pynvml exception class it raised; executed in-process for the simulator and in a
# child interpreter for pynvml + the mock.
PROBE = r'''
import ctypes

def _norm(v):
    if isinstance(v, (ctypes._Pointer,)) or type(v).__name__ == "_Handle":
        return "<handle>"
    if isinstance(v, ctypes.Structure):
        return {f: _norm(getattr(v, f)) for f, _ in v._fields_}
    if isinstance(v, ctypes._SimpleCData):
        return v.value
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v

def placements(n, h, profile_id, short=False):
    """pynvml's two-call protocol: the count, then the placements into a buffer that size (one
    smaller when ``short``): [count, [[start, size], ...]] or [count, error, count after]."""
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
    wanted = count.value
    count.value = wanted - 1 if short else wanted
    buf = (n.c_nvmlGpuInstancePlacement_t * max(wanted, 1))()
    try:
        n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, buf, ctypes.byref(count))
    except n.NVMLError as e:
        return [wanted, "!" + type(e).__name__, count.value]
    return [wanted, [[p.start, p.size] for p in buf[:count.value]]]

def probe_gpu_instance_profiles(n, rec, key, h):
    """Every GPU instance profile index (and one past the last), by index (v2, v1) and by ID, with its
    placements; the error answers."""
    for index in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
        info = rec(f"{key}.gip{index}", n.nvmlDeviceGetGpuInstanceProfileInfo, h, index)
        rec(f"{key}.gip{index}.v1", n.nvmlDeviceGetGpuInstanceProfileInfo, h, index, 1)
        if info is None:
            continue
        rec(f"{key}.gip{index}.byId", n.nvmlDeviceGetGpuInstanceProfileInfoById, h, info.id)
        rec(f"{key}.gip{index}.placements", placements, n, h, info.id)
        rec(f"{key}.gip{index}.placements.short", placements, n, h, info.id, True)
    rec(f"{key}.gip.v3", n.nvmlDeviceGetGpuInstanceProfileInfo, h, 0, 3)
    rec(f"{key}.gip.byId.unknown", n.nvmlDeviceGetGpuInstanceProfileInfoById, h, 99)
    rec(f"{key}.gipp.unknown", placements, n, h, 99)
    rec(f"{key}.gipp.nullCount", n.nvmlDeviceGetGpuInstancePossiblePlacements, h, 0, None, None)

def probe(n):
    out = {}
    def rec(key, fn, *args):
        try:
            v = fn(*args)
        except n.NVMLError as e:
            out[key] = "!" + type(e).__name__
            return None
        out[key] = _norm(v)
        return v
    rec("pre.count", n.nvmlDeviceGetCount)
    rec("pre.shutdown", n.nvmlShutdown)
    rec("pre.driver", n.nvmlSystemGetDriverVersion)
    rec("init", n.nvmlInit)
    if out["init"] is not None:
        return out
    rec("init.again", n.nvmlInit)
    rec("driver", n.nvmlSystemGetDriverVersion)
    rec("cuda", n.nvmlSystemGetCudaDriverVersion_v2)
    count = rec("count", n.nvmlDeviceGetCount) or 0
    rec("handle.oob", n.nvmlDeviceGetHandleByIndex, count)
    for i in range(count):
        h = rec(f"{i}.handle", n.nvmlDeviceGetHandleByIndex, i)
        for call in ("Name", "UUID", "Brand", "Architecture", "CudaComputeCapability", "MinorNumber",
                     "MemoryInfo", "PciInfo", "NumaNodeId", "MigMode", "MaxMigDeviceCount", "Index",
                     "Attributes", "GpuInstanceId", "ComputeInstanceId", "DeviceHandleFromMigDeviceHandle",
                     "ComputeMode"):
            rec(f"{i}.{call}", getattr(n, "nvmlDeviceGet" + call), h)
        rec(f"{i}.IsMig", n.nvmlDeviceIsMigDeviceHandle, h)
        probe_gpu_instance_profiles(n, rec, str(i), h)
        # the compute mode round trip: settable modes, then refused ones, back to DEFAULT
        for mode in (3, 2, 1, 4, 0):
            rec(f"{i}.SetComputeMode.{mode}", n.nvmlDeviceSetComputeMode, h, mode)
            rec(f"{i}.SetComputeMode.{mode}.get", n.nvmlDeviceGetComputeMode, h)
        uuid = out[f"{i}.UUID"]
        if isinstance(uuid, str) and not uuid.startswith("!"):
            rec(f"{i}.byUUID.Index", lambda: n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(uuid)))
        slots = out[f"{i}.MaxMigDeviceCount"]
        for slot in range((slots if isinstance(slots, int) else 0) + 2):
            m = rec(f"{i}.mig{slot}", n.nvmlDeviceGetMigDeviceHandleByIndex, h, slot)
            if m is None:
                continue
            for call in ("Name", "UUID", "Brand", "Architecture", "CudaComputeCapability", "MinorNumber",
                         "MemoryInfo", "PciInfo", "NumaNodeId", "MigMode", "MaxMigDeviceCount", "Index",
                         "Attributes", "GpuInstanceId", "ComputeInstanceId", "ComputeMode"):
                rec(f"{i}.mig{slot}.{call}", getattr(n, "nvmlDeviceGet" + call), m)
            rec(f"{i}.mig{slot}.IsMig", n.nvmlDeviceIsMigDeviceHandle, m)
            rec(f"{i}.mig{slot}.gip0", n.nvmlDeviceGetGpuInstanceProfileInfo, m, 0)
            rec(f"{i}.mig{slot}.gipp", placements, n, m, 0)
            rec(f"{i}.mig{slot}.SetComputeMode", n.nvmlDeviceSetComputeMode, m, 3)
            mig_uuid = out[f"{i}.mig{slot}.UUID"]
            if isinstance(mig_uuid, str) and not mig_uuid.startswith("!"):
                rec(f"{i}.mig{slot}.byUUID.IsMig",
                    lambda: n.nvmlDeviceIsMigDeviceHandle(n.nvmlDeviceGetHandleByUUID(mig_uuid)))
            parent = rec(f"{i}.mig{slot}.parent", n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, m)
            if parent is not None:
                rec(f"{i}.mig{slot}.parent.UUID", n.nvmlDeviceGetUUID, parent)
            rec(f"{i}.mig{slot}.migOfMig", n.nvmlDeviceGetMigDeviceHandleByIndex, m, 0)
    rec("byUUID.unknown", n.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-00000000dead")
    rec("shutdown", n.nvmlShutdown)
    rec("shutdown.again", n.nvmlShutdown)
    rec("shutdown.extra", n.nvmlShutdown)
    rec("post.count", n.nvmlDeviceGetCount)
    return out
'''

# The child: real pynvml bound to the mock in a driver root; probe, then discovery, as JSON.
CHILD = PROBE + r'''
import json, sys
import pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
from gpudra_driver.discovery import scan
from gpudra_driver.nvml import NvmlUnavailable
from gpudra_driver.deviceapi import device_to_api
import os
result = {"probe": probe(pynvml)}
try:
    d = scan(pynvml, mig=os.environ.get("MIG_MODE", "static"))
    result["devices"] = [device_to_api(x) for x in d.devices]
    result["warnings"] = d.warnings
except NvmlUnavailable as e:
    result["error"] = str(e)
    result["cause"] = type(e.__cause__).__name__
print(json.dumps(result))
'''

_probe_ns: dict[str, Any] = {}
exec(PROBE, _probe_ns)  # noqa: S102 - the simulator side of the same probe


def _nvml_lib(root: Path) -> Path:
    return (root / LIB_DIR / "libnvidia-ml.so.1").absolute()


def run_child(root: Path, script: str = CHILD, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    child_env = {k: v for k, v in os.environ.items() if k != fakedriverroot.INVENTORY_ENV}
    child_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", script, str(_nvml_lib(root))],
        capture_output=True, text=True, timeout=60, env=child_env,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout), proc.stderr


def simulated(ref: str, mig: str = "static") -> dict[str, Any]:
    result: dict[str, Any] = {"probe": _probe_ns["probe"](load_nvml(f"fake:{ref}"))}
    try:
        d = scan(load_nvml(f"fake:{ref}"), mig=mig)  # type: ignore[arg-type]
        result["devices"] = [device_to_api(x) for x in d.devices]
        result["warnings"] = d.warnings
    except NvmlUnavailable as exc:
        result["error"] = str(exc)
        result["cause"] = type(exc.__cause__).__name__
    return result


def assert_same(real: dict[str, Any], sim: dict[str, Any]) -> None:
    assert real.keys() == sim.keys()
    for key in real["probe"].keys() | sim["probe"].keys():
        assert real["probe"].get(key, "<missing>") == sim["probe"].get(key, "<missing>"), key
    assert real == sim


# -- the shipped profiles, and every answer the simulator gives ------------------------------------


@pytest.mark.parametrize("name", profile_names())
def test_real_pynvml_on_mock_equals_simulator(name: str, mock_lib: Path, tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", name, library=mock_lib, device_nodes=False)
    mig = "dynamic" if name == "h100-dynamic-mig" else "static"  # MIG enabled, no MIG devices: dynamic MIG's
    real, _ = run_child(root, env={"MIG_MODE": mig})
    sim = simulated(name, mig)
    assert real["devices"], "the profile discovers no devices"
    assert_same(real, sim)


EDGE_PROFILE = {
    "description": "edge cases: faults, empty MIG slots, pending MIG mode, no NUMA, no MIG",
    "driverVersion": "550.54.15",
    "cudaDriverVersion": 12040,
    "defaults": {
        "name": "NVIDIA A100-SXM4-40GB", "brand": "NVIDIA", "architecture": "AMPERE",
        "cudaComputeCapability": "8.0", "memoryMiB": 40960, "pciDeviceId": 0x20B010DE, "migCapable": True,
        "maxMigDevices": 7,
    },
    "gpus": [
        {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "busId": "00000000:07:00.0", "numaNode": 0,
         "fail": True},
        {"uuid": "GPU-11111111-1111-1111-1111-111111111111", "busId": "00000000:0F:00.0", "numaNode": 1,
         "fail": {"nvmlDeviceGetMemoryInfo": "GpuIsLost"}},
        {"uuid": "GPU-22222222-2222-2222-2222-222222222222", "busId": "00000000:47:00.0", "numaNode": None,
         "migMode": "enabled", "memoryUsedMiB": 512, "pciSubSystemId": 0x145F10DE,
         "migDevices": [
             {"uuid": "MIG-aaaaaaaa-0000-0000-0000-000000000000", "profile": "3g.20gb", "gpuInstanceId": 2,
              "computeInstanceId": 0, "slot": 0,
              "attributes": {"multiprocessorCount": 42, "sharedCopyEngineCount": 3, "sharedDecoderCount": 2,
                             "gpuInstanceSliceCount": 3, "computeInstanceSliceCount": 3, "memorySizeMB": 19968}},
             {"uuid": "MIG-bbbbbbbb-0000-0000-0000-000000000000", "profile": "1c.3g.20gb", "gpuInstanceId": 1,
              "computeInstanceId": 1, "slot": 3,
              "attributes": {"multiprocessorCount": 14, "sharedCopyEngineCount": 3, "sharedDecoderCount": 2,
                             "gpuInstanceSliceCount": 3, "computeInstanceSliceCount": 1, "memorySizeMB": 19968}},
             {"uuid": "MIG-cccccccc-0000-0000-0000-000000000000", "profile": "1g.5gb", "gpuInstanceId": 9,
              "computeInstanceId": 0, "slot": 5, "fail": {"nvmlDeviceGetAttributes": "Unknown"},
              "attributes": {"multiprocessorCount": 14, "sharedCopyEngineCount": 1,
                             "gpuInstanceSliceCount": 1, "computeInstanceSliceCount": 1, "memorySizeMB": 4864}},
         ]},
        {"uuid": "GPU-33333333-3333-3333-3333-333333333333", "busId": "00000000:4E:00.0",
         "migMode": "disabled", "migModePending": "enabled"},
        {"uuid": "GPU-44444444-4444-4444-4444-444444444444", "busId": "00000000:87:00.0", "minor": 7,
         "migMode": "enabled"},
        {"uuid": "GPU-55555555-5555-5555-5555-555555555555", "busId": "0000000A:90:00.1", "migCapable": False,
         "name": "NVIDIA L4", "architecture": "ADA", "cudaComputeCapability": "8.9", "brand": "GEFORCE_RTX"},
    ],
}


def test_edge_cases_equal_simulator(mock_lib: Path, tmp_path: Path) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(EDGE_PROFILE))
    root = make_driver_root(tmp_path / "root", str(path), library=mock_lib, device_nodes=False)
    real, _ = run_child(root)
    sim = simulated(str(path))
    assert_same(real, sim)
    # the edge cases are really there
    assert any("GPU 0 skipped: nvmlDeviceGetUUID failed" in w for w in real["warnings"])
    assert any("GPU 1 skipped: nvmlDeviceGetMemoryInfo failed: GPU is lost" in w for w in real["warnings"])
    assert any("MIG device 5 on GPU 2 skipped" in w for w in real["warnings"])
    assert any("MIG mode change pending" in w for w in real["warnings"])
    assert any("GPU 4" in w and "no MIG devices" in w for w in real["warnings"])
    assert real["probe"]["2.mig1"] == "!NVMLError_NotFound"  # empty slot
    assert real["probe"]["2.mig8"] == "!NVMLError_InvalidArgument"  # past the max
    assert real["probe"]["3.mig0"] == "!NVMLError_NotFound"  # MIG disabled
    assert real["probe"]["5.MigMode"] == "!NVMLError_NotSupported"  # not MIG capable
    assert real["probe"]["2.Attributes"] == "!NVMLError_NotSupported"
    assert real["probe"]["2.GpuInstanceId"] == "!NVMLError_InvalidArgument"
    assert real["probe"]["2.mig0.MinorNumber"] == "!NVMLError_NotSupported"
    assert real["probe"]["pre.count"] == "!NVMLError_Uninitialized"
    assert real["probe"]["shutdown.extra"] == "!NVMLError_Uninitialized"
    # the compute mode: set and read back through the root's shared state, refused values, MIG handles
    assert [real["probe"][f"2.SetComputeMode.{m}.get"] for m in (3, 2, 1, 4, 0)] == [3, 2, 2, 2, 0]
    assert real["probe"]["2.SetComputeMode.1"] == real["probe"]["2.SetComputeMode.4"] == "!NVMLError_InvalidArgument"
    assert real["probe"]["2.mig0.SetComputeMode"] == real["probe"]["2.mig0.ComputeMode"] == "!NVMLError_NotSupported"
    assert real["probe"]["2.mig0.byUUID.IsMig"] == 1 and real["probe"]["2.byUUID.Index"] == 2
    assert mockstate.calls(root) == [f"nvml SetComputeMode {gpu['uuid']} {mode}"
                                     for gpu in EDGE_PROFILE["gpus"] for mode in (3, 2, 0)]
    # GPU instance profiles without a MIG catalog: derived from the MIG devices (ID = the index), no
    # placements; none on a GPU without MIG support
    probe = real["probe"]
    assert probe["2.gip2.v1"] == {
        "id": 2, "isP2pSupported": 0, "sliceCount": 3, "instanceCount": 2, "multiprocessorCount": 42,
        "copyEngineCount": 3, "decoderCount": 2, "encoderCount": 0, "jpegCount": 0, "ofaCount": 0,
        "memorySizeMB": 19968,
    }
    assert probe["2.gip2"]["name"] == "MIG 3g.20gb" and probe["2.gip2.byId"] == probe["2.gip2"]
    assert probe["2.gip0"]["id"] == 0 and probe["2.gip0"]["memorySizeMB"] == 4864
    assert probe["2.gip2.placements"] == probe["2.gip4"] == probe["2.gip7"] == "!NVMLError_NotSupported"
    assert probe["2.gip18"] == "!NVMLError_InvalidArgument"
    assert probe["3.gip0"] == probe["5.gip0"] == probe["5.gipp.unknown"] == "!NVMLError_NotSupported"


# -- GPU instance profiles from a MIG catalog ------------------------------------------------------


def profile_info_v1(spec: MigProfileSpec) -> dict[str, Any]:
    """What pynvml's c_nvmlGpuInstanceProfileInfo_t holds for a catalog profile."""
    return {
        "id": spec.id, "isP2pSupported": 0, "sliceCount": spec.slices, "instanceCount": spec.instances,
        "multiprocessorCount": spec.multiprocessors, "copyEngineCount": spec.copy_engines,
        "decoderCount": spec.decoders, "encoderCount": spec.encoders, "jpegCount": spec.jpeg,
        "ofaCount": spec.ofa, "memorySizeMB": spec.memory_mib,
    }


@pytest.mark.parametrize(("name", "model"),
                         [("a100-80gb-mig", "a100-sxm4-80gb"), ("h100-dynamic-mig", "h100-sxm5-80gb")])
def test_gpu_instance_profiles_from_the_catalog(name: str, model: str, mock_lib: Path, tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", name, library=mock_lib, device_nodes=False)
    real, _ = run_child(root)
    assert_same(real, simulated(name))
    catalog = load_mig_catalog(model)
    profile = load_profile(name)
    assert all(gpu.mig_catalog == catalog for gpu in profile.gpus)
    probe = real["probe"]
    for gpu in range(len(profile.gpus)):
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
            key, spec = f"{gpu}.gip{index}", catalog.by_index(index)
            if index == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
                assert probe[key] == probe[f"{key}.v1"] == "!NVMLError_InvalidArgument"
            elif spec is None:
                assert probe[key] == probe[f"{key}.v1"] == "!NVMLError_NotSupported"
            else:
                v1 = profile_info_v1(spec)
                assert probe[f"{key}.v1"] == v1
                assert probe[key] == probe[f"{key}.byId"] == {
                    "version": pynvml.nvmlGpuInstanceProfileInfo_v2, **v1, "name": f"MIG {spec.name}"}
                # NVML's two-call protocol: every possible placement, whatever GPU instances exist
                starts = [[start, spec.placement_size] for start in spec.placement_starts]
                assert probe[f"{key}.placements"] == [len(starts), starts]
                assert probe[f"{key}.placements.short"] == [len(starts), "!NVMLError_InsufficientSize", len(starts)]
        assert probe[f"{gpu}.gip.v3"] == "!NVMLError_FunctionNotFound"  # pynvml has no version 3
        assert probe[f"{gpu}.gip.byId.unknown"] == "!NVMLError_InvalidArgument"
        assert probe[f"{gpu}.gipp.unknown"] == probe[f"{gpu}.gipp.nullCount"] == "!NVMLError_InvalidArgument"
    migs = [k for k in probe if k.endswith((".gip0", ".gipp")) and ".mig" in k]
    assert len(migs) == 2 * sum(len(g.migs) for g in profile.gpus)
    assert all(probe[k] == "!NVMLError_NotSupported" for k in migs)  # a MIG handle has no profiles


# The inventory lines a catalog becomes, checked as strictly as the others: nvmlInit refuses a bad one.
INIT_ONLY = r'''
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1])
codes = []
for path in sys.argv[2:]:
    os.environ["GPUDRA_MOCK_NVML_INVENTORY"] = path
    codes.append(lib.nvmlInit_v2())
    if codes[-1] == 0:
        lib.nvmlShutdown()
print(json.dumps(codes))
'''

GOOD_PROFILE = "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6"


@pytest.mark.parametrize(
    "bad",
    [
        "migProfile 18 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6",  # index >= PROFILE_COUNT
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6\n" + GOOD_PROFILE,  # index twice
        "migProfile 0 20 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6",  # ID 20 twice
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 2 0,1,2,3,4,5,7",  # 7+2 past 8 memory slices
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,9",  # start past the slices
        "migProfile 0 19 1 8 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6",  # more instances than placements
        "migProfile 0 19 8 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,4,5,6",  # more slices than the GPU's 7
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,3,3,5,6",  # a start twice
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1,2,",  # trailing comma
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,,1",  # empty start
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1",  # no placements
        "migProfile 0 19 1 7 16 1 1 0 1 0 9984 1g.10gb 1 0,1 extra",  # a field too many
        "migProfile 0 19 1 7 16 1 1 0 1 9984 1g.10gb 1 0,1,2,3,4,5,6",  # a field too few
        "migCatalog h100-sxm5-80gb 8 7",  # a second catalog
    ],
)
def test_inventory_catalog_lines_are_strict(bad: str, mock_lib: Path, tmp_path: Path) -> None:
    text = fakedriverroot.inventory_text(load_profile("h100-dynamic-mig"))
    assert GOOD_PROFILE + "\n" in text and text.count("migCatalog ") == 2
    good, broken = tmp_path / "good.inventory", tmp_path / "bad.inventory"
    good.write_text(text)
    first_gpu = text.index(GOOD_PROFILE)
    broken.write_text(text[:first_gpu] + bad + text[first_gpu + len(GOOD_PROFILE):])
    # a migProfile before any migCatalog, and one after a `mig` line, are refused too
    early = tmp_path / "early.inventory"
    early.write_text(text.replace("migCatalog h100-sxm5-80gb 8 7\n", "", 1))
    proc = subprocess.run([sys.executable, "-c", INIT_ONLY, str(mock_lib), str(good), str(broken), str(early)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_UNKNOWN]
    assert f"{broken} line" in proc.stderr and "cannot parse it" in proc.stderr


def test_catalog_lines_after_a_mig_device_are_refused(mock_lib: Path, tmp_path: Path) -> None:
    text = fakedriverroot.inventory_text(load_profile("a100-80gb-mig"))
    line = next(x for x in text.splitlines() if x.startswith("migProfile 4 "))
    late = tmp_path / "late.inventory"
    late.write_text(text.replace(line + "\n", "") + line + "\n")  # into the last MIG device
    proc = subprocess.run([sys.executable, "-c", INIT_ONLY, str(mock_lib), str(late)],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout) == [pynvml.NVML_ERROR_UNKNOWN], proc.stderr


# -- nvmlInit failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("init_error", "hint"),
    [
        ("DriverNotLoaded", "the NVIDIA kernel driver is not loaded"),
        ("NoPermission", "no permission to open /dev/nvidia*"),
        ("LibRmVersionMismatch", "the NVML library and the kernel driver have different versions"),
    ],
)
def test_init_error(init_error: str, hint: str, mock_lib: Path, tmp_path: Path) -> None:
    doc = yaml.safe_load((resources.files("gpudra_driver") / "profiles" / "l4x2.yaml").read_text())
    doc["initError"] = init_error
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    root = make_driver_root(tmp_path / "root", str(path), library=mock_lib, device_nodes=False)
    real, _ = run_child(root)
    assert real["cause"] == f"NVMLError_{init_error}"
    assert hint in real["error"]
    sim = simulated(str(path))
    # The messages may differ in detail (the real binding can say more about the host), not in kind.
    assert (real["probe"], real["cause"]) == (sim["probe"], sim["cause"])
    assert real["probe"]["init"] == f"!NVMLError_{init_error}"


def test_missing_inventory_is_driver_not_loaded(mock_lib: Path, tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "l4x2", library=mock_lib, device_nodes=False, extras=False)
    inventory = root / LIB_DIR / INVENTORY_FILE
    inventory.unlink()
    real, stderr = run_child(root)
    assert real["cause"] == "NVMLError_DriverNotLoaded"
    assert "the NVIDIA kernel driver is not loaded" in real["error"]
    assert str(inventory) in stderr


def test_inventory_from_env(mock_lib: Path, tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "l4x2", library=mock_lib, device_nodes=False, extras=False)
    other = fakedriverroot.write_inventory(tmp_path / "h200.inventory", "h200")
    real, _ = run_child(root, env={fakedriverroot.INVENTORY_ENV: str(other)})
    assert real == simulated("h200")


# -- what only the real binding can ask ------------------------------------------------------------

DIRECT = r'''
import ctypes, json, sys
import pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
out = {}
def rec(key, fn, *args):
    try:
        v = fn(*args)
    except pynvml.NVMLError as e:
        out[key] = "!" + type(e).__name__
        return None
    out[key] = v.value if isinstance(v, ctypes._SimpleCData) else v
    return v
rec("pre.GetCount", pynvml.nvmlDeviceGetCount)
rec("pre.HandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, 0)
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
rec("serial", pynvml.nvmlDeviceGetSerial, h)
rec("temperature", pynvml.nvmlDeviceGetTemperature, h, 0)
rec("gi.byId.unknown", pynvml.nvmlDeviceGetGpuInstanceById, h, 5)
gi = pynvml.nvmlDeviceGetGpuInstanceById(h, 2)
info = pynvml.nvmlGpuInstanceGetInfo(gi)
out["gi.info"] = [info.id, info.profileId, info.placement.size]
ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
rec("ci.byId.unknown", pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, 3)
gp = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 1)
out["gi.profile"] = [gp.id, gp.sliceCount, gp.memorySizeMB]
rec("gi.profile.7g", lambda: pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE).id)
class InfoV3(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_v3_t, which pynvml does not define
    _fields_ = [(f, ctypes.c_uint) for f in ("version", "id", "sliceCount", "instanceCount", "multiprocessorCount",
                "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount")] + [
               ("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96), ("capabilities", ctypes.c_uint)]
def profile_v(fn, arg, version, struct=pynvml.c_nvmlGpuInstanceProfileInfo_v2_t):
    info = struct()
    info.version = version
    pynvml._nvmlCheckReturn(getattr(pynvml.nvmlLib, fn)(h, ctypes.c_uint(arg), ctypes.byref(info)))
    name = info.name.decode() if isinstance(info.name, bytes) else info.name
    return [info.version, info.id, info.sliceCount, info.memorySizeMB, name, getattr(info, "capabilities", None)]
v3 = (3 << 24) | ctypes.sizeof(InfoV3)
rec("gi.profileV.v3", profile_v, "nvmlDeviceGetGpuInstanceProfileInfoV", 2, v3, InfoV3)
rec("gi.profileV.badVersion", profile_v, "nvmlDeviceGetGpuInstanceProfileInfoV", 2, (1 << 24) | 0x98)
v2 = pynvml.nvmlGpuInstanceProfileInfo_v2
rec("gi.profileV.oldSize", profile_v, "nvmlDeviceGetGpuInstanceProfileInfoV", 2, v2 - 8)
rec("gi.profileById.v3", profile_v, "nvmlDeviceGetGpuInstanceProfileInfoByIdV", gp.id, v3, InfoV3)
rec("gi.profileById.badVersion", profile_v, "nvmlDeviceGetGpuInstanceProfileInfoByIdV", gp.id, 0)
out["infoV3.size"] = ctypes.sizeof(InfoV3)
cp = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0, 1)
out["ci.profile"] = [cp.id, cp.sliceCount, cp.multiprocessorCount]
rec("nvmlVersion", pynvml.nvmlSystemGetNVMLVersion)
rec("errorString", pynvml.nvmlErrorString, pynvml.NVML_ERROR_GPU_IS_LOST)
rec("byUuid", lambda: pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(sys.argv[2])))
rec("byMigUuid", lambda: pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(m))))
rec("byUuid.unknown", pynvml.nvmlDeviceGetHandleByUUID, "GPU-nope")
rec("byBus", lambda: pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByPciBusId("0000:07:00.0")))
rec("byBus.unknown", pynvml.nvmlDeviceGetHandleByPciBusId, "00000000:99:00.0")
mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
out["memory_v2"] = [mem.version, mem.total, mem.reserved, mem.free, mem.used]
rec("memory_v2.badVersion", pynvml.nvmlDeviceGetMemoryInfo, h, 1)
pci = pynvml.nvmlDeviceGetPciInfo(h)
text = lambda v: v.decode() if isinstance(v, bytes) else v
out["pci"] = [text(pci.busIdLegacy), text(pci.busId), pci.domain, pci.bus, pci.device, pci.pciDeviceId]
def small(fn, size, *args):
    buf = ctypes.create_string_buffer(size)
    return pynvml._nvmlCheckReturn(getattr(pynvml.nvmlLib, fn)(*args, buf, ctypes.c_uint(size))) or buf.value.decode()
rec("uuid.small", small, "nvmlDeviceGetUUID", 10, h)
rec("uuid.exact", small, "nvmlDeviceGetUUID", len(sys.argv[2]) + 1, h)
rec("uuid.oneShort", small, "nvmlDeviceGetUUID", len(sys.argv[2]), h)
rec("name.small", small, "nvmlDeviceGetName", 8, m)
rec("driver.small", small, "nvmlSystemGetDriverVersion", 4)
rec("badHandle", pynvml.nvmlDeviceGetUUID, ctypes.cast(ctypes.c_void_p(16), pynvml.c_nvmlDevice_t))
rec("nullHandle", pynvml.nvmlDeviceGetUUID, pynvml.c_nvmlDevice_t())
pynvml.nvmlShutdown()
rec("after.HandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, 0)
pynvml.nvmlInit()  # handles stay valid across shutdown and init
rec("again.uuid", pynvml.nvmlDeviceGetUUID, h)
pynvml.nvmlShutdown()
print(json.dumps(out))
'''


@pytest.mark.parametrize("catalog", [True, False], ids=["catalog", "derived"])
def test_direct_calls(catalog: bool, mock_lib: Path, tmp_path: Path) -> None:
    prof = load_profile("a100-80gb-mig")
    if not catalog:  # a static-MIG GPU without a catalog: profiles derived from its MIG devices
        prof = dataclasses.replace(prof, gpus=tuple(dataclasses.replace(g, mig_catalog=None) for g in prof.gpus))
    gpu = prof.gpus[0]
    root = make_driver_root(tmp_path / "root", prof, library=mock_lib, device_nodes=False, extras=False)
    proc = subprocess.run(
        [sys.executable, "-c", DIRECT, str(_nvml_lib(root)), gpu.uuid],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    mib = 1024 * 1024
    v3 = 0x03000098
    # the 3g.40gb GPU instance: catalog ID 9 and a 4-memory-slice placement, or the index and its slices
    gi_id, size = (9, 4) if catalog else (pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 3)
    assert out == {
        "pre.GetCount": "!NVMLError_Uninitialized",
        "pre.HandleByIndex": "!NVMLError_Uninitialized",
        "serial": "!NVMLError_NotSupported",
        "temperature": "!NVMLError_NotSupported",
        "gi.byId.unknown": "!NVMLError_NotFound",
        "gi.info": [2, gi_id, size],
        "ci.byId.unknown": "!NVMLError_NotFound",
        "gi.profile": [gi_id, 3, 40192],
        "gi.profile.7g": 0 if catalog else "!NVMLError_NotSupported",  # unused: unknown without a catalog
        "infoV3.size": 0x98,
        "gi.profileV.v3": [v3, gi_id, 3, 40192, "MIG 3g.40gb", 0],
        "gi.profileById.v3": [v3, gi_id, 3, 40192, "MIG 3g.40gb", 0],
        "gi.profileV.badVersion": "!NVMLError_ArgumentVersionMismatch",
        "gi.profileV.oldSize": "!NVMLError_ArgumentVersionMismatch",
        "gi.profileById.badVersion": "!NVMLError_ArgumentVersionMismatch",
        "ci.profile": [pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 3, 42],
        "nvmlVersion": "12.570.133.20",
        "errorString": "GPU is lost",
        "byUuid": gpu.uuid,
        "byMigUuid": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        "byUuid.unknown": "!NVMLError_NotFound",
        "byBus": gpu.uuid,
        "byBus.unknown": "!NVMLError_NotFound",
        "memory_v2": [pynvml.nvmlMemory_v2, 81920 * mib, 0, 81920 * mib, 0],
        "memory_v2.badVersion": "!NVMLError_ArgumentVersionMismatch",
        "pci": ["0000:07:00.0", "00000000:07:00.0", 0, 7, 0, 0x20B210DE],
        "uuid.small": "!NVMLError_InsufficientSize",
        "uuid.exact": gpu.uuid,
        "uuid.oneShort": "!NVMLError_InsufficientSize",
        "name.small": "!NVMLError_InsufficientSize",
        "driver.small": "!NVMLError_InsufficientSize",
        "badHandle": "!NVMLError_InvalidArgument",
        "nullHandle": "!NVMLError_InvalidArgument",
        "after.HandleByIndex": "!NVMLError_Uninitialized",
        "again.uuid": gpu.uuid,
    }


def test_exports(mock_lib: Path) -> None:
    """The entry points pynvml-based discovery and nvidia-ctk (go-nvml) call are all there."""
    lib = ctypes.CDLL(str(mock_lib))
    for symbol in (
        "nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString",
        "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
        "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetBrand", "nvmlDeviceGetArchitecture",
        "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetAttributes_v2", "nvmlDeviceGetComputeMode",
        "nvmlDeviceSetComputeMode", "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV",
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV", "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        "nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo",
    ):
        assert hasattr(lib, symbol), symbol
    soname = subprocess.run(["readelf", "-d", str(mock_lib)], capture_output=True, text=True).stdout
    assert "[libnvidia-ml.so.1]" in soname


def test_library_missing_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(fakedriverroot.MOCK_NVML_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(RuntimeError, match="make mock-nvml"):
        mock_nvml_library()


# -- the driver root's layout ----------------------------------------------------------------------


def _assert_inside(root: Path, link: Path, target: str) -> None:
    assert link.is_symlink(), link
    value = os.readlink(link)
    assert value == target and not os.path.isabs(value), (link, value)
    assert (link.parent / value).resolve().is_relative_to(root.resolve())


def _assert_chr(path: Path, major: int, minor: int) -> None:
    st = path.lstat()
    assert stat.S_ISCHR(st.st_mode), path
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), path


def test_driver_root_layout(mock_lib: Path, tmp_path: Path) -> None:
    prof = load_profile("a100-80gb-mig")
    ver = prof.driver_version
    root = tmp_path / "root"
    assert make_driver_root(root, prof, library=mock_lib) == root
    make_driver_root(root, prof, library=mock_lib)  # twice on the same root is fine
    lib = root / LIB_DIR
    ml = lib / f"libnvidia-ml.so.{ver}"
    assert ml.is_file() and not ml.is_symlink()
    assert ml.read_bytes() == mock_lib.read_bytes()
    _assert_inside(root, lib / "libnvidia-ml.so.1", f"libnvidia-ml.so.{ver}")
    assert "driverVersion 570.133.20" in (lib / INVENTORY_FILE).read_text()
    for name, soname in [
        ("libcuda", "1"), ("libnvidia-ptxjitcompiler", "1"), ("libnvidia-nvvm", "4"), ("libnvidia-cfg", "1"),
        ("libnvidia-opencl", "1"), ("libnvidia-allocator", "1"), ("libnvidia-gpucomp", "1"),
    ]:
        real = lib / f"{name}.so.{ver}"
        assert real.is_file() and not real.is_symlink() and real.read_bytes()[:4] == b"\x7fELF"
        _assert_inside(root, lib / f"{name}.so.{soname}", real.name)
    _assert_inside(root, lib / "libcuda.so", "libcuda.so.1")
    for tool in ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
                 "nvidia-cuda-mps-server"):
        assert os.access(root / "usr/bin" / tool, os.X_OK), tool
    for blob in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert (root / "lib/firmware/nvidia" / ver / blob).is_file()
    for path in root.rglob("*"):
        if path.is_symlink():
            assert (path.parent / os.readlink(path)).resolve().is_relative_to(root.resolve()), path

    dev = root / "dev"
    _assert_chr(dev / "nvidia0", 195, 0)
    _assert_chr(dev / "nvidiactl", 195, 255)
    _assert_chr(dev / "nvidia-modeset", 195, 254)
    _assert_chr(dev / "nvidia-uvm", fakedriverroot.UVM_MAJOR, 0)
    _assert_chr(dev / "nvidia-uvm-tools", fakedriverroot.UVM_MAJOR, 1)
    expected = set()
    for mig in prof.gpus[0].migs.values():
        for ci in (None, mig.compute_instance_id):
            minor = mig_cap_minor_fallback(0, mig.gpu_instance_id, ci)
            _assert_chr(dev / "nvidia-caps" / f"nvidia-cap{minor}", fakedriverroot.CAPS_MAJOR, minor)
            expected.add(f"nvidia-cap{minor}")
    assert expected == {
        "nvidia-cap21", "nvidia-cap22", "nvidia-cap84", "nvidia-cap85", "nvidia-cap93", "nvidia-cap94",
    }
    # and every GPU and compute instance the simulators can create (dynamic MIG): GIs 0-13 of the
    # A100's placements, each with its compute instances 0 .. its most compute slices - 1
    instances = fakedriverroot.mig_instances(prof.gpus[0])
    assert sorted(instances) == list(range(14)) and instances[0] == set(range(7)) and instances[13] == {0}
    creatable = {f"nvidia-cap{mig_cap_minor_fallback(0, gi, ci)}"
                 for gi, cis in instances.items() for ci in (None, *cis)}
    assert expected < creatable == {p.name for p in (dev / "nvidia-caps").iterdir()}
    caps = root / "proc/driver/nvidia/capabilities/gpu0/mig"
    assert (caps / "gi2/access").read_text().splitlines()[0] == "DeviceFileMinor: 21"
    assert (caps / "gi2/ci0/access").read_text().startswith("DeviceFileMinor: 22\n")
    assert read_mig_cap_minor(root / "proc")(0, 13, 0) == mig_cap_minor_fallback(0, 13, 0)
    assert {p.parent.relative_to(caps).as_posix() for p in caps.rglob("access")} == {
        f"gi{gi}" + (f"/ci{ci}" if ci is not None else "") for gi, cis in instances.items() for ci in (None, *cis)}

    minors = (root / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert minors[:3] == ["config 1", "monitor 2", "gpu0/gi0/access 3"] and "gpu0/gi2/ci0/access 22" in minors

    # the root works on its own: discovery through real pynvml reads its inventory
    real, _ = run_child(root)
    assert [d["name"] for d in real["devices"]] == [
        d["name"] for d in simulated("a100-80gb-mig")["devices"]
    ]


def test_driver_root_options(mock_lib: Path, tmp_path: Path) -> None:
    dgx = load_profile("dgx-h100")
    root = make_driver_root(tmp_path / "plain", dgx, library=mock_lib, extras=False, mig_caps=False)
    assert sorted(p.name for p in (root / "dev").iterdir() if p.name.startswith("nvidia") and p.name[6:].isdigit()) \
        == [f"nvidia{g.minor}" for g in dgx.gpus]
    assert not (root / "dev/nvidia-caps").exists()
    assert not list((root / LIB_DIR).glob("libcuda*"))
    nodev = make_driver_root(tmp_path / "nodev", "a100-80gb-mig", library=mock_lib, device_nodes=False)
    assert not (nodev / "dev").exists()
