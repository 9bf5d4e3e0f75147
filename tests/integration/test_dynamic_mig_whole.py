"""Dynamic MIG's whole GPU against the real API server and kube-scheduler, and on the real agent:
the whole GPU ``gpu-<i>`` takes every counter of its GPU's set, so the scheduler gives it only
while no placement of that GPU is taken, and no placement while it is; prepare turns the GPU's
MIG mode off, the agent keeps publishing the same devices meanwhile (its restart included), and
unprepare turns MIG mode on again; a SIGKILL just after the switch leaves MIG mode on after the
restart. Partitionable devices need 1.36+: on 1.35 (CI's whole-suite run) the agent publishes
static MIG, so nothing of these GPUs, and that is what is checked there."""

from __future__ import annotations

import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_dynamic_mig import PROFILE, published, slices_of
from test_kubelet_plugin import plugin_agents  # noqa: F401 - a fixture

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess

DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
PER_GPU = 1 + 25  # the whole GPU (Hopper: MIG mode switches without a reset) and its 25 placements
ON, OFF = 1, 0


def mig_mode(state: Path, index: int = 0) -> tuple[int, int]:
    """GPU ``index``'s (current, pending) MIG mode, as NVML answers it on the agent's driver root
    (the state both NVML simulators keep: ``<state>/state/<uuid>/mig_mode``)."""
    from gpudra_driver.nvml.fake import FakeNvml, load_profile

    nvml = FakeNvml(load_profile(PROFILE.split(":", 1)[1]), state)
    nvml.nvmlInit()
    try:
        return tuple(nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(index)))  # type: ignore[return-value]
    finally:
        nvml.nvmlShutdown()


async def test_the_whole_gpu_and_its_placements_exclude_each_other(
        kube: Kube, namespace: str, fake_nodes: Any, agents: Callable[..., AgentProcess]) -> None:
    from test_consumable_capacity import allocated, minor_version, run_pod, unschedulable

    from gpudra_dev.localcluster.waiting import wait_for

    suffix = secrets.token_hex(3)
    driver = f"mw{suffix}.gpudra.io"
    node = (await fake_nodes("migwhole"))["metadata"]["name"]
    agents(node, PROFILE, driver, rescan_interval=0.5, extra_args=("--mig", "dynamic"))
    if await minor_version(kube) < 36:  # static MIG: MIG-enabled GPUs without MIG devices publish nothing
        await published(kube, driver, node, 0)
        return
    slices = await published(kube, driver, node, 2 * PER_GPU)
    whole = next(d for s in slices for d in s["spec"].get("devices") or [] if d["name"] == "gpu-0")
    assert whole["attributes"]["type"] == {"string": "gpu"}
    (taken,) = whole["consumesCounters"]
    assert taken["counterSet"] == "gpu-0-counters" and taken["counters"]["compute-slices"] == {"value": "7"}
    assert {f"memory-slice-{k}" for k in range(8)} <= taken["counters"].keys()

    device_class = f"mw{suffix}.gpudra.io"
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": device_class},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    attr = f'device.attributes["{driver}"]'

    def asking(name: str, expression: str) -> Obj:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": device_class, "selectors": [{"cel": {"expression": expression}}]}}]}}}

    def whole_gpu(name: str) -> Obj:
        return asking(name, f'{attr}.type == "gpu" && {attr}.index == 0')

    def one_g(name: str) -> Obj:
        return asking(name, f'{attr}.type == "mig" && {attr}.parentIndex == 0 && {attr}.profile == "1g.10gb"')

    async def deleted(*names: str) -> None:
        for name in names:
            await kube.delete(POD, name, namespace, grace_period_seconds=0)
            await kube.delete(CLAIM, name, namespace)

        async def gone() -> bool:
            return all([await kube.get(CLAIM, n, namespace) is None for n in names])

        await wait_for(gone, timeout=30, what=f"claims {names} deallocated and deleted")

    try:
        (got,) = (await allocated(kube, namespace, node, [whole_gpu("whole")])).values()
        assert got["device"] == "gpu-0"
        await run_pod(kube, namespace, node, one_g("placed"))  # no placement while the whole GPU is taken
        assert "cannot allocate all claims" in await unschedulable(kube, namespace, "placed")
        await deleted("placed", "whole")
        (placed,) = (await allocated(kube, namespace, node, [one_g("placed")])).values()
        assert placed["device"] == "gpu-0-mig-1g10gb-at0"
        await run_pod(kube, namespace, node, whole_gpu("whole-again"))  # no whole GPU while a placement is taken
        await unschedulable(kube, namespace, "whole-again")
        # the other GPU's whole is untouched by gpu-0's placements
        (other,) = (await allocated(kube, namespace, node, [asking(
            "other", f'{attr}.type == "gpu" && {attr}.index == 1')])).values()
        assert other["device"] == "gpu-1"
    finally:
        await kube.delete(DEVICE_CLASS, device_class)


async def test_the_real_agent_turns_mig_mode_off_for_the_whole_gpu_and_on_again(
        kube: Kube, namespace: str, fake_nodes: Any, plugin_agents: Any,  # noqa: F811 - the fixture
        monkeypatch: pytest.MonkeyPatch) -> None:
    from test_consumable_capacity import minor_version
    from test_kubelet_plugin import allocated_claim, ref

    from gpudra_dev.kubelet_client import DraClient

    driver = f"mo{secrets.token_hex(3)}.gpudra.io"
    node = (await fake_nodes("migoff"))["metadata"]["name"]
    first = plugin_agents(node, driver, nvml=PROFILE, extra_args=("--mig", "dynamic"))
    state = first.workdir / "driver-root" / "run" / "gpudra-mock"
    if await minor_version(kube) < 36:  # static MIG: no whole GPU of a MIG-enabled GPU to prepare
        await published(kube, driver, node, 0)
        claim = await allocated_claim(kube, namespace, "w", driver, node, ["gpu-0"])
        async with DraClient((await first.registered()).endpoint) as kubelet:
            out = (await first.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]]
        assert "is not a device of node" in out.error and mig_mode(state) == (ON, ON)
        return
    before = await published(kube, driver, node, 2 * PER_GPU)
    whole = await allocated_claim(kube, namespace, "whole", driver, node, ["gpu-0"])
    uid = whole["metadata"]["uid"]
    async with DraClient((await first.registered()).endpoint) as kubelet:
        out = await prepared(first, kubelet, whole)
        assert out.error == "" and [d.device_name for d in out.devices] == ["gpu-0"], out
    assert mig_mode(state) == (OFF, OFF) and mig_mode(state, 1) == (ON, ON)
    assert (state / "state" / "GPU-3f1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f60" / "mig_mode").read_text() == "0\n"
    first.agent.stop()

    # a restarted agent scans the GPU with its MIG mode off: with the slices wiped first, what it
    # publishes is its own scan's, and that is the same devices and counters as before
    for found in await slices_of(kube, driver, node):
        await kube.delete(SLICE, found["metadata"]["name"])
    second = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=("--mig", "dynamic"))
    again = await published(kube, driver, node, 2 * PER_GPU)
    assert _devices(again) == _devices(before), second.agent.log_tail()
    assert second.checkpoint() == {uid: "PrepareCompleted"}
    async with DraClient((await second.registered()).endpoint) as kubelet:
        assert (await kubelet.unprepare([ref(whole)])).claims[uid].error == ""
    assert mig_mode(state) == (ON, ON) and second.checkpoint() == {}
    second.agent.stop()

    # SIGKILLed between the switch and its record: MIG mode on again after the restart
    monkeypatch.setenv("GPUDRA_FAULT", "after-mig-mode-off")
    doomed = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=("--mig", "dynamic"))
    monkeypatch.delenv("GPUDRA_FAULT")
    async with DraClient((await doomed.registered()).endpoint) as kubelet:
        with pytest.raises(Exception):  # the connection dies with the agent: no answer
            await prepared(doomed, kubelet, whole)
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    assert mig_mode(state) == (OFF, OFF) and doomed.checkpoint() == {uid: "PrepareStarted"}
    restarted = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=("--mig", "dynamic"))
    registered = await restarted.registered()
    assert mig_mode(state) == (ON, ON) and restarted.checkpoint() == {}  # rolled back at start
    async with DraClient(registered.endpoint) as kubelet:
        assert (await prepared(restarted, kubelet, whole)).error == ""
        assert mig_mode(state) == (OFF, OFF)
        assert (await kubelet.unprepare([ref(whole)])).claims[uid].error == ""
    assert mig_mode(state) == (ON, ON)


async def prepared(agent: Any, kubelet: Any, claim: Obj) -> Any:
    """The claim's NodePrepareResources answer, asked again as the kubelet does while the agent's
    first discovery (which runs beside its registration) has not finished."""
    from test_kubelet_plugin import ref

    from gpudra_dev.localcluster.waiting import wait_for

    async def answered() -> Any:
        out = (await agent.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]]
        return None if "not discovered yet" in out.error else out

    return await wait_for(answered, timeout=30, what="an answer with the node's devices discovered")


def _devices(slices: list[Obj]) -> dict[str, Obj]:
    """The pool's devices and counter sets by name, as published."""
    found: dict[str, Obj] = {}
    for s in slices:
        found |= {d["name"]: d for d in s["spec"].get("devices") or []}
        found |= {c["name"]: c for c in s["spec"].get("sharedCounters") or []}
    return found
