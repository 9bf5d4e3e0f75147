"""Dynamic MIG against the real API server and kube-scheduler: an agent started with ``--mig
dynamic`` on two simulated MIG-enabled H100s publishes every placement over counters, and the
scheduler, adding up nothing but those counters, fills a GPU exactly as the hardware's placement
rules allow, leaves the next claim Pending (`gpudra explain` says which counters are used up, and by
which claims' placements), and gives a freed placement to another profile.

Partitionable devices (KEP-4815) are alpha and off in Kubernetes 1.35, beta and on in 1.36 and
1.37: on 1.35 the agent finds out with a dry run, publishes static MIG and says why in a Node
Event. The expectations follow the release under test: CI runs this file on 1.35.4 with the whole
suite, and on 1.36.3 and 1.37.2 (`make test KUBE_VERSION=... PYTEST_ARGS=<this file>`)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_kubelet_plugin import plugin_agents  # noqa: F401 - a fixture

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess
from gpudra_dev.localcluster.mockstate import mig_devices
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
EVENT = resource_type("v1", "Event")
PROFILE = "fake:h100-dynamic-mig"  # two H100 80GB HBM3, MIG enabled, no MIG devices
PER_GPU = 1 + 7 + 7 + 4 + 3 + 2 + 1 + 1  # the whole GPU and every placement of its seven profiles (docs/mig.md)


async def slices_of(kube: Kube, driver: str, node: str) -> list[Obj]:
    return [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]


async def published(kube: Kube, driver: str, node: str, devices: int) -> list[Obj]:
    """The node's slices once all ``devices`` are published in one complete pool generation."""
    async def probe() -> list[Obj] | None:
        found = await slices_of(kube, driver, node)
        if not found or len({s["spec"]["pool"]["generation"] for s in found}) != 1:
            return None
        if len(found) != found[0]["spec"]["pool"]["resourceSliceCount"]:
            return None
        return found if sum(len(s["spec"].get("devices") or []) for s in found) == devices else None

    return await wait_for(probe, timeout=60, what=f"{devices} devices of {driver} published for {node}")


async def test_the_scheduler_fills_a_gpu_with_placements_exactly_as_the_hardware_allows(
        kube: Kube, namespace: str, fake_nodes: Any, agents: Callable[..., AgentProcess], cluster: Any) -> None:
    from test_consumable_capacity import allocated, minor_version, run_pod, unschedulable

    suffix = secrets.token_hex(3)
    driver = f"mig{suffix}.gpudra.io"
    node = (await fake_nodes("mig"))["metadata"]["name"]
    agent = agents(node, PROFILE, driver, rescan_interval=0.5, extra_args=("--mig", "dynamic"))

    if await minor_version(kube) < 36:
        # 1.35: counters would be dropped and overlapping placements handed out; the agent publishes
        # static MIG (these GPUs have no MIG devices: nothing) and says why, once.
        async def reported() -> list[Obj] | None:
            found = [e async for e in kube.list(EVENT, "default", field_selector=f"involvedObject.name={node}")
                     if e.get("reason") == "DynamicMigUnsupported"]
            return found or None

        (event,) = await wait_for(reported, timeout=30, what="the agent's DynamicMigUnsupported Node event")
        assert event["type"] == "Warning"
        assert event["message"].startswith("dynamic MIG is not used: the API server drops sharedCounters and "
                                           "consumesCounters from ResourceSlices: its DRAPartitionableDevices "
                                           "feature gate is off"), event["message"]
        (empty,) = await published(kube, driver, node, 0)
        assert "sharedCounters" not in empty["spec"], agent.log_tail()
        return

    slices = await published(kube, driver, node, 2 * PER_GPU)
    specs = sorted((s["spec"] for s in slices), key=lambda s: s.get("devices", [{}])[0].get("name", ""))
    (counters,) = [s for s in specs if "sharedCounters" in s]
    assert [c["name"] for c in counters["sharedCounters"]] == ["gpu-0-counters", "gpu-1-counters"]
    assert counters["sharedCounters"][0]["counters"]["ofa-engines"] == {"value": "1"}
    assert sorted(len(s.get("devices") or []) for s in specs) == [0, PER_GPU, PER_GPU]
    names = {d["name"] for s in specs for d in s.get("devices") or []}
    assert "gpu-0" in names and "gpu-0-mig-7g80gb-at0" in names  # the whole GPU too: test_dynamic_mig_whole.py

    device_class = f"mig{suffix}.gpudra.io"
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": device_class},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    attr = f'device.attributes["{driver}"]'

    def on_gpu(name: str, profile: str, index: int = 0) -> Obj:
        """A claim for one MIG placement of ``profile`` on GPU ``index``."""
        expression = f'{attr}.type == "mig" && {attr}.parentIndex == {index} && {attr}.profile == "{profile}"'
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
                    "deviceClassName": device_class, "selectors": [{"cel": {"expression": expression}}]}}]}}}

    def explain(name: str) -> str:
        """`gpudra explain claim`'s verdict: its last line."""
        answer = subprocess.run([sys.executable, "-m", "gpudra.cli", "explain", "claim", f"{namespace}/{name}",
                                 "--driver", driver, "--kubeconfig", str(cluster.kubeconfig)],
                                capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        return answer.stdout.strip().splitlines()[-1]

    try:
        # 4g.40gb has one placement (slices 0-3); 2g.20gb then fits only at 4; 1g.10gb only at 6.
        got = await allocated(kube, namespace, node, [on_gpu("four", "4g.40gb"), on_gpu("two", "2g.20gb"),
                                                      on_gpu("one", "1g.10gb")])
        assert {n: r["device"] for n, r in got.items()} == {
            "four": "gpu-0-mig-4g40gb-at0", "two": "gpu-0-mig-2g20gb-at4", "one": "gpu-0-mig-1g10gb-at6"}
        assert all(r["pool"] == node and r["driver"] == driver for r in got.values())
        # slice 7 is free, but no 1g.10gb placement starts there; nor does a 7g.80gb fit any more
        await run_pod(kube, namespace, node, on_gpu("one-more", "1g.10gb"))
        assert "cannot allocate all claims" in await unschedulable(kube, namespace, "one-more")
        # gpudra explain (upstream's allocator) says why, in counters: the GPU's compute slices are all taken,
        # and by which claims' placements
        verdict = explain("one-more")
        assert verdict.startswith("no node can satisfy request mig: it needs 1 on one node, at most 0 free"), verdict
        assert f"in use by {namespace}/one (1); 6 without room for it" in verdict, verdict
        assert "needs 1 of counter compute-slices of counter set gpu-0-counters, 0 of 7 left" in verdict, verdict
        assert verdict.endswith(
            f"; counter set gpu-0-counters on {node}: compute-slices 0 of 7, decoders 0 of 7, jpeg-engines 0 of 7 "
            f"left; memory slices 0-6 taken, 7 free; held by {namespace}/four (gpu-0-mig-4g40gb-at0), "
            f"{namespace}/two (gpu-0-mig-2g20gb-at4), {namespace}/one (gpu-0-mig-1g10gb-at6)"), verdict
        await run_pod(kube, namespace, node, on_gpu("whole", "7g.80gb"))
        await unschedulable(kube, namespace, "whole")

        # the Pending ones and the 4g go (pods, then claims): slices 0-3 take a 3g.40gb, a profile they never held
        for name in ("one-more", "whole", "four"):
            await kube.delete(POD, name, namespace, grace_period_seconds=0)
            await kube.delete(CLAIM, name, namespace)

        async def gone() -> bool:
            return all([await kube.get(CLAIM, n, namespace) is None for n in ("one-more", "whole", "four")])

        await wait_for(gone, timeout=30, what="the claims of one-more, whole and four deallocated and deleted")
        (three,) = (await allocated(kube, namespace, node, [on_gpu("three", "3g.40gb")])).values()
        assert three["device"] == "gpu-0-mig-3g40gb-at0"
        # a compute slice is left now, but no memory slice a 1g.10gb can start at: explain follows
        await run_pod(kube, namespace, node, on_gpu("again", "1g.10gb"))
        await unschedulable(kube, namespace, "again")
        verdict = explain("again")
        assert verdict.endswith(
            f"; counter set gpu-0-counters on {node}: memory slices 0-6 taken, 7 free; held by {namespace}/three "
            f"(gpu-0-mig-3g40gb-at0), {namespace}/two (gpu-0-mig-2g20gb-at4), {namespace}/one (gpu-0-mig-1g10gb-at6)"
        ), verdict
        assert "needs 1 of counter memory-slice-" in verdict and "compute-slices" not in verdict, verdict
        # gpu-1 was never touched: its 7g.80gb (the whole GPU as one instance) is still free
        (other,) = (await allocated(kube, namespace, node, [on_gpu("gpu1", "7g.80gb", 1)])).values()
        assert other["device"] == "gpu-1-mig-7g80gb-at0"
    finally:
        await kube.delete(DEVICE_CLASS, device_class)


def instances_on_gpu0(state: Path) -> list[tuple[int, int]]:
    """(GPU instance, compute instance) of GPU 0's MIG devices, as the agent's simulated NVML
    (its state directory ``state``) lists them now."""
    from gpudra_driver.nvml.fake import FakeNvml, load_profile

    return mig_devices(FakeNvml(load_profile(PROFILE.split(":", 1)[1]), state))


async def test_an_agent_sigkilled_after_making_an_instance_leaves_none_after_its_restart(
        kube: Kube, namespace: str, fake_nodes: Any, plugin_agents: Any,  # noqa: F811 - the fixture
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real agent process, SIGKILLed between NVML making a claim's instance and the checkpoint
    naming it: the restarted agent destroys it at start, keeps the other claim's, and prepares the
    claim again."""
    from test_consumable_capacity import minor_version
    from test_kubelet_plugin import allocated_claim, ref

    from gpudra_dev.kubelet_client import DraClient

    driver = f"mk{secrets.token_hex(3)}.gpudra.io"
    node = (await fake_nodes("migkill"))["metadata"]["name"]
    first = plugin_agents(node, driver, nvml=PROFILE, extra_args=("--mig", "dynamic"))
    state = first.workdir / "driver-root" / "run" / "gpudra-mock"
    if await minor_version(kube) < 36:  # static MIG instead: no placement to prepare
        await published(kube, driver, node, 0)
        claim = await allocated_claim(kube, namespace, "c", driver, node, ["gpu-0-mig-3g40gb-at0"])
        async with DraClient((await first.registered()).endpoint) as kubelet:
            out = (await first.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]]
        assert "is not a device of node" in out.error and instances_on_gpu0(state) == []
        return
    await published(kube, driver, node, 2 * PER_GPU)
    registered = await first.registered()
    kept = await allocated_claim(kube, namespace, "kept", driver, node, ["gpu-0-mig-3g40gb-at0"])
    crashing = await allocated_claim(kube, namespace, "crashing", driver, node, ["gpu-0-mig-2g20gb-at4"])
    async with DraClient(registered.endpoint) as kubelet:
        assert (await first.prepare(kubelet, [ref(kept)])).claims[kept["metadata"]["uid"]].error == ""
    assert instances_on_gpu0(state) == [(1, 0)]
    first.agent.stop()

    monkeypatch.setenv("GPUDRA_FAULT", "after-mig-instance")
    doomed = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=("--mig", "dynamic"))
    monkeypatch.delenv("GPUDRA_FAULT")
    async with DraClient((await doomed.registered()).endpoint) as kubelet:
        with pytest.raises(Exception):  # the connection dies with the agent: no answer
            await kubelet.prepare([ref(crashing)], timeout=20)
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    uid = crashing["metadata"]["uid"]
    assert instances_on_gpu0(state) == [(1, 0), (5, 0)]  # made at slices 4-5, its IDs not recorded
    assert doomed.checkpoint()[uid] == "PrepareStarted"

    restarted = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=("--mig", "dynamic"))
    registered = await restarted.registered()
    assert instances_on_gpu0(state) == [(1, 0)]  # rolled back at start; the kept claim's untouched
    assert restarted.checkpoint() == {kept["metadata"]["uid"]: "PrepareCompleted"}
    async with DraClient(registered.endpoint) as kubelet:
        response = await restarted.prepare(kubelet, [ref(crashing)])
        assert response.claims[uid].error == "" and instances_on_gpu0(state) == [(1, 0), (5, 0)]
        assert {u: r.error for u, r in (await kubelet.unprepare([ref(kept), ref(crashing)])).claims.items()} == \
            {kept["metadata"]["uid"]: "", uid: ""}
    assert instances_on_gpu0(state) == []
