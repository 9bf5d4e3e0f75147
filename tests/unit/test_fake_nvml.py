from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpudra_driver.nvml import NvmlUnavailable, load_nvml, profile_names
from gpudra_driver.nvml.fake import FakeNvml, load_mig_catalog, load_profile, parse_mig_catalog, parse_profile

SHIPPED = ["a100-80gb-mig", "dgx-a100-40gb", "dgx-h100", "h100-dynamic-mig", "h200", "l4x2"]


def started(nvml: FakeNvml) -> FakeNvml:
    nvml.nvmlInit()
    return nvml


def test_shipped_profiles() -> None:
    assert profile_names() == SHIPPED


@pytest.mark.parametrize(
    "call",
    [
        lambda n: n.nvmlDeviceGetCount(),
        lambda n: n.nvmlSystemGetDriverVersion(),
        lambda n: n.nvmlSystemGetCudaDriverVersion_v2(),
        lambda n: n.nvmlDeviceGetHandleByIndex(0),
        lambda n: n.nvmlShutdown(),
    ],
)
def test_calls_before_init_raise_uninitialized(fake: Callable[[str], FakeNvml], call: Any) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        call(fake("dgx-h100"))


def test_init_is_reference_counted_and_shutdown_invalidates_handles(fake: Callable[[str], FakeNvml]) -> None:
    nvml = fake("h200")
    nvml.nvmlInit()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetUUID(handle) == "GPU-64513466-bb57-5a2a-bda6-a9ab3f6652bb"
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetUUID(handle)


def test_return_shapes_match_pynvml(fake: Callable[[str], FakeNvml]) -> None:
    nvml = started(fake("dgx-h100"))
    assert nvml.nvmlSystemGetDriverVersion() == "570.133.20"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 12080
    h = nvml.nvmlDeviceGetHandleByIndex(3)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvmlDeviceGetBrand(h) == pynvml.NVML_BRAND_NVIDIA
    assert nvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert nvml.nvmlDeviceGetMinorNumber(h) == 3
    assert nvml.nvmlDeviceGetNumaNodeId(h) == 0
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t)
    assert (mem.total, mem.free, mem.used) == (81559 * 2**20, 81559 * 2**20, 0)
    pci = nvml.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:5D:00.0"  # str, as nvidia-ml-py decodes it
    assert pci.busIdLegacy == "0000:5D:00.0"
    assert (pci.domain, pci.bus, pci.device, pci.pciDeviceId) == (0, 0x5D, 0, 0x233010DE)
    assert nvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2


def test_constants_and_exceptions_are_pynvmls(fake: Callable[[str], FakeNvml]) -> None:
    nvml = fake("l4x2")
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    assert nvml.NVML_DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE
    assert getattr(nvml, "nvmlDeviceGetFanSpeed", None) is None  # unimplemented calls are absent


def test_mig_queries_on_a_gpu_without_mig(fake: Callable[[str], FakeNvml]) -> None:
    nvml = started(fake("l4x2"))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    # L4 in a VM: NVML has no NUMA answer
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNumaNodeId(h)


def test_mig_queries_with_mig_disabled_match_real_nvml(fake: Callable[[str], FakeNvml]) -> None:
    # as observed on an H200 with NVML 580.159.04
    nvml = started(fake("h200"))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstanceId(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(h)


def test_mig_devices(fake: Callable[[str], FakeNvml]) -> None:
    nvml = started(fake("a100-80gb-mig"))
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert nvml.nvmlDeviceGetUUID(mig) == "MIG-87274760-e33e-5f1c-aeb9-28e1633fea16"
    assert nvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert nvml.nvmlDeviceIsMigDeviceHandle(gpu).value == 0
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    attrs = nvml.nvmlDeviceGetAttributes(mig)
    assert isinstance(attrs, pynvml.c_nvmlDeviceAttributes)
    assert (attrs.multiprocessorCount, attrs.sharedCopyEngineCount, attrs.memorySizeMB) == (42, 3, 40192)
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 40192 * 2**20
    parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert nvml.nvmlDeviceGetUUID(parent) == "GPU-51521ace-0579-559b-b008-e94ddc1e940f"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMinorNumber(mig)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 3)  # empty slot
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)  # past the max count


def test_bad_index_and_handle(fake: Callable[[str], FakeNvml]) -> None:
    nvml = started(fake("l4x2"))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetUUID(object())


def test_fault_injection(profile_file: Callable[..., Path]) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["gpus"][1]["fail"] = True
        doc["gpus"][2]["fail"] = {"nvmlDeviceGetMemoryInfo": "GpuIsLost"}

    nvml = started(FakeNvml(load_profile(str(profile_file("dgx-h100", edit)))))
    ok, bad, lost = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    assert nvml.nvmlDeviceGetUUID(ok).startswith("GPU-")
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetUUID(bad)
    assert nvml.nvmlDeviceGetName(bad) == "NVIDIA H100 80GB HBM3"  # only the named call fails
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetMemoryInfo(lost)


def test_init_error(profile_file: Callable[..., Path]) -> None:
    path = profile_file("l4x2", lambda doc: doc.update(initError="DriverNotLoaded"))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        FakeNvml(load_profile(str(path))).nvmlInit()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["gpus"][0].update(colour="red"), "unknown field"),
        (lambda d: d["gpus"][0].update(brand="ACME"), "NVML_BRAND_"),
        (lambda d: d["gpus"][0].update(fail={"nvmlDeviceGetUUID": "Oops"}), "unknown NVML error"),
        (lambda d: d["gpus"][0].pop("uuid"), "missing field 'uuid'"),
        (lambda d: d.update(initError="Nope"), "unknown NVML error"),
    ],
)
def test_profile_validation(profile_file: Callable[..., Path], edit: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_profile(str(profile_file("h200", edit)))


def test_mig_devices_need_mig_enabled() -> None:
    doc = {
        "driverVersion": "570.133.20",
        "cudaDriverVersion": 12080,
        "gpus": [{
            "name": "x", "uuid": "GPU-1", "brand": "NVIDIA", "architecture": "AMPERE",
            "cudaComputeCapability": "8.0", "memoryMiB": 1, "busId": "00000000:01:00.0",
            "pciDeviceId": 1, "migCapable": True, "migMode": "disabled",
            "migDevices": [{"uuid": "MIG-1", "profile": "1g.10gb", "gpuInstanceId": 1,
                            "computeInstanceId": 0, "attributes": {"memorySizeMB": 1}}],
        }],
    }
    with pytest.raises(ValueError, match="migMode: enabled"):
        parse_profile("t", doc)


def test_load_nvml_specs(monkeypatch: pytest.MonkeyPatch, profile_file: Callable[..., Path]) -> None:
    from plugin_fixtures import fake_root

    assert load_nvml("real", fake_root("l4x2")) is pynvml  # the fake root's mock libnvidia-ml.so.1
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1 was not found in driver root /"):
        load_nvml("real")  # this machine has no NVIDIA driver
    assert isinstance(load_nvml("fake:l4x2"), FakeNvml)
    assert load_nvml(f"fake:{profile_file('l4x2')}").profile.name == "l4x2-edited"
    monkeypatch.setenv("GPUDRA_NVML", "fake:dgx-h100")
    assert load_nvml(None).profile.name == "dgx-h100"
    with pytest.raises(ValueError, match="unknown NVML profile 'nope'"):
        load_nvml("fake:nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_nvml("fake:/no/such/file.yaml")
    with pytest.raises(ValueError, match="unknown NVML spec"):
        load_nvml("mock")


def test_event_wait_blocks_until_a_line_is_appended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait sleeps on inotify like the mock library, not by looking at the file every 10 ms (an
    idle agent's health thread woke 100 times a second: 1-2 % of a core); an injected line still
    ends it at once, whether the events file existed before or not."""
    import threading
    import time

    from gpudra_dev.localcluster import mockstate

    nvml = started(FakeNvml(load_profile("l4x2"), tmp_path / "state"))
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    event_set = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    looks = 0
    next_event = FakeNvml._next_event

    def counted(self: FakeNvml, target: Any) -> Any:
        nonlocal looks
        looks += 1
        return next_event(self, target)

    monkeypatch.setattr(FakeNvml, "_next_event", counted)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 500)
    assert looks <= 3, f"the file was read {looks} times in a 0.5 s wait: polled, not blocked"

    for xid in (79, 48):  # the file is created by the first line, appended to by the second
        timer = threading.Timer(0.2, mockstate._append_event, (tmp_path / "state", f"xid {uuid} {xid}"))
        started_at = time.monotonic()
        timer.start()
        data = nvml.nvmlEventSetWait_v2(event_set, 10_000)
        timer.join()
        assert data.eventData == xid and time.monotonic() - started_at < 2.0
    nvml.nvmlEventSetFree(event_set)
    assert event_set.inotify == -1


# -- GPU instance profiles (MIG catalogs) ----------------------------------------------------------

A100_80GB = {  # NVML index: (id, slices, instances, SMs, CE, DEC, ENC, JPEG, OFA, MiB, name, starts, size)
    0: (19, 1, 7, 14, 1, 0, 0, 0, 0, 9728, "1g.10gb", [0, 1, 2, 3, 4, 5, 6], 1),
    7: (20, 1, 1, 14, 1, 1, 0, 1, 1, 9728, "1g.10gb+me", [0, 1, 2, 3, 4, 5, 6], 1),
    9: (15, 1, 4, 14, 1, 1, 0, 0, 0, 19968, "1g.20gb", [0, 2, 4, 6], 2),
    1: (14, 2, 3, 28, 2, 1, 0, 0, 0, 19968, "2g.20gb", [0, 2, 4], 2),
    2: (9, 3, 2, 42, 3, 2, 0, 0, 0, 40192, "3g.40gb", [0, 4], 4),
    3: (5, 4, 1, 56, 4, 2, 0, 0, 0, 40192, "4g.40gb", [0], 4),
    4: (0, 7, 1, 98, 7, 5, 0, 1, 1, 80896, "7g.80gb", [0], 8),
}
H100_80GB = {
    0: (19, 1, 7, 16, 1, 1, 0, 1, 0, 9984, "1g.10gb", [0, 1, 2, 3, 4, 5, 6], 1),
    7: (20, 1, 1, 16, 1, 1, 0, 1, 1, 9984, "1g.10gb+me", [0, 1, 2, 3, 4, 5, 6], 1),
    9: (15, 1, 4, 26, 1, 1, 0, 1, 0, 20096, "1g.20gb", [0, 2, 4, 6], 2),
    1: (14, 2, 3, 32, 2, 2, 0, 2, 0, 20096, "2g.20gb", [0, 2, 4], 2),
    2: (9, 3, 2, 60, 3, 3, 0, 3, 0, 40448, "3g.40gb", [0, 4], 4),
    3: (5, 4, 1, 64, 4, 4, 0, 4, 0, 40448, "4g.40gb", [0], 4),
    4: (0, 7, 1, 132, 8, 7, 0, 7, 1, 81152, "7g.80gb", [0], 8),
}
INFO_FIELDS = ("id", "sliceCount", "instanceCount", "multiprocessorCount", "copyEngineCount", "decoderCount",
               "encoderCount", "jpegCount", "ofaCount", "memorySizeMB")


def placements(nvml: FakeNvml, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """pynvml's two-call protocol, as a caller of the real binding writes it."""
    count = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count)) == 0
    buf = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, buf, ctypes.byref(count)) == 0
    return [(p.start, p.size) for p in buf[: count.value]]


@pytest.mark.parametrize(("name", "expected"), [("a100-80gb-mig", A100_80GB), ("h100-dynamic-mig", H100_80GB)])
def test_gpu_instance_profiles_from_the_catalog(fake: Callable[[str], FakeNvml], name: str,
                                                expected: dict[int, tuple[Any, ...]]) -> None:
    nvml = started(fake(name))
    for gpu in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(gpu)
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            if index not in expected:
                for version in (1, 2):
                    with pytest.raises(pynvml.NVMLError_NotSupported):
                        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index, version)
                continue
            *values, profile, starts, size = expected[index]
            v2 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            v1 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index, version=1)
            by_id = nvml.nvmlDeviceGetGpuInstanceProfileInfoById(h, values[0])
            assert type(v2) is pynvml.c_nvmlGpuInstanceProfileInfo_v2_t and type(by_id) is type(v2)
            assert type(v1) is pynvml.c_nvmlGpuInstanceProfileInfo_t
            for info in (v1, v2, by_id):
                assert [getattr(info, f) for f in INFO_FIELDS] == values and info.isP2pSupported == 0
            assert v2.version == by_id.version == pynvml.nvmlGpuInstanceProfileInfo_v2
            assert v2.name == by_id.name == f"MIG {profile}"  # str, as pynvml's _PrintableStructure decodes
            assert placements(nvml, h, values[0]) == [(start, size) for start in starts]


def test_possible_placements_protocol(fake: Callable[[str], FakeNvml]) -> None:
    nvml = started(fake("h100-dynamic-mig"))
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    count = ctypes.c_uint(99)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, None, ctypes.byref(count))
    assert count.value == 4  # placements NULL: how many
    short = (pynvml.c_nvmlGpuInstancePlacement_t * 4)()
    count.value = 3
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, short, ctypes.byref(count))
    assert count.value == 4 and short[0].size == 0  # the needed number, nothing written
    # a larger buffer, a pointer to it and a plain c_uint count are fine too
    big = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    count = ctypes.c_uint(8)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
        h, 15, ctypes.cast(big, ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t)), ctypes.pointer(count))
    assert count.value == 4 and [(p.start, p.size) for p in big[:5]] == [(0, 2), (2, 2), (4, 2), (6, 2), (0, 0)]
    one = pynvml.c_nvmlGpuInstancePlacement_t()
    count = ctypes.c_uint(1)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 0, ctypes.byref(one), count)
    assert (one.start, one.size, count.value) == (0, 8, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, None, None)  # count NULL
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 99, None, ctypes.byref(count))  # no such ID


def test_gpu_instance_profile_errors(fake: Callable[[str], FakeNvml], profile_file: Callable[..., Path]) -> None:
    nvml = started(fake("a100-80gb-mig"))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # pynvml knows versions 1 and 2 only
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0, version=3)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstanceProfileInfoById(h, 99)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # profiles belong to the GPU, not a MIG device
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(mig, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(mig, 19, None, ctypes.byref(ctypes.c_uint()))
    l4 = started(fake("l4x2"))
    for call in (lambda n, g: n.nvmlDeviceGetGpuInstanceProfileInfo(g, 0),
                 lambda n, g: n.nvmlDeviceGetGpuInstanceProfileInfoById(g, 19),
                 lambda n, g: n.nvmlDeviceGetGpuInstancePossiblePlacements(g, 19, None, ctypes.byref(ctypes.c_uint()))):
        with pytest.raises(pynvml.NVMLError_NotSupported):  # no MIG support
            call(l4, l4.nvmlDeviceGetHandleByIndex(0))
    # MIG disabled: the profiles are still there (NVML answers them whatever the MIG mode)
    dgx = started(fake("dgx-h100"))
    assert dgx.nvmlDeviceGetGpuInstanceProfileInfo(dgx.nvmlDeviceGetHandleByIndex(0), 4).id == 0
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake("dgx-h100").nvmlDeviceGetGpuInstanceProfileInfo(None, 0)
    # faults name the call without a version suffix, like the mock library's
    path = profile_file("h200", lambda d: d["gpus"][0].update(fail={"nvmlDeviceGetGpuInstanceProfileInfo": "Unknown"}))
    faulty = started(FakeNvml(load_profile(str(path))))
    with pytest.raises(pynvml.NVMLError_Unknown):
        faulty.nvmlDeviceGetGpuInstanceProfileInfo(faulty.nvmlDeviceGetHandleByIndex(0), 0)


def test_gpu_instance_profiles_without_a_catalog(profile_file: Callable[..., Path]) -> None:
    """Derived from the MIG devices (ID = the index), no placements: what the mock library answers."""
    nvml = started(FakeNvml(load_profile(str(profile_file("a100-80gb-mig", lambda d: d["gpus"][0].pop("migCatalog"))))))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert [getattr(info, f) for f in INFO_FIELDS] == [2, 3, 2, 42, 3, 2, 0, 0, 0, 40192]
    assert info.name == "MIG 3g.40gb"
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfoById(h, 0).name == "MIG 1g.10gb"
    for index in (pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1):
        with pytest.raises(pynvml.NVMLError_NotSupported):  # no MIG device of that size
            nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 2, None, ctypes.byref(ctypes.c_uint()))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda g: g.update(migCatalog="a100-sxm4-81gb"), "unknown MIG catalog 'a100-sxm4-81gb'"),
        (lambda g: g.update(migCatalog="../h200"), "unknown MIG catalog"),
        (lambda g: g.update(migCapable=False, migDevices=None, migMode="disabled"), "migCatalog needs migCapable"),
        (lambda g: g["migDevices"][0].update(profile="3g.39gb"),
         "profile '3g.39gb' is not in MIG catalog a100-sxm4-80gb"),
    ],
)
def test_mig_catalog_reference_is_checked(profile_file: Callable[..., Path], edit: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_profile(str(profile_file("a100-80gb-mig", lambda d: edit(d["gpus"][0]))))


def _catalog_doc() -> dict[str, Any]:
    return {
        "memorySlices": 8, "computeSlices": 7,
        "profiles": [{
            "name": "1g.10gb", "index": 0, "id": 19, "slices": 1, "instances": 7, "multiprocessors": 14,
            "copyEngines": 1, "decoders": 0, "encoders": 0, "jpeg": 0, "ofa": 0, "memoryMiB": 9728,
            "placements": {"starts": [0, 1, 2, 3, 4, 5, 6], "size": 1},
        }],
    }


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(colour="red"), "unknown field"),
        (lambda d: d.pop("memorySlices"), "missing field 'memorySlices'"),
        (lambda d: d.update(profiles=[]), "non-empty list"),
        (lambda d: d["profiles"][0].update(colour="red"), r"profiles\[0\]: unknown field"),
        (lambda d: d["profiles"][0].pop("ofa"), "missing field.*ofa"),
        (lambda d: d["profiles"][0]["placements"].pop("size"), "missing field.*size"),
        (lambda d: d["profiles"][0]["placements"].update(end=3), "unknown field"),
        (lambda d: d["profiles"][0]["placements"].update(starts=[0, 7], size=2), r"placements starting at \[7\]"),
        (lambda d: d["profiles"][0]["placements"].update(starts=[0, 0]), "distinct"),
        (lambda d: d["profiles"][0]["placements"].update(starts=[]), "non-empty"),
        (lambda d: d["profiles"][0].update(index=18), "not an NVML_GPU_INSTANCE_PROFILE"),
        (lambda d: d["profiles"][0].update(slices=8), "7 compute slices"),
        (lambda d: d["profiles"][0].update(instances=8), "only 7 placements"),
        (lambda d: d["profiles"][0].update(memoryMiB="9728"), "expected an integer"),
        (lambda d: d["profiles"][0].update(jpeg=True), "expected an integer"),
        (lambda d: d["profiles"][0].update(decoders=-1), "expected an integer >= 0"),
        (lambda d: d["profiles"][0].update(name="1g 10gb"), "not a MIG profile name"),
        (lambda d: d["profiles"].append(dict(d["profiles"][0], index=7)), "profile id 19 appears more than once"),
        (lambda d: d["profiles"].append(dict(d["profiles"][0], id=20)), "profile index 0 appears more than once"),
    ],
)
def test_mig_catalog_validation(edit: Any, match: str) -> None:
    doc = _catalog_doc()
    parse_mig_catalog("t", doc)
    edit(doc)
    with pytest.raises(ValueError, match=match):
        parse_mig_catalog("t", doc)


def test_mig_catalog_reaches_the_profile() -> None:
    gpu = load_profile("h100-dynamic-mig").gpus[0]
    assert gpu.mig_catalog is load_mig_catalog("h100-sxm5-80gb")
    assert gpu.mig_mode == (1, 1) and not gpu.migs
    assert load_profile("l4x2").gpus[0].mig_catalog is None
