"""The health monitor's shell on the NVML simulator (no cluster): its event thread, the probe, what
it hands the publisher, and how it stops."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from gpudra_core.devicemodel import Device
from gpudra_driver.discovery import scan
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.devicehealth.plan import Policy
from gpudra_driver.devicehealth.feed import HealthFeed
from gpudra_driver.devicehealth.apply import HealthMonitor
from gpudra_driver.nvml import load_nvml
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.waiting import wait_for

D = "gpu.example.com"
PROFILE = "l4x2"


class Harness:
    def __init__(self, root: Path, profile: str = PROFILE) -> None:
        self.root = root
        self.feed = HealthFeed("node-a", timeout=30)
        self.published: list[list[Device]] = []
        self.reports: list[tuple[str, str, str]] = []
        nvml = load_nvml(f"fake:{profile}", DriverRoot.at(str(root)))
        self.devices = scan(nvml).devices
        self.uuid = {d.name: str(d.attributes["uuid"].value) for d in self.devices}
        self.monitor = HealthMonitor(nvml_spec=f"fake:{profile}", driver_root=DriverRoot.at(str(root)),
                                     policy=Policy(driver=D, quiet_period=600), publish=self.publish,
                                     report=self.report, probe_interval=0.2, wait_timeout=0.1, feed=self.feed)

    def publish(self, devices: Sequence[Device]) -> bool:
        changed = not self.published or self.published[-1] != list(devices)
        if changed:
            self.published.append(list(devices))
        return changed

    async def report(self, kind: str, reason: str, message: str) -> None:
        self.reports.append((kind, reason, message))

    def taints(self, name: str) -> set[tuple[str, str, str]]:
        last = {d.name: d for d in self.published[-1]} if self.published else {}
        return {(t.key, t.value, t.effect) for t in last[name].taints} if name in last else set()

    async def until(self, check: object, what: str) -> None:
        async def probe() -> bool:
            return bool(check())  # type: ignore[operator]

        await wait_for(probe, timeout=10, what=what)


@pytest_asyncio.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path / "root")
    task = asyncio.create_task(h.monitor.run())
    h.monitor.set_devices(h.devices)
    yield h
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "nvml-events" not in {t.name for t in threading.enumerate()}, "the event thread outlived the monitor"


async def test_nothing_is_published_before_the_gpus_were_probed_then_events_taint(harness: Harness) -> None:
    await harness.until(lambda: harness.published, "the first publish")
    assert harness.monitor.probed >= set(harness.uuid.values())  # the probe came first
    assert all(not d.taints for d in harness.published[0])
    mockstate.inject_xid(harness.root, harness.uuid["gpu-1"], 48)
    await harness.until(lambda: harness.taints("gpu-1"), "gpu-1 tainted")
    assert harness.taints("gpu-1") == {(f"{D}/xid", "48", "NoSchedule")} and harness.taints("gpu-0") == set()
    await harness.until(lambda: harness.reports, "a report")
    (kind, reason, message), = harness.reports
    assert (kind, reason) == ("Warning", "DeviceUnhealthy") and "XID 48: double-bit ECC error" in message


async def test_the_kubelets_feed_gets_every_probe_round_and_each_change(harness: Harness) -> None:
    """What the kubelet plugin streams (KEP-4680): nothing before the GPUs were probed (the first
    list is the first publish's health), then a list each round, its time refreshed, and an
    unhealthy device as soon as its event came."""
    watch = harness.feed.watch()
    first = await asyncio.wait_for(anext(watch), 10)
    assert harness.published and harness.monitor.probed >= set(harness.uuid.values())
    assert [(d.pool, d.device, d.health) for d in first] == [("node-a", "gpu-0", "HEALTHY"), ("node-a", "gpu-1", "HEALTHY")]
    later = await asyncio.wait_for(anext(watch), 10)  # the next probe round, nothing changed
    assert [d.health for d in later] == ["HEALTHY", "HEALTHY"] and later[0].updated >= first[0].updated
    mockstate.inject_xid(harness.root, harness.uuid["gpu-1"], 48)

    async def unhealthy() -> bool:
        return any(d.health == "UNHEALTHY" for d in await asyncio.wait_for(anext(watch), 10))

    await wait_for(unhealthy, timeout=10, what="gpu-1 unhealthy in the feed")
    assert [(d.device, d.health) for d in harness.feed.devices or ()] == [("gpu-0", "HEALTHY"), ("gpu-1", "UNHEALTHY")]
    assert "XID 48: double-bit ECC error" in (harness.feed.devices or ())[1].message
    await watch.aclose()


async def test_a_storm_is_one_publish(harness: Harness) -> None:
    await harness.until(lambda: harness.published, "the first publish")
    for _ in range(3000):
        mockstate.inject_xid(harness.root, harness.uuid["gpu-0"], 119)
    mockstate.inject_xid(harness.root, harness.uuid["gpu-1"], 13)  # its end
    await harness.until(lambda: harness.taints("gpu-1"), "the storm's end")
    assert harness.taints("gpu-0") == {(f"{D}/xid", "119", "NoSchedule")}
    assert len(harness.published) <= 3  # the first, then gpu-0's taint and gpu-1's (or both at once)


async def test_a_lost_gpu_is_probed_at_once_and_recovers(harness: Harness) -> None:
    await harness.until(lambda: harness.published, "the first publish")
    mockstate.lose_gpu(harness.root, harness.uuid["gpu-0"])
    await harness.until(lambda: harness.taints("gpu-0"), "gpu-0 lost")
    assert harness.taints("gpu-0") == {(f"{D}/gpu-lost", "", "NoSchedule")}
    harness.monitor.set_devices(harness.devices[1:])  # discovery no longer sees it: still published
    assert [d.name for d in harness.published[-1]] == ["gpu-1", "gpu-0"]
    mockstate.recover_gpu(harness.root, harness.uuid["gpu-0"])
    await harness.until(lambda: not harness.taints("gpu-0"), "gpu-0 recovered")
    assert ("Normal", "DeviceRecovered") in {(k, r) for k, r, _ in harness.reports}


async def test_omit_mode_when_the_api_server_drops_taints(harness: Harness) -> None:
    await harness.until(lambda: harness.published, "the first publish")
    harness.monitor.taints_dropped()
    mockstate.inject_xid(harness.root, harness.uuid["gpu-0"], 48)
    await harness.until(lambda: [d.name for d in harness.published[-1]] == ["gpu-1"], "gpu-0 left out")
    assert not harness.published[-1][0].taints
    assert ("Warning", "DeviceTaintsUnsupported") in {(k, r) for k, r, _ in harness.reports}


async def test_a_gpu_without_events_is_unmonitored_and_still_probed(tmp_path: Path) -> None:
    from importlib import resources

    import yaml

    doc = yaml.safe_load((resources.files("gpudra_driver") / "profiles" / f"{PROFILE}.yaml").read_text())
    doc["gpus"][0]["fail"] = {"nvmlDeviceGetSupportedEventTypes": "NotSupported"}
    profile = tmp_path / "no-events.yaml"
    profile.write_text(yaml.safe_dump(doc))
    h = Harness(tmp_path / "root", str(profile))
    task = asyncio.create_task(h.monitor.run())
    try:
        h.monitor.set_devices(h.devices)
        await h.until(lambda: h.taints("gpu-0"), "gpu-0 unmonitored")
        assert h.taints("gpu-0") == {(f"{D}/unmonitored", "", "None")} and h.taints("gpu-1") == set()
        mockstate.set_recovery_action(h.root, h.uuid["gpu-0"], 1)  # the probe still watches it
        await h.until(lambda: (f"{D}/recovery-action", "gpu-reset", "NoSchedule") in h.taints("gpu-0"),
                      "gpu-0 needs a reset")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_step_of_the_wall_clock_does_not_clear_a_fatal_xid_early(harness: Harness,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The quiet period (600 s here) runs on the monotonic clock: the node's clock stepped an hour
    forward (NTP, a restored VM) dates the next probe rounds, and the taint stays."""
    await harness.until(lambda: harness.published, "the first publish")
    mockstate.inject_xid(harness.root, harness.uuid["gpu-1"], 48)
    await harness.until(lambda: harness.taints("gpu-1"), "gpu-1 tainted")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    await harness.until(lambda: harness.feed.devices and harness.feed.devices[0].updated > real() + 3000,
                        "a probe round on the stepped wall clock")
    assert harness.taints("gpu-1") == {(f"{D}/xid", "48", "NoSchedule")}
    assert {d.device: d.health for d in harness.feed.devices}["gpu-1"] == "UNHEALTHY"
