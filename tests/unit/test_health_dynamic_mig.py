"""Device health on dynamic MIG, the monitor's shell on the NVML simulator (no cluster): an XID
NVML attributes to an instance the plugin created is placed by the checkpoint's placements when it
is folded in, and the published placements, the kubelet's health feed (KEP-4680) and the
transitions (Node and pod events) all name the placements on that instance's memory; a GPU-wide
XID names all of them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from gpudra_core.devicemodel import Device
from gpudra_driver.devicehealth.apply import HealthMonitor
from gpudra_driver.devicehealth.feed import HealthFeed
from gpudra_driver.devicehealth.plan import Policy, Transition
from gpudra_driver.discovery import scan
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.nvml import load_nvml
from gpudra_driver.plugin.miginstances import MigInstances
from gpudra_driver.plugin.model import MigPlacement
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.waiting import wait_for

D = "gpu.example.com"
SPEC = "fake:h100-dynamic-mig"  # two H100 80GB HBM3, MIG enabled, no MIG devices
AT0_1G = {"gpu-0-mig-1g10gb-at0", "gpu-0-mig-1g10gbme-at0", "gpu-0-mig-1g20gb-at0", "gpu-0-mig-2g20gb-at0",
          "gpu-0-mig-3g40gb-at0", "gpu-0-mig-4g40gb-at0", "gpu-0-mig-7g80gb-at0"}


async def test_an_xid_on_a_dynamic_instance_taints_the_placements_on_its_memory_everywhere_they_are_named(
        tmp_path: Path) -> None:
    state_root = tmp_path / "root"
    root = DriverRoot.at(str(state_root))
    devices = scan(load_nvml(SPEC, root), mig="dynamic").devices
    placements = {d.name for d in devices if "-mig-" in d.name}
    assert len(placements) == 50 and AT0_1G <= placements
    # where the GPU is published whole as well, the whole GPU holds that memory too
    whole = {d.name for d in devices if d.name == "gpu-0"}
    parent = str(next(d for d in devices if "-mig-" in d.name).attributes["parentUUID"].value)
    instances = MigInstances(lambda: load_nvml(SPEC, root), lambda minor, gi, ci: 0)
    made, mig_uuid, _ = instances.create(MigPlacement(parent, "1g.10gb", 0, 1, 0))
    held = [made]  # what the checkpoint names: the claim's placement with its IDs
    published: list[list[Device]] = []
    changes: list[Transition] = []

    def publish(found: Sequence[Device]) -> bool:
        published.append(list(found))
        return True

    async def told(change: Transition) -> None:
        changes.append(change)

    feed = HealthFeed("node-a", timeout=30)
    monitor = HealthMonitor(nvml_spec=SPEC, driver_root=root, policy=Policy(driver=D, quiet_period=600),
                            publish=publish, probe_interval=0.2, wait_timeout=0.1, feed=feed,
                            on_transition=told, mig_instances=lambda: list(held))

    def tainted() -> set[str]:
        return {d.name for d in published[-1] if d.taints} if published else set()

    def unhealthy_in_feed() -> set[str]:
        return {h.device for h in feed.devices or () if h.health == "UNHEALTHY"}

    async def until(check: object, what: str) -> None:
        async def probe() -> bool:
            return bool(check())  # type: ignore[operator]

        await wait_for(probe, timeout=10, what=what)

    task = asyncio.create_task(monitor.run())
    try:
        monitor.set_devices(devices)
        await until(lambda: published and feed.devices, "the first publish and feed")
        assert tainted() == set()

        mockstate.inject_xid(state_root, mig_uuid, 94)  # contained: the instance's memory only
        await until(lambda: tainted() == AT0_1G | whole and unhealthy_in_feed() == AT0_1G | whole,
                    "slice 0's placements tainted")
        sick = {d.name: d for d in published[-1]}["gpu-0-mig-1g10gb-at0"]
        assert [(t.key, t.value, t.effect) for t in sick.taints] == [(f"{D}/xid", "94", "NoSchedule")]
        await until(lambda: {c.device for c in changes} == AT0_1G | whole, "a transition per device")
        assert all(c.unhealthy and "XID 94: contained ECC error" in c.message for c in changes)

        # the claim unprepared: the instance gone, the taint stays on the same memory
        instances.destroy(made, mig_uuid)
        held.clear()
        mockstate.inject_xid(state_root, parent, 79)  # off the bus: the whole GPU, every placement
        every = {d.name for d in devices if d.name.startswith("gpu-0-")} | whole
        await until(lambda: tainted() == every and unhealthy_in_feed() == every, "all of gpu-0 tainted")
        assert {d.name for d in published[-1] if d.name.startswith("gpu-1-") and d.taints} == set()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# Runs against whatever NVML ``n`` is: the plugin's own code makes a claim's 1g.10gb instance at
# memory slice 0, then (that one destroyed) at slice 6; an XID 94 on each instance's MIG UUID is
# read back from an event set on the parent GPU.
SCENARIO = r'''
def scenario(n, inject):
    from gpudra_driver.plugin.miginstances import MigInstances
    from gpudra_driver.plugin.model import MigPlacement

    n.nvmlInit()
    gpu = n.nvmlDeviceGetHandleByIndex(0)
    parent = n.nvmlDeviceGetUUID(gpu)
    events = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(gpu, 0x8 | 0x2, events)
    instances = MigInstances(lambda: n, lambda minor, gi, ci: 0)
    out = []
    for start in (0, 6):
        made, uuid, _ = instances.create(MigPlacement(parent, "1g.10gb", start, 1, 0))
        inject("xid", uuid, 94)
        d = n.nvmlEventSetWait_v2(events, 5000)
        out.append([start, made.gi, made.ci, n.nvmlDeviceGetUUID(d.device) == parent, d.eventType, d.eventData,
                    d.gpuInstanceId, d.computeInstanceId])
        instances.destroy(made, uuid)
    n.nvmlEventSetFree(events)
    n.nvmlShutdown()
    return out
'''

CHILD = SCENARIO + r'''
import json, sys
from pathlib import Path
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.nvml import load_nvml
from gpudra_dev.localcluster import mockstate

root = Path(sys.argv[1])
print(json.dumps(scenario(load_nvml("real", DriverRoot.at(str(root))),
                          lambda kind, uuid, xid: mockstate.inject_xid(root, uuid, xid))))
'''


def test_real_pynvml_on_the_mock_and_the_simulator_attribute_an_xid_to_the_dynamic_instance(
        mock_lib: Path, tmp_path: Path) -> None:
    """What the monitor relies on, at the NVML boundary: an XID on an instance the plugin made
    comes on the parent GPU with that instance's GPU and compute instance IDs, whichever IDs NVML
    gave it; the real pynvml on the mock library and the simulator agree."""
    import json
    import subprocess
    import sys

    from gpudra_dev.localcluster.fakedriverroot import make_driver_root

    real_root = make_driver_root(tmp_path / "real", "h100-dynamic-mig", library=mock_lib, device_nodes=False)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(real_root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout)

    sim_root = tmp_path / "sim"
    namespace: dict[str, object] = {}
    exec(SCENARIO, namespace)  # noqa: S102 - the same scenario text the child ran
    sim = namespace["scenario"](load_nvml(SPEC, DriverRoot.at(str(sim_root))),  # type: ignore[operator]
                                lambda kind, uuid, xid: mockstate.inject_xid(sim_root, uuid, xid))
    assert real == json.loads(json.dumps(sim))
    for start, gi, ci, on_parent, kind, xid, event_gi, event_ci in real:
        assert (on_parent, kind, xid, event_gi, event_ci) == (True, 0x8, 94, gi, ci), start
