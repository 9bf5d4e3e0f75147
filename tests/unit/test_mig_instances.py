"""Dynamic MIG: creating and destroying GPU and compute instances, the same through the REAL pynvml on
the mock libnvidia-ml.so.1 (tests/mocknvml, `make mock-nvml`) and through the Python simulator
(gpudra_driver.nvml.fake), both keeping them in the fake driver root's state directory.

Every scenario runs in child interpreters (pynvml keeps one library per process, and persistence is
about other processes): the same script, once per backend, each answer recorded as a value or the
pynvml exception class name; the two backends must agree, and the answers must be NVML's.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from gpudra_driver.nvml.fake import (
    FakeNvml,
    creatable_instances,
    load_mig_catalog,
    load_profile,
    mig_uuid,
    tree_gpu_instance_id,
)
from gpudra_dev.localcluster import fakedriverroot, mockstate
from gpudra_dev.localcluster.fakedriverroot import LIB_DIR, make_driver_root

BACKENDS = ("mock", "fake")

# The child: NVML `n` is pynvml on the root's mock library, or the simulator on the same profile and
# state directory; then the named scenario's answers as JSON.
CHILD = r'''
import ctypes, json, sys
from pathlib import Path
backend, root, profile, step = sys.argv[1:5]
if backend == "mock":
    import pynvml as n
    n.nvmlLib = ctypes.CDLL(str(Path(root) / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"))
else:
    from gpudra_driver.nvml.fake import FakeNvml, load_profile
    n = FakeNvml(load_profile(profile), Path(root) / "run/gpudra-mock")
out = {}

def rec(key, fn, *args):
    try:
        v = fn(*args)
    except n.NVMLError as e:
        out[key] = "!" + type(e).__name__
        return None
    out[key] = norm(v)
    return v

def norm(v):
    if v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, ctypes._SimpleCData):
        return v.value
    if isinstance(v, (list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {str(k): norm(x) for k, x in v.items()}
    if isinstance(v, ctypes._Pointer) or type(v).__name__ == "_Handle":
        return "<handle>"
    fields = [f for f, _ in v._fields_] if isinstance(v, ctypes.Structure) else list(v.__dataclass_fields__)
    return {f: norm(getattr(v, f)) for f in fields}

def placement(start, size):
    return ctypes.byref(n.c_nvmlGpuInstancePlacement_t(start=start, size=size))

def create(key, h, profile_id, start, size):
    gi = rec(key, n.nvmlDeviceCreateGpuInstanceWithPlacement, h, profile_id, placement(start, size))
    if gi is not None:
        rec(key + ".info", n.nvmlGpuInstanceGetInfo, gi)
    return gi

def placements(h, profile_id):
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
    buf = (n.c_nvmlGpuInstancePlacement_t * count.value)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, buf, ctypes.byref(count))
    return [(p.start, p.size) for p in buf]

def gpu_instances(h, profile_id):
    count = ctypes.c_uint(0)
    buf = (n.c_nvmlGpuInstance_t * 8)()
    n.nvmlDeviceGetGpuInstances(h, profile_id, buf, ctypes.byref(count))
    return [n.nvmlGpuInstanceGetInfo(buf[i]).id for i in range(count.value)]

def compute_instances(gi, profile_id):
    count = ctypes.c_uint(0)
    buf = (n.c_nvmlComputeInstance_t * 8)()
    n.nvmlGpuInstanceGetComputeInstances(gi, profile_id, buf, ctypes.byref(count))
    return [n.nvmlComputeInstanceGetInfo(buf[i]).id for i in range(count.value)]

def mig_devices(h):
    """What discovery reads of the MIG device in each slot (or the error), by slot."""
    devices = []
    for slot in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
        except n.NVMLError as e:
            devices.append("!" + type(e).__name__)
            continue
        uuid = n.nvmlDeviceGetUUID(m)
        devices.append({
            "uuid": norm(uuid), "name": norm(n.nvmlDeviceGetName(m)), "gi": n.nvmlDeviceGetGpuInstanceId(m),
            "ci": n.nvmlDeviceGetComputeInstanceId(m), "attributes": norm(n.nvmlDeviceGetAttributes(m)),
            "memory": n.nvmlDeviceGetMemoryInfo(m).total, "isMig": norm(n.nvmlDeviceIsMigDeviceHandle(m)),
            "parent": norm(n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m))),
            "byUuid": n.nvmlDeviceGetGpuInstanceId(n.nvmlDeviceGetHandleByUUID(uuid)),
        })
    return devices

n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
exec(compile(open(sys.argv[5]).read(), "scenario", "exec"))
n.nvmlShutdown()
print(json.dumps(out))
'''

# -- the scenarios (each runs with `n`, `h` = GPU 0, `rec`, `out` and the helpers above) ----------------

EVERY_PLACEMENT = r'''
for index in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
    try:
        info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
    except n.NVMLError:
        continue
    for start, size in placements(h, info.id):
        gi = create(f"{info.id}@{start}", h, info.id, start, size)
        rec(f"{info.id}@{start}.destroy", n.nvmlGpuInstanceDestroy, gi)
        rec(f"{info.id}@{start}.gone", n.nvmlGpuInstanceGetInfo, gi)
'''

LAYOUT = r'''
g4 = create("4g@0", h, 5, 0, 4)
g2 = create("2g@4", h, 14, 4, 2)
g1 = create("1g@6", h, 19, 6, 1)
create("1g@0.overlap", h, 19, 0, 1)           # inside the 4g
create("1g@5.overlap", h, 19, 5, 1)           # inside the 2g
create("3g@2.notListed", h, 9, 2, 4)          # 3g.40gb starts at 0 or 4
create("3g@0.wrongSize", h, 9, 0, 2)
create("unknownProfile", h, 99, 0, 1)
rec("nullPlacement", n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, None)
rec("1g.next", n.nvmlDeviceCreateGpuInstance, h, 19)   # memory slice 7 is free, but no 1g placement is there
rec("instances.4g", gpu_instances, h, 5)
rec("instances.1g", gpu_instances, h, 19)
rec("instances.unknown", gpu_instances, h, 99)
rec("byId.4g", lambda: n.nvmlGpuInstanceGetInfo(n.nvmlDeviceGetGpuInstanceById(h, 1)))
rec("byId.unknown", n.nvmlDeviceGetGpuInstanceById, h, 2)
# the full-size compute instance of the 4g: its profile, then create it
rec("ciProfile.v2", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 0)
rec("ciProfile.v1", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 0, 1)
rec("ciProfile.smaller", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
rec("ciProfile.pastCount", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT, 0)
rec("ciProfile.engine1", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 1)
rec("migs.none", mig_devices, h)
c4 = rec("ci4", n.nvmlGpuInstanceCreateComputeInstance, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE)
rec("ci4.info", n.nvmlComputeInstanceGetInfo, c4)
rec("ci4.info.gi", lambda: n.nvmlGpuInstanceGetInfo(n.nvmlComputeInstanceGetInfo(c4).gpuInstance).id)
rec("ci4.again", n.nvmlGpuInstanceCreateComputeInstance, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE)
rec("ci4.smaller", n.nvmlGpuInstanceCreateComputeInstance, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
rec("ci4.pastCount", n.nvmlGpuInstanceCreateComputeInstance, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
rec("ci4.byId", lambda: n.nvmlComputeInstanceGetInfo(n.nvmlGpuInstanceGetComputeInstanceById(g4, 0)).id)
rec("ci4.byId.unknown", n.nvmlGpuInstanceGetComputeInstanceById, g4, 1)
rec("ci4.list", compute_instances, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE)
rec("ci4.list.smaller", compute_instances, g4, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
rec("migs.one", mig_devices, h)
rec("destroy.4g.inUse", n.nvmlGpuInstanceDestroy, g4)
c2 = rec("ci2", n.nvmlGpuInstanceCreateComputeInstance, g2, n.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
c1 = rec("ci1", n.nvmlGpuInstanceCreateComputeInstance, g1, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
rec("migs.three", mig_devices, h)
m0 = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
rec("destroy.ci4", n.nvmlComputeInstanceDestroy, c4)
rec("destroy.ci4.again", n.nvmlComputeInstanceDestroy, c4)
rec("ci4.gone", n.nvmlComputeInstanceGetInfo, c4)
rec("mig0.stale", n.nvmlDeviceGetUUID, m0)
rec("destroy.4g", n.nvmlGpuInstanceDestroy, g4)
rec("4g.gone", n.nvmlGpuInstanceGetInfo, g4)
rec("byId.4g.gone", n.nvmlDeviceGetGpuInstanceById, h, 1)
rec("migs.two", mig_devices, h)
# a new 3g in the freed half takes the free slot 0
g3 = create("3g@0", h, 9, 0, 4)
c3 = rec("ci3", n.nvmlGpuInstanceCreateComputeInstance, g3, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
rec("migs.after", mig_devices, h)
'''

# another process (and an nvmlShutdown/nvmlInit in it) sees what LAYOUT left
LATER = r'''
rec("migs", mig_devices, h)
n.nvmlShutdown()
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
rec("migs.reinit", mig_devices, h)
rec("instances.3g", gpu_instances, h, 9)
gi = n.nvmlDeviceGetGpuInstanceById(h, 5)
rec("2g.info", n.nvmlGpuInstanceGetInfo, gi)
ci = n.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
rec("2g.destroy.inUse", n.nvmlGpuInstanceDestroy, gi)
rec("2g.ci.destroy", n.nvmlComputeInstanceDestroy, ci)
rec("2g.destroy", n.nvmlGpuInstanceDestroy, gi)
rec("migs.after", mig_devices, h)
'''

MEDIA = r'''
create("me@0", h, 20, 0, 1)                 # 1g.10gb+me: the GPU's one OFA
create("me@3.second", h, 20, 3, 1)
create("7g.ofa", h, 0, 0, 8)
create("1g@3", h, 19, 3, 1)
g = n.nvmlDeviceCreateGpuInstance(h, 19)  # the first free placement
rec("first.free", n.nvmlGpuInstanceGetInfo, g)
'''

FILL = r'''
# the GPU filled with the smallest profile, then nothing more fits
gis = [n.nvmlDeviceCreateGpuInstance(h, 19) for _ in range(7)]
out["ids"] = [n.nvmlGpuInstanceGetInfo(g).id for g in gis]
rec("eighth", n.nvmlDeviceCreateGpuInstance, h, 19)
rec("1g.20gb@6", n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 15, placement(6, 2))
cis = [n.nvmlGpuInstanceCreateComputeInstance(g, 0) for g in gis]
out["slots"] = [d["gi"] for d in mig_devices(h)]
for c in cis:
    n.nvmlComputeInstanceDestroy(c)
for g in gis:
    n.nvmlGpuInstanceDestroy(g)
out["empty"] = mig_devices(h)
# two 3g halves: 6 compute slices, 6 copy engines
a = create("3g@0", h, 9, 0, 4)
b = create("3g@4", h, 9, 4, 4)
create("1g@7", h, 19, 7, 1)  # not a placement of 1g.10gb
n.nvmlGpuInstanceDestroy(a)
n.nvmlGpuInstanceDestroy(b)
'''

REFUSED = r'''
# GPU 1: creating GPU instances fails as injected; GPU 2: compute instances; GPU 3: MIG disabled
h1, h2, h3 = (n.nvmlDeviceGetHandleByIndex(i) for i in (1, 2, 3))
create("fail.gi", h1, 19, 0, 1)
rec("fail.gi.first", n.nvmlDeviceCreateGpuInstance, h1, 19)
g = create("fail.ci.gi", h2, 19, 0, 1)
rec("fail.ci", n.nvmlGpuInstanceCreateComputeInstance, g, 0)
rec("fail.ci.destroy", n.nvmlGpuInstanceDestroy, g)
create("disabled", h3, 19, 0, 1)
rec("disabled.first", n.nvmlDeviceCreateGpuInstance, h3, 19)
rec("disabled.byId", n.nvmlDeviceGetGpuInstanceById, h3, 7)
rec("disabled.list", gpu_instances, h3, 19)
rec("badHandle", n.nvmlGpuInstanceDestroy, ctypes.cast(ctypes.c_void_p(16), n.c_nvmlGpuInstance_t))
rec("nullHandle", n.nvmlGpuInstanceGetInfo, n.c_nvmlGpuInstance_t())
'''

STATIC = r'''
# the inventory's MIG devices (a100-80gb-mig: 3g.40gb GI 2, 1g.10gb GIs 9 and 10): listed, not destroyable,
# and what they take is taken
gi = n.nvmlDeviceGetGpuInstanceById(h, 2)
rec("info", n.nvmlGpuInstanceGetInfo, gi)
rec("list.3g", gpu_instances, h, 9)
rec("list.1g", gpu_instances, h, 19)
ci = n.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
rec("ci.info", n.nvmlComputeInstanceGetInfo, ci)
rec("ci.profile", n.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 2, 0)
rec("ci.list", compute_instances, gi, 2)
rec("ci.list.other", compute_instances, gi, 0)
rec("ci.create", n.nvmlGpuInstanceCreateComputeInstance, gi, 2)
rec("ci.destroy", n.nvmlComputeInstanceDestroy, ci)
rec("destroy", n.nvmlGpuInstanceDestroy, gi)
create("3g@4.taken", h, 9, 4, 4)
create("1g@2.taken", h, 19, 2, 1)
g = create("3g@0", h, 9, 0, 4)  # 3+3+1+1 compute slices: 8 > 7
g = create("2g@0", h, 14, 0, 2)
c = rec("2g.ci", n.nvmlGpuInstanceCreateComputeInstance, g, 1)
out["migs"] = [[d["gi"], d["ci"], d["name"]] if isinstance(d, dict) else d for d in mig_devices(h)]
n.nvmlComputeInstanceDestroy(c)
n.nvmlGpuInstanceDestroy(g)
'''


def _profile_yaml(tmp_path: Path) -> Path:
    """h100-dynamic-mig plus a GPU whose GPU instance creation fails, one whose compute instance
    creation fails, and one with MIG disabled."""
    doc = yaml.safe_load((resources.files("gpudra_driver") / "profiles" / "h100-dynamic-mig.yaml").read_text())
    first, second = doc["gpus"]
    doc["gpus"] = [
        first,
        {**second, "fail": {"nvmlDeviceCreateGpuInstanceWithPlacement": "InsufficientResources",
                            "nvmlDeviceCreateGpuInstance": "Unknown"}},
        {"uuid": "GPU-0b8e4e1c-2a1f-5d2b-9c3e-000000000002", "busId": "00000000:3B:00.0",
         "fail": {"nvmlGpuInstanceCreateComputeInstance": "Unknown"}},
        {"uuid": "GPU-0b8e4e1c-2a1f-5d2b-9c3e-000000000003", "busId": "00000000:4C:00.0", "migMode": "disabled"},
    ]
    path = tmp_path / "h100x4.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Machine:
    """One fake driver root per backend, for one profile; ``run`` a scenario in a child process."""

    def __init__(self, tmp_path: Path, profile: Path | str, mock_lib: Path) -> None:
        self.profile = str(profile)
        self.roots = {b: make_driver_root(tmp_path / b, self.profile, library=mock_lib, device_nodes=False)
                      for b in BACKENDS}
        self.tmp = tmp_path

    def run(self, backend: str, scenario: str) -> dict[str, Any]:
        script = self.tmp / f"scenario-{abs(hash(scenario))}.py"
        script.write_text(scenario)
        env = {k: v for k, v in os.environ.items()
               if k not in (fakedriverroot.INVENTORY_ENV, mockstate.STATE_ENV)}
        proc = subprocess.run([sys.executable, "-c", CHILD, backend, str(self.roots[backend]), self.profile,
                               "-", str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"{backend} child failed:\n{proc.stderr}"
        return json.loads(proc.stdout)

    def both(self, scenario: str) -> dict[str, Any]:
        """The scenario on both backends: their answers, which must be the same."""
        mock, fake = (self.run(b, scenario) for b in BACKENDS)
        for key in mock.keys() | fake.keys():
            assert mock.get(key, "<missing>") == fake.get(key, "<missing>"), key
        return mock


@pytest.fixture
def machine(tmp_path: Path, mock_lib: Path) -> Machine:
    return Machine(tmp_path, _profile_yaml(tmp_path), mock_lib)


H100 = load_mig_catalog("h100-sxm5-80gb")
INSUFFICIENT, INVALID = "!NVMLError_InsufficientResources", "!NVMLError_InvalidArgument"


def _gi_info(gi: int, profile_id: int, start: int, size: int) -> dict[str, Any]:
    return {"device": "<handle>", "id": gi, "profileId": profile_id, "placement": {"start": start, "size": size}}


def test_every_placement_of_the_h100_catalog(machine: Machine) -> None:
    out = machine.both(EVERY_PLACEMENT)
    expected = {}
    for spec in H100.profiles:
        for start in spec.placement_starts:
            gi = tree_gpu_instance_id(8, start, spec.placement_size)
            key = f"{spec.id}@{start}"
            expected |= {key: "<handle>", f"{key}.info": _gi_info(gi, spec.id, start, spec.placement_size),
                         f"{key}.destroy": pynvml.NVML_SUCCESS, f"{key}.gone": INVALID}
    assert out == expected
    # the GPU instance IDs of real GPUs: the placement's node in the tree of the 8 memory slices
    assert out["0@0.info"]["id"] == 0 and out["5@0.info"]["id"] == 1 and out["9@4.info"]["id"] == 2
    assert [out[f"15@{s}.info"]["id"] for s in (0, 2, 4, 6)] == [3, 4, 5, 6]
    assert [out[f"19@{s}.info"]["id"] for s in range(7)] == list(range(7, 14))


def _mig(gpu_uuid: str, spec_name: str, gi: int, ci: int = 0) -> dict[str, Any]:
    spec = H100.by_name(spec_name)
    assert spec is not None
    return {
        "uuid": mig_uuid(gpu_uuid, gi, ci), "name": f"NVIDIA H100 80GB HBM3 MIG {spec_name}", "gi": gi, "ci": ci,
        "attributes": {
            "multiprocessorCount": spec.multiprocessors, "sharedCopyEngineCount": spec.copy_engines,
            "sharedDecoderCount": spec.decoders, "sharedEncoderCount": spec.encoders, "sharedJpegCount": spec.jpeg,
            "sharedOfaCount": spec.ofa, "gpuInstanceSliceCount": spec.slices,
            "computeInstanceSliceCount": spec.slices, "memorySizeMB": spec.memory_mib,
        },
        "memory": spec.memory_mib * 1024 * 1024, "isMig": 1, "parent": gpu_uuid, "byUuid": gi,
    }


def test_layout_compute_instances_mig_devices_and_destroy(machine: Machine) -> None:
    out = machine.both(LAYOUT)
    gpu = load_profile(machine.profile).gpus[0].uuid
    nf = "!NVMLError_NotFound"
    assert out["4g@0.info"] == _gi_info(1, 5, 0, 4)
    assert out["2g@4.info"] == _gi_info(5, 14, 4, 2)
    assert out["1g@6.info"] == _gi_info(13, 19, 6, 1)
    assert out["1g@0.overlap"] == out["1g@5.overlap"] == out["1g.next"] == INSUFFICIENT  # the GPU is full
    assert out["3g@2.notListed"] == out["3g@0.wrongSize"] == out["unknownProfile"] == out["nullPlacement"] == INVALID
    assert (out["instances.4g"], out["instances.1g"], out["instances.unknown"]) == ([1], [13], INVALID)
    assert out["byId.4g"] == _gi_info(1, 5, 0, 4) and out["byId.unknown"] == nf
    v1 = {"id": 3, "sliceCount": 4, "instanceCount": 1, "multiprocessorCount": 64, "sharedCopyEngineCount": 4,
          "sharedDecoderCount": 4, "sharedEncoderCount": 0, "sharedJpegCount": 4, "sharedOfaCount": 0}
    assert out["ciProfile.v1"] == v1
    assert out["ciProfile.v2"] == {"version": pynvml.nvmlComputeInstanceProfileInfo_v2, **v1, "name": "MIG 4g.40gb"}
    assert out["ciProfile.smaller"] == "!NVMLError_NotSupported"
    assert out["ciProfile.pastCount"] == out["ciProfile.engine1"] == INVALID
    assert out["migs.none"] == [nf] * 7  # GPU instances without compute instances
    assert out["ci4"] == "<handle>"
    assert out["ci4.info"] == {"device": "<handle>", "gpuInstance": "<handle>", "id": 0, "profileId": 3,
                               "placement": {"start": 0, "size": 4}}
    assert out["ci4.info.gi"] == 1
    assert out["ci4.again"] == INSUFFICIENT and out["ci4.smaller"] == "!NVMLError_NotSupported"
    assert out["ci4.pastCount"] == INVALID
    assert (out["ci4.byId"], out["ci4.byId.unknown"]) == (0, nf)
    assert (out["ci4.list"], out["ci4.list.smaller"]) == ([0], "!NVMLError_NotSupported")
    assert out["migs.one"] == [_mig(gpu, "4g.40gb", 1)] + [nf] * 6
    assert out["destroy.4g.inUse"] == "!NVMLError_InUse"
    three = [_mig(gpu, "4g.40gb", 1), _mig(gpu, "2g.20gb", 5), _mig(gpu, "1g.10gb", 13)]
    assert out["migs.three"] == three + [nf] * 4
    assert out["destroy.ci4"] == out["destroy.4g"] == pynvml.NVML_SUCCESS
    assert out["destroy.ci4.again"] == out["ci4.gone"] == out["mig0.stale"] == out["4g.gone"] == INVALID
    assert out["byId.4g.gone"] == nf
    assert out["migs.two"] == [nf, three[1], three[2]] + [nf] * 4
    assert out["3g@0.info"] == _gi_info(1, 9, 0, 4)
    assert out["migs.after"] == [_mig(gpu, "3g.40gb", 1), three[1], three[2]] + [nf] * 4
    # the MIG UUIDs are the parent's and the IDs', whatever the process: the same on both backends
    assert len({d["uuid"] for d in three}) == 3 and all(d["uuid"].startswith("MIG-") for d in three)


def test_instances_persist_across_processes(machine: Machine) -> None:
    first = machine.both(LAYOUT)
    later = machine.both(LATER)
    nf = "!NVMLError_NotFound"
    assert later["migs"] == later["migs.reinit"] == first["migs.after"]
    assert later["instances.3g"] == [1]
    assert later["2g.info"] == _gi_info(5, 14, 4, 2)
    assert later["2g.destroy.inUse"] == "!NVMLError_InUse"
    assert later["2g.ci.destroy"] == later["2g.destroy"] == pynvml.NVML_SUCCESS
    assert later["migs.after"] == [first["migs.after"][0], nf] + first["migs.after"][2:]
    # the state file (in each root's state directory, the same text whichever backend wrote it)
    texts = {b: (machine.roots[b] / "run/gpudra-mock/state" / load_profile(machine.profile).gpus[0].uuid
                 / "mig_instances").read_text() for b in BACKENDS}
    assert texts["mock"] == texts["fake"]
    assert [x for x in texts["mock"].splitlines() if not x.startswith("#")] == [
        "gi 1 9 0 4", "ci 1 0 2 0", "gi 13 19 6 1", "ci 13 0 0 2"]
    # and each logged its changes alike
    assert mockstate.calls(machine.roots["mock"]) == mockstate.calls(machine.roots["fake"])
    assert mockstate.calls(machine.roots["mock"])[:2] == [
        f"nvml CreateGpuInstance {load_profile(machine.profile).gpus[0].uuid} 5 0 4 1",
        f"nvml CreateGpuInstance {load_profile(machine.profile).gpus[0].uuid} 14 4 2 5"]


def test_the_simulators_share_the_state(machine: Machine) -> None:
    """What the mock library created, the simulator sees in the same root, and the other way round."""
    first = machine.run("mock", LAYOUT)
    machine.roots["fake"] = machine.roots["mock"]
    seen = machine.run("fake", LATER)  # the simulator on the mock's root: sees its instances, destroys one
    assert seen["migs"] == first["migs.after"]
    assert machine.run("mock", "rec('migs', mig_devices, h)")["migs"] == seen["migs.after"]


def test_media_engines_and_the_first_free_placement(machine: Machine) -> None:
    out = machine.both(MEDIA)
    assert out["me@0.info"] == _gi_info(7, 20, 0, 1)
    assert out["me@3.second"] == INSUFFICIENT  # one +me (one OFA) per GPU
    assert out["7g.ofa"] == INSUFFICIENT
    assert out["1g@3.info"] == _gi_info(10, 19, 3, 1)
    assert out["first.free"] == _gi_info(8, 19, 1, 1)  # the lowest start that fits


def test_fill_the_gpu(machine: Machine) -> None:
    out = machine.both(FILL)
    assert out["ids"] == list(range(7, 14))
    assert out["eighth"] == out["1g.20gb@6"] == INSUFFICIENT
    assert out["slots"] == list(range(7, 14))
    assert out["empty"] == ["!NVMLError_NotFound"] * 7
    assert out["3g@0.info"] == _gi_info(1, 9, 0, 4) and out["3g@4.info"] == _gi_info(2, 9, 4, 4)
    assert out["1g@7"] == INVALID


def test_injected_failures_and_mig_disabled(machine: Machine) -> None:
    out = machine.both(REFUSED)
    assert out["fail.gi"] == INSUFFICIENT and out["fail.gi.first"] == "!NVMLError_Unknown"
    assert out["fail.ci.gi.info"] == _gi_info(7, 19, 0, 1)
    assert out["fail.ci"] == "!NVMLError_Unknown" and out["fail.ci.destroy"] == pynvml.NVML_SUCCESS
    # nvml.h: NOT_SUPPORTED "If device doesn't have MIG mode enabled"
    assert out["disabled"] == out["disabled.first"] == out["disabled.byId"] == "!NVMLError_NotSupported"
    assert out["disabled.list"] == "!NVMLError_NotSupported"
    assert out["badHandle"] == out["nullHandle"] == INVALID


def test_static_mig_devices_beside_created_ones(tmp_path: Path, mock_lib: Path) -> None:
    machine = Machine(tmp_path, "a100-80gb-mig", mock_lib)
    out = machine.both(STATIC)
    assert out["info"] == _gi_info(2, 9, 4, 4)  # GI 2 is the upper half on a real GPU
    assert (out["list.3g"], out["list.1g"]) == ([2], [9, 10])
    assert out["ci.info"] == {"device": "<handle>", "gpuInstance": "<handle>", "id": 0, "profileId": 2,
                              "placement": {"start": 0, "size": 3}}
    assert out["ci.profile"]["name"] == "MIG 3g.40gb" and out["ci.profile"]["sliceCount"] == 3
    assert (out["ci.list"], out["ci.list.other"]) == ([0], "!NVMLError_NotSupported")
    assert out["ci.create"] == INSUFFICIENT
    assert out["ci.destroy"] == out["destroy"] == "!NVMLError_InUse"
    assert out["3g@4.taken"] == out["1g@2.taken"] == out["3g@0"] == INSUFFICIENT
    assert out["2g@0.info"] == _gi_info(3, 14, 0, 2)
    name = "NVIDIA A100-SXM4-80GB MIG"
    assert out["migs"] == [[2, 0, f"{name} 3g.40gb"], [9, 0, f"{name} 1g.10gb"], [10, 0, f"{name} 1g.10gb"],
                           [3, 0, f"{name} 2g.20gb"]] + ["!NVMLError_NotFound"] * 3


def test_discovery_sees_created_instances_as_mig_devices(machine: Machine) -> None:
    """Static MIG discovery, through both backends, once instances exist: the created MIG devices."""
    machine.both(LAYOUT)
    scan = r'''
from gpudra_driver.discovery import scan
from gpudra_driver.deviceapi import device_to_api
n.nvmlShutdown()
d = scan(n, mig="static")
out["devices"] = [device_to_api(x) for x in d.devices if x.attr("parentIndex") == 0]
n.nvmlInit()
'''
    out = machine.both(scan)
    gpu = load_profile(machine.profile).gpus[0].uuid
    uuids = [d["attributes"]["uuid"]["string"] for d in out["devices"]]
    assert uuids == [mig_uuid(gpu, 1, 0), mig_uuid(gpu, 5, 0), mig_uuid(gpu, 13, 0)]


# -- the simulator without a state directory, and the helpers --------------------------------------------


def test_simulator_in_memory() -> None:
    n = FakeNvml(load_profile("h100-dynamic-mig"))
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, pynvml.c_nvmlGpuInstancePlacement_t(start=4, size=4))
    ci = n.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert n.nvmlDeviceGetUUID(m) == mig_uuid(load_profile("h100-dynamic-mig").gpus[0].uuid, 2, 0)
    other = FakeNvml(load_profile("h100-dynamic-mig"))  # its own machine: nothing shared
    other.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotFound):
        other.nvmlDeviceGetMigDeviceHandleByIndex(other.nvmlDeviceGetHandleByIndex(0), 0)
    n.nvmlComputeInstanceDestroy(ci)
    n.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        n.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        n.nvmlGpuInstanceGetInfo(h)  # a device handle is no GPU instance
    n.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        n.nvmlDeviceCreateGpuInstance(h, 19)



def test_gpu_instance_ids_and_creatable_instances() -> None:
    assert [tree_gpu_instance_id(8, s, 1) for s in range(8)] == list(range(7, 15))
    assert tree_gpu_instance_id(8, 0, 8) == 0 and tree_gpu_instance_id(8, 4, 4) == 2
    assert tree_gpu_instance_id(12, 6, 3) == 5 and tree_gpu_instance_id(12, 0, 6) == 1  # RTX PRO 6000's 12 slices
    assert tree_gpu_instance_id(8, 1, 2) is None and tree_gpu_instance_id(8, 0, 3) is None
    # GI ID -> the most compute slices: 7g 0, 4g/3g 1, 3g 2, the 2-slice placements 3-6, the 1-slice ones 7-13
    assert creatable_instances(H100) == {0: 7, 1: 4, 2: 3, 3: 2, 4: 2, 5: 2, 6: 1, **{i: 1 for i in range(7, 14)}}
    assert mig_uuid("GPU-x", 1, 0) == mig_uuid("GPU-x", 1, 0) != mig_uuid("GPU-x", 1, 1)
    u = mig_uuid("GPU-3f1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f60", 1, 0)
    assert len(u) == 40 and u[18] == "5" and u[23] in "89ab"


def test_exports(mock_lib: Path) -> None:
    lib = ctypes.CDLL(str(mock_lib))
    for symbol in (
        "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceDestroy",
        "nvmlDeviceGetGpuInstances", "nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy", "nvmlGpuInstanceGetComputeInstances",
        "nvmlGpuInstanceGetComputeInstanceById", "nvmlComputeInstanceGetInfo", "nvmlComputeInstanceGetInfo_v2",
    ):
        assert hasattr(lib, symbol), symbol
    assert LIB_DIR.name == "x86_64-linux-gnu"
