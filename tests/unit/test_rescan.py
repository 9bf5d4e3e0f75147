"""The agent's rescan loop on a node without GPUs: a CPU-only node (no NVIDIA device on the PCI
bus) publishes nothing and turns ready, a GPU node whose NVML fails keeps failing, and both say so
in a Node event."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from gpudra_core.devicemodel import Device
from gpudra_driver.discovery import nvidia_gpus_on_pci
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.publishing.rescan import NO_GPU_ON_PCI, Rescanner


def pci(sysfs: Path, address: str, vendor: str, pci_class: str) -> None:
    device = sysfs / "bus/pci/devices" / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(pci_class + "\n")


def test_nvidia_gpus_are_told_from_other_pci_devices(tmp_path: Path) -> None:
    pci(tmp_path, "0000:00:02.0", "0x8086", "0x030000")  # an Intel iGPU
    pci(tmp_path, "0000:3b:00.0", "0x10de", "0x030200")  # an H100 (3D controller)
    pci(tmp_path, "0000:3b:00.1", "0x10de", "0x040300")  # its audio function: not a GPU
    pci(tmp_path, "0000:86:00.0", "0x10de", "0x030000")  # a VGA-class NVIDIA GPU
    assert nvidia_gpus_on_pci(tmp_path) == ["0000:3b:00.0", "0000:86:00.0"]
    assert nvidia_gpus_on_pci(tmp_path / "nope") is None  # unreadable: no evidence of a CPU-only node


class Recorder:
    def __init__(self) -> None:
        self.published: list[list[str]] = []
        self.events: list[tuple[str, str, str]] = []

    def publish(self, devices: Sequence[Device]) -> bool:
        self.published.append([d.name for d in devices])
        return True

    async def report(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def rescanner(tmp_path: Path, recorder: Recorder) -> Rescanner:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)  # a root without the NVIDIA driver
    return Rescanner("real", recorder.publish, driver_root=DriverRoot.at(str(root)), report=recorder.report,
                     sysfs=tmp_path / "sys")


def test_a_cpu_only_node_publishes_nothing_says_so_once_and_does_not_fail(tmp_path: Path) -> None:
    recorder = Recorder()
    pci(tmp_path / "sys", "0000:00:02.0", "0x8086", "0x030000")  # an Intel iGPU, no NVIDIA device
    scanner = rescanner(tmp_path, recorder)
    assert asyncio.run(scanner.scan_once()) and asyncio.run(scanner.scan_once())
    assert recorder.published == [[], []]  # devices known: the agent registers and turns ready
    (event,) = recorder.events
    assert event[:2] == ("Warning", "NoGpusFound") and event[2].startswith(NO_GPU_ON_PCI)
    assert "libnvidia-ml.so.1 was not found" in event[2]


def test_a_gpu_node_whose_driver_is_missing_keeps_failing(tmp_path: Path) -> None:
    recorder = Recorder()
    pci(tmp_path / "sys", "0000:3b:00.0", "0x10de", "0x030200")
    scanner = rescanner(tmp_path, recorder)
    assert not asyncio.run(scanner.scan_once())
    assert recorder.published == []
    (event,) = recorder.events
    assert event[:2] == ("Warning", "GpuDiscoveryFailed") and "libnvidia-ml.so.1 was not found" in event[2]


def test_an_unreadable_pci_bus_is_no_evidence_of_a_cpu_only_node(tmp_path: Path) -> None:
    """A wrong --sysfs, or a bus that cannot be listed, must not turn an NVML failure into an empty
    pool: the failure stands (and the last published devices with it)."""
    recorder = Recorder()
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    scanner = Rescanner("real", recorder.publish, driver_root=DriverRoot.at(str(root)), report=recorder.report,
                        sysfs=tmp_path / "no-such-sysfs")
    assert not asyncio.run(scanner.scan_once())
    assert recorder.published == [] and recorder.events[0][1] == "GpuDiscoveryFailed"


def test_sysfs_readers_describe_real_gpus_only(tmp_path: Path) -> None:
    """The sysfs fallbacks (NUMA node, PCIe root) describe this machine's PCI devices, which a
    simulated GPU is not: a fake: spec publishes neither from them."""
    recorder = Recorder()

    def numa(bus_id: str) -> int:
        return 0

    def root(bus_id: str) -> str:
        return "pci0000:00"

    fake = Rescanner("fake:l4x2", recorder.publish, numa_node_of=numa, pcie_root_of=root)
    assert (fake.numa_node_of, fake.pcie_root_of) == (None, None)
    asyncio.run(fake.scan_once())
    assert recorder.published == [["gpu-0", "gpu-1"]]
    real = Rescanner("real", recorder.publish, numa_node_of=numa, pcie_root_of=root)
    assert (real.numa_node_of, real.pcie_root_of) == (numa, root)
