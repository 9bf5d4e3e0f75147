from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_core.migpartitions import MigGeometry, MigProfile, partition_gpu
from gpudra_driver.discovery import (NvmlUnavailable, discover, mig_profile_name, numa_node_from_sysfs,
                                    pcie_root_from_sysfs, read_mig_geometry, scan)
from gpudra_driver.nvml.fake import FakeNvml, load_profile

MIB = 2**20
S, I, V = AttrValue.of_string, AttrValue.of_int, AttrValue.of_version
PCI = "resource.kubernetes.io/pciBusID"
NUMA = "resource.kubernetes.io/numaNode"  # KEP-6072's standard attribute, beside the driver's numaNode
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def gpu(index: int, uuid: str, product: str, arch: str, cc: str, driver: str, cuda: str,
        bus: str, numa: int | None, memory_mib: int) -> Device:
    attrs = {
        "type": S("gpu"), "uuid": S(uuid), "productName": S(product), "brand": S("Nvidia"),
        "architecture": S(arch), "cudaComputeCapability": V(cc), "driverVersion": V(driver),
        "cudaDriverVersion": V(cuda), PCI: S(bus), "index": I(index), "minor": I(index),
    }
    if numa is not None:
        attrs["numaNode"] = attrs[NUMA] = I(numa)
    return Device(f"gpu-{index}", attrs, {"memory": memory_mib * MIB})


DGX_A100 = [
    gpu(i, uuid, "NVIDIA A100-SXM4-40GB", "Ampere", "8.0.0", "550.54.15", "12.4.0", bus, numa, 40960)
    for i, (uuid, bus, numa) in enumerate([
        ("GPU-eae3f279-7507-5e99-b5d1-af66f2e2baa8", "0000:07:00.0", 3),
        ("GPU-bd269adb-e663-5e35-b7e2-c267cda8f347", "0000:0f:00.0", 3),
        ("GPU-be4937be-0171-522b-bf65-95931c330fd4", "0000:47:00.0", 1),
        ("GPU-09507873-ac9f-5258-a153-9f72e33f04ba", "0000:4e:00.0", 1),
        ("GPU-7758b035-eff8-5e3f-983c-aeac79eaba11", "0000:87:00.0", 7),
        ("GPU-6c388fd6-c311-5120-891f-450250600768", "0000:90:00.0", 7),
        ("GPU-a9c80801-4cbf-5301-847e-3a972c692819", "0000:b7:00.0", 5),
        ("GPU-c8543ae8-2781-571f-988f-e1b9529748a5", "0000:bd:00.0", 5),
    ])
]
DGX_H100 = [
    gpu(i, uuid, "NVIDIA H100 80GB HBM3", "Hopper", "9.0.0", "570.133.20", "12.8.0", bus, numa, 81559)
    for i, (uuid, bus, numa) in enumerate([
        ("GPU-d25ecb8a-3d99-5405-9513-5818e2702132", "0000:18:00.0", 0),
        ("GPU-dd4a4e45-a811-5f27-8d76-2e824498b70d", "0000:2a:00.0", 0),
        ("GPU-823ae736-4fae-5971-a361-ada294b93cba", "0000:3a:00.0", 0),
        ("GPU-937af4d9-8406-579b-97ce-2438a55f0a15", "0000:5d:00.0", 0),
        ("GPU-86360002-75d1-58d1-add3-bf69809e85ab", "0000:9a:00.0", 1),
        ("GPU-86cbda66-ae77-57b0-9d82-a1d681aefa94", "0000:ab:00.0", 1),
        ("GPU-60940f34-2583-5c6f-9507-368f54b17c66", "0000:ba:00.0", 1),
        ("GPU-15646598-6c68-5506-a2ad-bd597b77d72a", "0000:db:00.0", 1),
    ])
]
H200 = [
    gpu(0, "GPU-64513466-bb57-5a2a-bda6-a9ab3f6652bb", "NVIDIA H200", "Hopper", "9.0.0", "580.159.4",
        "13.0.0", "0000:00:06.0", None, 143771)
]
L4X2 = [
    gpu(i, uuid, "NVIDIA L4", "Ada Lovelace", "8.9.0", "535.104.5", "12.2.0", bus, None, 23034)
    for i, (uuid, bus) in enumerate([
        ("GPU-62d683dd-a608-5810-9a31-ff06c70237fb", "0000:00:03.0"),
        ("GPU-6992fa00-c02c-5e2f-a617-96ce040c16ef", "0000:00:04.0"),
    ])
]


def mig(slot: int, uuid: str, profile: str, gi: int, sms: int, ces: int, decs: int, mem_mib: int) -> Device:
    return Device(
        f"gpu-0-mig-{profile.replace('.', '')}-{gi}-0",
        {
            "type": S("mig"), "uuid": S(uuid), "productName": S("NVIDIA A100-SXM4-80GB"),
            "brand": S("Nvidia"), "architecture": S("Ampere"), "cudaComputeCapability": V("8.0.0"),
            "driverVersion": V("570.133.20"), "cudaDriverVersion": V("12.8.0"), PCI: S("0000:07:00.0"),
            "numaNode": I(0), NUMA: I(0), "index": I(slot), "profile": S(profile),
            "parentUUID": S("GPU-51521ace-0579-559b-b008-e94ddc1e940f"), "parentIndex": I(0),
            "parentMinor": I(0), "gpuInstanceId": I(gi), "computeInstanceId": I(0),
        },
        {"memory": mem_mib * MIB, "multiprocessors": sms, "copyEngines": ces, "decoders": decs,
         "encoders": 0, "jpegEngines": 0, "ofaEngines": 0},
    )


A100_MIG = [
    mig(0, "MIG-87274760-e33e-5f1c-aeb9-28e1633fea16", "3g.40gb", 2, 42, 3, 2, 40192),
    mig(1, "MIG-d302d8e8-c7b9-5107-84b7-f4e07e07f824", "1g.10gb", 9, 14, 1, 0, 9728),
    mig(2, "MIG-af0b139d-3158-5c41-8413-198c8e438c5a", "1g.10gb", 10, 14, 1, 0, 9728),
]

def h100_profile(name: str, pid: int, slices: int, sm: int, mib: int, ce: int, dec: int, jpeg: int, ofa: int,
                 size: int, starts: tuple[int, ...]) -> MigProfile:
    return MigProfile(name=name, profile_id=pid, compute_slices=slices, memory_mib=mib, multiprocessors=sm,
                      copy_engines=ce, decoders=dec, encoders=0, jpeg_engines=jpeg, ofa_engines=ofa,
                      placement_size=size, starts=starts)


# What NVML reports for an H100 80GB HBM3 (`nvidia-smi mig -lgip`, `-lgipp`), in its profile order
H100_GEOMETRY = MigGeometry((
    h100_profile("1g.10gb", 19, 1, 16, 9984, 1, 1, 1, 0, 1, (0, 1, 2, 3, 4, 5, 6)),
    h100_profile("2g.20gb", 14, 2, 32, 20096, 2, 2, 2, 0, 2, (0, 2, 4)),
    h100_profile("3g.40gb", 9, 3, 60, 40448, 3, 3, 3, 0, 4, (0, 4)),
    h100_profile("4g.40gb", 5, 4, 64, 40448, 4, 4, 4, 0, 4, (0,)),
    h100_profile("7g.80gb", 0, 7, 132, 81152, 8, 7, 7, 1, 8, (0,)),
    h100_profile("1g.10gb+me", 20, 1, 16, 9984, 1, 1, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    h100_profile("1g.20gb", 15, 1, 26, 20096, 1, 1, 1, 0, 2, (0, 2, 4, 6)),
))
H100_DYNAMIC = [
    d for i, (uuid, bus) in enumerate([("GPU-3f1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f60", "0000:18:00.0"),
                                       ("GPU-7a8b9c0d-1e2f-5a3b-8c4d-5e6f7a8b9c0d", "0000:2a:00.0")])
    for d in partition_gpu(gpu(i, uuid, "NVIDIA H100 80GB HBM3", "Hopper", "9.0.0", "570.133.20", "12.8.0", bus, 0,
                               81559), H100_GEOMETRY, whole=True)  # Hopper: MIG mode off for a whole-GPU claim
]
MIG_MODE = {"h100-dynamic-mig": "dynamic"}  # the others: the default, static

EXPECTED = {
    "h100-dynamic-mig": H100_DYNAMIC,
    "dgx-a100-40gb": DGX_A100,
    "dgx-h100": DGX_H100,
    "h200": H200,
    "l4x2": L4X2,
    "a100-80gb-mig": A100_MIG,
}


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_discovery_of_every_shipped_profile(fake: Callable[[str], FakeNvml], profile: str) -> None:
    result = scan(fake(profile), mig=MIG_MODE.get(profile, "static"))  # type: ignore[arg-type]
    assert result.warnings == []
    # Device equality compares every attribute's type tag and value, and every capacity.
    assert result.devices == EXPECTED[profile]


def test_the_mig_geometry_is_what_nvml_reports(fake: Callable[[str], FakeNvml]) -> None:
    nvml = fake("h100-dynamic-mig")
    nvml.nvmlInit()
    try:
        assert read_mig_geometry(nvml, nvml.nvmlDeviceGetHandleByIndex(1)) == H100_GEOMETRY
    finally:
        nvml.nvmlShutdown()


def test_dynamic_mig_leaves_gpus_without_mig_mode_and_with_foreign_mig_devices_as_they_are(
        fake: Callable[[str], FakeNvml]) -> None:
    plain = scan(fake("dgx-h100"), mig="dynamic")  # MIG-capable, MIG mode disabled
    assert plain.devices == DGX_H100
    assert len(plain.warnings) == 8 and "its MIG mode is disabled" in plain.warnings[0]
    assert "`nvidia-smi -i 0 -mig 1`" in plain.warnings[0]
    static = scan(fake("a100-80gb-mig"), mig="dynamic")  # MIG devices someone else created
    assert static.devices == A100_MIG
    assert static.warnings == ["GPU 0 (GPU-51521ace-0579-559b-b008-e94ddc1e940f) has 3 MIG device(s) gpudra did not "
                               "create: published as they are (static MIG), without dynamic placements, until they "
                               "are destroyed"]


def test_every_shipped_profile_has_an_expectation() -> None:
    from gpudra_driver.nvml import profile_names

    assert sorted(EXPECTED) == profile_names()


def test_mig_enabled_parent_is_not_published_as_a_full_gpu(fake: Callable[[str], FakeNvml]) -> None:
    devices = scan(fake("a100-80gb-mig")).devices
    assert [d.type for d in devices] == ["mig"] * 3
    assert not any(d.name == "gpu-0" for d in devices)


def test_scan_shuts_nvml_down_and_is_repeatable(fake: Callable[[str], FakeNvml]) -> None:
    nvml = fake("dgx-h100")
    first = scan(nvml)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    assert scan(nvml) == first


def test_a_faulty_gpu_is_skipped_and_the_others_published(profile_file: Callable[..., Path]) -> None:
    path = profile_file("dgx-h100", lambda doc: doc["gpus"][3].update(fail=True))
    result = scan(FakeNvml(load_profile(str(path))))
    assert [d.name for d in result.devices] == ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert result.devices == [d for d in DGX_H100 if d.name != "gpu-3"]
    assert len(result.warnings) == 1
    assert "GPU 3 skipped" in result.warnings[0] and "nvmlDeviceGetUUID" in result.warnings[0]


def test_a_gpu_lost_mid_scan_is_skipped(profile_file: Callable[..., Path]) -> None:
    path = profile_file("l4x2", lambda doc: doc["gpus"][0].update(fail={"nvmlDeviceGetMemoryInfo": "GpuIsLost"}))
    result = scan(FakeNvml(load_profile(str(path))))
    assert result.devices == L4X2[1:]
    assert result.warnings == ["GPU 0 skipped: nvmlDeviceGetMemoryInfo failed: GPU is lost"]


def test_a_faulty_mig_device_is_skipped_alone(profile_file: Callable[..., Path]) -> None:
    path = profile_file("a100-80gb-mig", lambda doc: doc["gpus"][0]["migDevices"][1].update(fail=True))
    result = scan(FakeNvml(load_profile(str(path))))
    assert result.devices == [A100_MIG[0], A100_MIG[2]]
    assert len(result.warnings) == 1 and "MIG device 1 on GPU 0 skipped" in result.warnings[0]


def test_mig_enabled_without_mig_devices_publishes_nothing(profile_file: Callable[..., Path]) -> None:
    path = profile_file("a100-80gb-mig", lambda doc: doc["gpus"][0].pop("migDevices"))
    result = scan(FakeNvml(load_profile(str(path))))
    assert result.devices == []
    assert len(result.warnings) == 1 and "MIG mode enabled but no MIG devices" in result.warnings[0]


def test_pending_mig_mode_publishes_by_current_mode(profile_file: Callable[..., Path]) -> None:
    path = profile_file("h200", lambda doc: doc["gpus"][0].update(migModePending="enabled"))
    result = scan(FakeNvml(load_profile(str(path))))
    assert result.devices == H200
    assert len(result.warnings) == 1 and "MIG mode change pending" in result.warnings[0]


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        ("LibraryNotFound", "libnvidia-ml.so.1 was not found"),
        ("DriverNotLoaded", "kernel driver is not loaded"),
        ("NoPermission", "/dev/nvidia"),
        ("Unknown", "nvmlInit failed: Unknown Error"),
    ],
)
def test_nvml_that_cannot_start_is_unavailable(profile_file: Callable[..., Path], error: str, hint: str) -> None:
    path = profile_file("l4x2", lambda doc: doc.update(initError=error))
    with pytest.raises(NvmlUnavailable, match=hint) as info:
        scan(FakeNvml(load_profile(str(path))))
    assert "fake:<profile>" in str(info.value)  # says how to run without GPUs
    assert "\n" not in str(info.value)


def test_nvml_that_cannot_enumerate_is_unavailable(fake: Callable[[str], FakeNvml], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake("l4x2")

    def broken() -> int:
        raise pynvml.NVMLError_Unknown()

    monkeypatch.setattr(nvml, "nvmlDeviceGetCount", broken, raising=False)
    with pytest.raises(NvmlUnavailable, match="cannot enumerate"):
        scan(nvml)
    with pytest.raises(pynvml.NVMLError_Uninitialized):  # still shut down
        nvml.nvmlSystemGetDriverVersion()


def test_numa_falls_back_to_the_given_reader(fake: Callable[[str], FakeNvml]) -> None:
    asked: list[str] = []

    def reader(bus_id: str) -> int | None:
        asked.append(bus_id)
        return 1 if bus_id.endswith("03.0") else None

    devices = scan(fake("l4x2"), numa_node_of=reader).devices
    assert asked == ["0000:00:03.0", "0000:00:04.0"]
    assert [d.attributes.get("numaNode") for d in devices] == [I(1), None]
    assert [d.attributes.get(NUMA) for d in devices] == [I(1), None]  # the standard one with it
    # NVML's answer wins when it has one
    assert scan(fake("dgx-h100"), numa_node_of=lambda _: 9).devices == DGX_H100


def test_numa_node_from_sysfs(tmp_path: Path) -> None:
    for bus, value in [("0000:3b:00.0", "2\n"), ("0000:00:06.0", "-1\n"), ("0000:00:07.0", "junk")]:
        (tmp_path / "bus/pci/devices" / bus).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / bus / "numa_node").write_text(value)
    assert numa_node_from_sysfs("0000:3b:00.0", tmp_path) == 2
    assert numa_node_from_sysfs("0000:00:06.0", tmp_path) is None
    assert numa_node_from_sysfs("0000:00:07.0", tmp_path) is None
    assert numa_node_from_sysfs("0000:00:08.0", tmp_path) is None


def _pci_device(sysfs: Path, path: str, *, absolute: bool = False) -> None:
    """A device at ``devices/<path>`` and its ``bus/pci/devices`` link, relative as the kernel makes it."""
    device = sysfs / "devices" / path
    device.mkdir(parents=True)
    (sysfs / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
    link = sysfs / "bus/pci/devices" / device.name
    link.symlink_to(device if absolute else Path("../../..") / "devices" / path)


def test_pcie_root_from_sysfs(tmp_path: Path) -> None:
    _pci_device(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0")  # behind a switch
    _pci_device(tmp_path, "pci0000:b0/0000:b0:00.0")  # on the root bus itself
    _pci_device(tmp_path, "pci0001:40/0001:40:02.0/0001:41:00.0", absolute=True)
    _pci_device(tmp_path, "platform/soc/0000:05:00.0")  # not under a PCI root complex
    (tmp_path / "devices/pci0000:00/0000:03:00.0").mkdir()
    (tmp_path / "bus/pci/devices/0000:04:00.0").symlink_to("../../../devices/pci0000:00/0000:03:00.0")  # elsewhere
    (tmp_path / "bus/pci/devices/0000:06:00.0").mkdir()  # a directory, not a link: no tree to read
    assert pcie_root_from_sysfs("0000:02:00.0", tmp_path) == "pci0000:00"
    assert pcie_root_from_sysfs("0000:b0:00.0", tmp_path) == "pci0000:b0"
    assert pcie_root_from_sysfs("0001:41:00.0", tmp_path) == "pci0001:40"
    assert pcie_root_from_sysfs("0000:05:00.0", tmp_path) is None
    assert pcie_root_from_sysfs("0000:04:00.0", tmp_path) is None
    assert pcie_root_from_sysfs("0000:06:00.0", tmp_path) is None
    assert pcie_root_from_sysfs("0000:07:00.0", tmp_path) is None  # no such device


@pytest.mark.parametrize(("profile", "mig"), [("dgx-h100", "static"), ("a100-80gb-mig", "static"),
                                              ("h100-dynamic-mig", "dynamic")])
def test_standard_topology_attributes_on_gpus_and_mig_devices(fake: Callable[[str], FakeNvml], profile: str,
                                                               mig: str, tmp_path: Path) -> None:
    """Whole GPUs, static MIG devices and dynamic placements carry their GPU's standard numaNode
    (the driver's numaNode's value) and pcieRoot, and stay within the per-device limit."""
    from gpudra_core import limits
    from gpudra_driver.publishing.slices import build_slices

    buses = {d.attr(PCI) for d in EXPECTED[profile]}
    for n, bus in enumerate(sorted(buses)):
        _pci_device(tmp_path, f"pci0000:{n:02x}/0000:{n:02x}:01.0/{bus}")
    devices = scan(fake(profile), mig=mig, pcie_root_of=lambda bus: pcie_root_from_sysfs(bus, tmp_path)).devices  # type: ignore[arg-type]
    assert devices and len(buses) > 0
    roots = {bus: f"pci0000:{n:02x}" for n, bus in enumerate(sorted(buses))}
    for device in devices:
        assert device.attributes[NUMA] == device.attributes["numaNode"]
        assert device.attributes[PCIE_ROOT] == S(roots[str(device.attr(PCI))])
        assert len(device.attributes) + len(device.capacity) <= limits.MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE
    assert build_slices("gpu.gpudra.io", "node-a", "uid", 1, devices)  # which checks every limit
    # without a reader (the simulated NVML's case) there is no pcieRoot, and nothing else changes
    assert scan(fake(profile), mig=mig).devices == EXPECTED[profile]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("gi", "ci", "mem_mib", "parent_mib", "expected"),
    [
        (1, 1, 9728, 81920, "1g.10gb"),  # A100 80GB
        (2, 2, 19968, 81920, "2g.20gb"),
        (3, 3, 40192, 81920, "3g.40gb"),
        (4, 4, 40192, 81920, "4g.40gb"),
        (7, 7, 80896, 81920, "7g.80gb"),
        (3, 1, 40192, 81920, "1c.3g.40gb"),
        (1, 1, 4864, 40960, "1g.5gb"),  # A100 40GB
        (3, 3, 20096, 40960, "3g.20gb"),
        (1, 1, 9856, 81559, "1g.10gb"),  # H100 80GB
        (1, 1, 16384, 143771, "1g.18gb"),  # H200
    ],
)
def test_mig_profile_name(gi: int, ci: int, mem_mib: int, parent_mib: int, expected: str) -> None:
    assert mig_profile_name(gi, ci, mem_mib, parent_mib * MIB) == expected


def test_discover_logs_warnings(profile_file: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    path = profile_file("l4x2", lambda doc: doc["gpus"][1].update(fail=True))
    with caplog.at_level(logging.WARNING, logger="gpudra_driver.discovery"):
        devices = discover(FakeNvml(load_profile(str(path))))
    assert [d.name for d in devices] == ["gpu-0"]
    assert any("GPU 1 skipped" in r.getMessage() for r in caplog.records)


def test_old_pynvml_bytes_are_decoded(fake: Callable[[str], FakeNvml], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml: Any = fake("h200")
    original = FakeNvml.nvmlDeviceGetName
    monkeypatch.setattr(FakeNvml, "nvmlDeviceGetName", lambda self, h: original(self, h).encode())
    assert scan(nvml).devices == H200
