"""Device health end to end: the agent as a process on the real pynvml against the mock
libnvidia-ml.so.1, health injected at run time into the mock's driver root (mockstate), the real API
server and the real kube-scheduler deciding where claims go.

Device taints (KEP-5055) are beta and on in 1.36, GA in 1.37; in 1.35 the DRADeviceTaints gate is
off and the API server drops them, so the agent leaves unhealthy GPUs out of its slices instead.
The expectations follow the release under test: CI runs this file on 1.35.4 with the whole suite,
and on 1.36.3 and 1.37.2 (`make test KUBE_VERSION=... PYTEST_ARGS=<this file>`)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio
from seedobjects import published_devices

from gpudra_core.kubeapi import Kube, Obj, ResourceType, resource_type
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.agents import AgentProcess
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.waiting import ConditionTimeout, wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")
PROFILE = "l4x2"  # two GPUs, no MIG
GPU_RESET = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
# fast enough for a test: a probe every half second, an event's taint gone one second after it
HEALTH_FLAGS = ("--health-probe-interval", "0.5", "--health-quiet-period", "1")


async def minor_version(kube: Kube) -> int:
    return int("".join(ch for ch in (await kube.request("GET", "/version"))["minor"] if ch.isdigit()))


async def devices_of(kube: Kube, driver: str, node: str) -> dict[str, Obj]:
    slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def taints(device: Obj | None) -> set[tuple[str, str, str]]:
    """(key, value, effect) of each taint; timeAdded is checked where it matters."""
    return {(t["key"], t.get("value", ""), t["effect"]) for t in (device or {}).get("taints") or []}


async def until_devices(kube: Kube, driver: str, node: str, check: Callable[[dict[str, Obj]], bool],
                        what: str, timeout: float = 30) -> dict[str, Obj]:
    async def probe() -> tuple[dict[str, Obj]] | None:  # a tuple: no devices at all is an answer too
        found = await devices_of(kube, driver, node)
        return (found,) if check(found) else None

    (devices,) = await wait_for(probe, timeout=timeout, what=what)
    return devices


class Node:
    """One fake Node with an agent on the mock NVML, its driver root at hand for injection."""

    def __init__(self, kube: Kube, name: str, driver: str, root: Path, agent: AgentProcess, taints_kept: bool) -> None:
        self.kube, self.name, self.driver, self.root, self.agent = kube, name, driver, root, agent
        self.taints_kept = taints_kept
        self.uuid: dict[str, str] = {}

    async def devices(self) -> dict[str, Obj]:
        return await devices_of(self.kube, self.driver, self.name)

    async def until(self, check: Callable[[dict[str, Obj]], bool], what: str, timeout: float = 30) -> dict[str, Obj]:
        try:
            return await until_devices(self.kube, self.driver, self.name, check, what, timeout)
        except ConditionTimeout as error:
            raise ConditionTimeout(f"{error}\nagent log:\n{self.agent.log_tail(60)}") from None

    async def events(self, reason: str) -> list[Obj]:
        return [e for e in await events_about(self.kube, self.name) if e.get("reason") == reason]


@pytest_asyncio.fixture(loop_scope="session")
async def gpu_node(kube: Kube, fake_nodes: Any, agents: Callable[..., AgentProcess], tmp_path: Path
                   ) -> AsyncIterator[Callable[..., Any]]:
    made: list[str] = []

    async def make(driver: str, *extra_args: str, profile: str = PROFILE, count: int = 2,
                   rescan_interval: float = 60.0) -> Node:
        name = (await fake_nodes("health"))["metadata"]["name"]
        root = make_driver_root(tmp_path / f"root-{len(made)}", profile)
        agent = agents(name, f"mock:{profile}", driver, driver_root=root, extra_args=(*HEALTH_FLAGS, *extra_args),
                       rescan_interval=rescan_interval)
        devices = await published_devices(kube, driver, name, count)
        node = Node(kube, name, driver, root, agent, await minor_version(kube) >= 36)
        node.uuid = {n: d["attributes"]["uuid"]["string"] for n, d in devices.items()}
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                           "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
        made.append(driver)
        return node

    yield make
    for name in made:
        await kube.delete(CLASS, name)


async def schedule(kube: Kube, namespace: str, node: Node, tolerations: list[Obj] | None = None,
                   wait: bool = True) -> str:
    """A claim for one GPU of the node's class and a pod on the node using it; the device the
    scheduler allocated (``wait=False``: the claim's name, without waiting)."""
    name = f"health-{secrets.token_hex(3)}"
    exactly: Obj = {"deviceClassName": node.driver, **({"tolerations": tolerations} if tolerations else {})}
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": name, "namespace": namespace},
                       "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})
    await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                       "spec": {"nodeSelector": {"kubernetes.io/hostname": node.name},
                                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                                "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                "resources": {"claims": [{"name": "gpu"}]}}]}})

    if not wait:
        return name

    async def allocated() -> str | None:
        claim = await kube.get(CLAIM, name, namespace)
        results = (((claim or {}).get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        return results[0]["device"] if results else None

    return await wait_for(allocated, timeout=60, what=f"claim {name} allocated by the scheduler")


# -- a fatal XID, and recovery --------------------------------------------------------------------

async def test_a_fatal_xid_takes_the_gpu_off_the_market_until_it_recovers(
        kube: Kube, namespace: str, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"h{secrets.token_hex(4)}.gpudra.io")
    sick = node.uuid["gpu-0"]
    xid = (f"{node.driver}/xid", "48", "NoSchedule")
    reset = (f"{node.driver}/recovery-action", "gpu-reset", "NoSchedule")

    mockstate.set_recovery_action(node.root, sick, GPU_RESET)  # what the driver reports after XID 48
    injected = time.monotonic()
    mockstate.inject_xid(node.root, sick, 48)
    if node.taints_kept:
        devices = await node.until(lambda d: {xid, reset} <= taints(d.get("gpu-0")), "gpu-0 tainted", timeout=2)
        assert time.monotonic() - injected < 2
        assert taints(devices["gpu-1"]) == set()
        for taint in devices["gpu-0"]["taints"]:  # whole seconds, when it began
            assert taint["timeAdded"].endswith("Z") and len(taint["timeAdded"]) == len("2026-12-02T09:00:00Z")
    else:  # 1.35: the unhealthy GPU is left out, and the agent says why
        devices = await node.until(lambda d: set(d) == {"gpu-1"}, "gpu-0 left out of the slice", timeout=2)
        assert time.monotonic() - injected < 2
        assert "taints" not in devices["gpu-1"]
        (unsupported,) = await node.events("DeviceTaintsUnsupported")
        assert "DRADeviceTaints feature gate is off" in unsupported["message"]

    # the scheduler allocates the healthy GPU
    assert await schedule(kube, namespace, node) == "gpu-1"
    (unhealthy,) = await wait_for(lambda: node.events("DeviceUnhealthy"), timeout=10, what="a DeviceUnhealthy event")
    assert unhealthy["type"] == "Warning"
    assert f"gpu-0 ({sick}) is unhealthy" in unhealthy["message"]
    assert "XID 48: double-bit ECC error" in unhealthy["message"]

    # reset: recovery action none, the handle resolves -> the taint goes without a restart
    mockstate.recover_gpu(node.root, sick)
    if node.taints_kept:
        await node.until(lambda d: "gpu-0" in d and taints(d["gpu-0"]) == set(), "gpu-0 untainted")
    else:
        await node.until(lambda d: set(d) == {"gpu-0", "gpu-1"}, "gpu-0 published again")
    assert await schedule(kube, namespace, node) == "gpu-0"  # allocatable again
    (recovered,) = await wait_for(lambda: node.events("DeviceRecovered"), timeout=10, what="a DeviceRecovered event")
    assert recovered["type"] == "Normal" and f"gpu-0 ({sick}) recovered" in recovered["message"]
    assert node.agent.process.poll() is None  # no restart anywhere


# -- an informational XID -------------------------------------------------------------------------

async def test_an_informational_xid_never_keeps_a_gpu_from_being_scheduled(
        kube: Kube, namespace: str, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"i{secrets.token_hex(4)}.gpudra.io", "--health-quiet-period", "600")
    mockstate.inject_xid(node.root, node.uuid["gpu-0"], 13)  # graphics engine exception: the application's
    # a fatal one on the other GPU afterwards: once it shows, the XID 13 before it was handled too
    mockstate.inject_xid(node.root, node.uuid["gpu-1"], 79)
    if node.taints_kept:
        devices = await node.until(lambda d: (f"{node.driver}/xid", "79", "NoSchedule") in taints(d.get("gpu-1")),
                                   "gpu-1 tainted with XID 79")
        assert taints(devices["gpu-0"]) == {(f"{node.driver}/xid", "13", "None")}
    else:
        devices = await node.until(lambda d: "gpu-1" not in d, "gpu-1 left out")
        assert "gpu-0" in devices
    assert await schedule(kube, namespace, node) == "gpu-0"
    assert not [e for e in await node.events("DeviceUnhealthy") if "gpu-0" in e["message"]]


# -- a lost GPU, MIG, a storm --------------------------------------------------------------------

async def test_a_lost_gpu_stays_published_tainted_while_discovery_cannot_see_it(
        kube: Kube, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"l{secrets.token_hex(4)}.gpudra.io", rescan_interval=0.3)
    lost = (f"{node.driver}/gpu-lost", "", "NoSchedule")
    injected = time.monotonic()
    mockstate.lose_gpu(node.root, node.uuid["gpu-0"])
    if node.taints_kept:
        await node.until(lambda d: taints(d.get("gpu-0")) == {lost}, "gpu-0 tainted gpu-lost", timeout=2)
    else:
        await node.until(lambda d: set(d) == {"gpu-1"}, "gpu-0 left out", timeout=2)
    assert time.monotonic() - injected < 2
    await logged(node.agent, "GPU 0 skipped")  # discovery no longer enumerates it...
    mockstate.inject_xid(node.root, node.uuid["gpu-1"], 13)  # ...and after one more event round trip:
    if node.taints_kept:  # still there, tainted, not silently gone
        devices = await node.until(lambda d: bool(taints(d.get("gpu-1"))), "gpu-1's informational taint")
        assert taints(devices.get("gpu-0")) == {lost}
    mockstate.recover_gpu(node.root, node.uuid["gpu-0"])
    await node.until(lambda d: "gpu-0" in d and not taints(d["gpu-0"]), "gpu-0 back, untainted")


async def test_an_xid_on_a_mig_device_taints_that_mig_device_only(
        kube: Kube, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"m{secrets.token_hex(4)}.gpudra.io", profile="a100-80gb-mig", count=3)
    (sick,) = [n for n in node.uuid if n.endswith("-9-0")]  # the 1g.10gb in GPU instance 9
    mockstate.inject_xid(node.root, node.uuid[sick], 94)
    if node.taints_kept:
        devices = await node.until(lambda d: bool(taints(d.get(sick))), f"{sick} tainted")
        assert taints(devices[sick]) == {(f"{node.driver}/xid", "94", "NoSchedule")}
        assert [n for n, d in devices.items() if taints(d)] == [sick]
    else:
        devices = await node.until(lambda d: sick not in d, f"{sick} left out")
        assert len(devices) == 2


async def test_a_storm_of_xids_is_one_slice_write(kube: Kube, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"s{secrets.token_hex(4)}.gpudra.io", "--health-quiet-period", "600")
    generation = await pool_generation(kube, node)
    for _ in range(2000):  # a GPU stuck in a loop of the same fatal XID
        mockstate.inject_xid(node.root, node.uuid["gpu-0"], 119)
    mockstate.inject_xid(node.root, node.uuid["gpu-1"], 79)  # the end of the storm, when this shows
    if node.taints_kept:
        devices = await node.until(lambda d: bool(taints(d.get("gpu-1"))), "the storm's end")
        assert taints(devices["gpu-0"]) == {(f"{node.driver}/xid", "119", "NoSchedule")}
    else:
        await node.until(lambda d: not d, "both GPUs left out")
    assert await pool_generation(kube, node) - generation <= 2  # gpu-0's taint and gpu-1's, or both at once


async def pool_generation(kube: Kube, node: Node) -> int:
    slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={node.driver},spec.nodeName={node.name}")]
    return max(s["spec"]["pool"]["generation"] for s in slices)


# -- tolerations, and draining by hand -------------------------------------------------------------

async def test_only_a_claim_that_tolerates_the_taint_gets_a_broken_gpu(
        kube: Kube, namespace: str, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"t{secrets.token_hex(4)}.gpudra.io", "--health-quiet-period", "600")
    for name in ("gpu-0", "gpu-1"):
        mockstate.inject_xid(node.root, node.uuid[name], 48)
    if node.taints_kept:
        await node.until(lambda d: all(taints(d.get(n)) for n in ("gpu-0", "gpu-1")), "both GPUs tainted")
    else:
        await node.until(lambda d: not d, "both GPUs left out")
    pending = await schedule(kube, namespace, node, wait=False)
    message = await failed_scheduling(kube, namespace, pending)
    # kube-scheduler (1.35-1.37) does not name the taint here; `gpudra explain` does, per device
    assert "cannot allocate all claims" in message, message
    if node.taints_kept:  # the documented toleration (docs/health.md) gets one of them
        tolerate = [{"key": f"{node.driver}/xid", "operator": "Exists", "effect": "NoSchedule"}]
        assert await schedule(kube, namespace, node, tolerate) in ("gpu-0", "gpu-1")
    claim = await kube.get(CLAIM, pending, namespace)
    assert claim is not None and not (claim.get("status") or {}).get("allocation")


async def test_a_device_taint_rule_drains_a_gpu_by_hand_on_1_37(
        kube: Kube, namespace: str, gpu_node: Callable[..., Any]) -> None:
    node: Node = await gpu_node(f"d{secrets.token_hex(4)}.gpudra.io")
    rule_type = ResourceType("resource.k8s.io/v1", "DeviceTaintRule", "devicetaintrules", False)  # not in kubeapi's table
    if await minor_version(kube) < 37:  # docs/health.md says 1.37: a default 1.36 or 1.35 does not serve it
        resources = (await kube.request("GET", "/apis/resource.k8s.io/v1"))["resources"]
        assert "devicetaintrules" not in {r["name"] for r in resources}
        return
    name = f"drain-{secrets.token_hex(3)}"
    await kube.request("POST", rule_type.path(), body={
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": name},
        "spec": {"deviceSelector": {"driver": node.driver, "pool": node.name, "device": "gpu-0"},
                 "taint": {"key": "example.com/maintenance", "value": "bios-update", "effect": "NoSchedule"}}})
    try:
        assert await schedule(kube, namespace, node) == "gpu-1"
        assert "taints" not in (await node.devices())["gpu-0"]  # the rule's taint is not the agent's
    finally:
        await kube.delete(rule_type, name)
    assert await schedule(kube, namespace, node) == "gpu-0"  # back once the rule is gone


async def failed_scheduling(kube: Kube, namespace: str, pod: str) -> str:
    async def probe() -> str | None:
        found = [e for e in await events_about(kube, pod, namespace) if e.get("reason") == "FailedScheduling"]
        return found[-1]["message"] if found else None

    return await wait_for(probe, timeout=60, what=f"a FailedScheduling event for pod {pod}")


# -- an agent restart while a GPU is broken -------------------------------------------------------

async def test_a_restarted_agent_keeps_a_gpu_that_still_needs_a_reset_off_the_market(
        kube: Kube, gpu_node: Callable[..., Any], agents: Callable[..., AgentProcess]) -> None:
    node: Node = await gpu_node(f"r{secrets.token_hex(4)}.gpudra.io")
    sick = node.uuid["gpu-0"]
    mockstate.set_recovery_action(node.root, sick, GPU_RESET)
    mockstate.inject_xid(node.root, sick, 79)
    reset = (f"{node.driver}/recovery-action", "gpu-reset", "NoSchedule")

    def broken(devices: dict[str, Obj]) -> bool:
        return reset in taints(devices.get("gpu-0")) if node.taints_kept else "gpu-0" not in devices

    await node.until(broken, "gpu-0 tainted (or left out)")
    seen: list[dict[str, Obj]] = []  # every version of the slice from now on
    listening = asyncio.Event()
    watcher = asyncio.create_task(record_slices(kube, node, seen, listening))
    try:
        await asyncio.wait_for(listening.wait(), 30)  # the watch starts before the agent goes
        assert node.agent.stop() == 0
        restarted = agents(node.name, f"mock:{PROFILE}", node.driver, driver_root=node.root, extra_args=HEALTH_FLAGS)
        # the new agent's first probe re-derived the taint from the recovery action
        await logged(restarted, "device health: first probe of 2 GPU(s): 1 unhealthy")
        mockstate.recover_gpu(node.root, sick)
        await node.until(lambda d: set(d) == {"gpu-0", "gpu-1"} and not taints(d["gpu-0"]), "gpu-0 healthy again")

        async def recorded() -> bool:  # the watch may deliver the healthy version after the GET saw it
            return any(not broken(devices) for devices in seen)

        await wait_for(recorded, timeout=30, what="the watch to deliver the healthy version")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    healthy_at = next(i for i, devices in enumerate(seen) if not broken(devices))
    before_recovery = seen[:healthy_at]  # the versions the restarted agent wrote while gpu-0 was broken
    assert all(broken(devices) for devices in before_recovery), before_recovery
    if node.taints_kept:  # the XID was an event of the old process: the taint now stands on the probe
        assert before_recovery, "the restarted agent never rewrote the slice"
        assert (f"{node.driver}/xid", "79", "NoSchedule") not in taints(before_recovery[-1]["gpu-0"])
    # 1.35: gpu-0 was left out, and the restarted agent left it out too (nothing to rewrite)


async def logged(agent: AgentProcess, text: str) -> None:
    async def probe() -> bool:
        return text in agent.log_path.read_text(errors="replace")

    try:
        await wait_for(probe, timeout=30, what=f"{text!r} in the agent's log")
    except ConditionTimeout as error:
        raise ConditionTimeout(f"{error}\n{agent.log_tail(60)}") from None


async def record_slices(kube: Kube, node: Node, seen: list[dict[str, Obj]],
                        listening: asyncio.Event | None = None) -> None:
    """Append the node's devices each time one of its slices changes (one slice: two GPUs);
    ``listening`` is set once the changes from now on will be seen."""
    selector = f"spec.driver={node.driver},spec.nodeName={node.name}"
    page = await kube.request("GET", SLICE.path(), query={"fieldSelector": selector})
    if listening is not None:
        listening.set()
    async for kind, obj in kube.watch(SLICE, field_selector=selector, resource_version=page["metadata"]["resourceVersion"]):
        if kind in ("ADDED", "MODIFIED"):
            seen.append({d["name"]: d for d in obj["spec"].get("devices") or []})
