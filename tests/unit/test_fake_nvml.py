from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpudra_driver.nvml import NvmlUnavailable, load_nvml, profile_names
from gpudra_driver.nvml.fake import FakeNvml, load_profile, parse_profile

SHIPPED = ["a100-80gb-mig", "dgx-a100-40gb", "dgx-h100", "h200", "l4x2"]


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
