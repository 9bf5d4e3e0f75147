"""`gpudra explain` for pods that ask for extended resources backed by DRA (KEP-5004), against the
real kube-scheduler: a DeviceClass maps `example.com/gpu-<run>` (its extendedResourceName) and, by
its implicit name, `deviceclass.resource.kubernetes.io/<class>`; pods with no ResourceClaim ask for
them. Explain replays the claim the scheduler builds (gpudra-allocator links the release's own
code) and must agree with the scheduler on every pod: an 8-GPU node fits 2, a 1-GPU node does not,
an init container's larger request is reused and topped up, a resource nobody serves keeps the pod
off every node, a node whose device plugin serves the resource is NodeResourcesFit's; and the
claim explain built must be the one the scheduler creates (same requests, same container
mappings). Once bound, explain shows the scheduler's claim as allocated. On 1.35, whose scheduler
has DRAExtendedResource off, explain says so and exits with that message.

CI runs it on 1.35.4 with the whole suite and on 1.36.3 and 1.37.2 (.ci/run)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable

import pytest

from gpudra_driver.discovery import discover
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_operator.deviceclasses import render_device_class
from gpudra_operator.explain import Verdict, explain_snapshot
from gpudra_operator.explain.gather import ExplainInputError, read_snapshot
from gpudra_operator.explain.report import as_text
from gpudra_dev.localcluster.objects import create_fake_node, delete_node
from gpudra_dev.localcluster.waiting import wait_for
from schedpods import pinned_pod_with, scheduling_outcome

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
GATE = "gpudra.io/explain-first"


def container(name: str, requests: dict[str, str], *, sidecar: bool = False) -> Obj:
    body: Obj = {"name": name, "resources": {"requests": requests, "limits": requests}}
    if sidecar:
        body["restartPolicy"] = "Always"
    return body


def pod(name: str, namespace: str, node: str, containers: list[Obj], init: list[Obj] | None = None) -> Obj:
    """Pinned to ``node``, held by the scheduling gate, no claim of its own."""
    return pinned_pod_with(name, namespace, node, {}, gate=GATE, containers=containers, init_containers=init or ())


async def explain_pod(kube: Kube, helper: AllocatorHelper, namespace: str, name: str, driver: str) -> Verdict:
    return await explain_snapshot(await read_snapshot(kube, "pod", namespace, name, driver), driver, helper)


def decided(kube: Kube, namespace: str, names: list[str]) -> Callable[[], Awaitable[dict[str, bool] | None]]:
    async def probe() -> dict[str, bool] | None:
        outcomes = {n: scheduling_outcome(await kube.get(POD, n, namespace)) for n in names}
        return {n: o[0] for n, o in outcomes.items() if o is not None} if all(outcomes.values()) else None
    return probe


def request_shape(requests: list[Obj]) -> list[tuple[str, str, str, int]]:
    return sorted((r["name"], r["exactly"]["deviceClassName"], r["exactly"].get("allocationMode", "ExactCount"),
                   int(r["exactly"].get("count", 1))) for r in requests)


def mapping_shape(mappings: list[Obj]) -> set[tuple[str, str, str]]:
    return {(m["containerName"], m["resourceName"], m["requestName"]) for m in mappings}


async def test_explain_replays_the_schedulers_claim_for_extended_resources(kube: Kube, namespace: str) -> None:
    minor = await kube.server_minor()
    assert minor is not None
    run = secrets.token_hex(3)
    driver, class_name = f"e{run}.gpudra.io", f"gpu-e{run}.gpudra.io"
    resource, unserved, implicit = f"example.com/gpu-{run}", f"example.com/none-{run}", \
        f"deviceclass.resource.kubernetes.io/{class_name}"
    eight, one, plugin = f"e{run}-8", f"e{run}-1", f"e{run}-dp"
    device_class = render_device_class(class_name, driver, template="full-gpu", params={})
    device_class["spec"]["extendedResourceName"] = resource
    slices = [s for node, profile in ((eight, "dgx-h100"), (one, "h200"), (plugin, "h200"))
              for s in build_slices(driver, node, None, 1, discover(FakeNvml(load_profile(profile))))]
    for node in (eight, one, plugin):
        await create_fake_node(kube, node)
    # The device plugin's node: the kubelet would report the plugin's devices in allocatable.
    await kube.patch(NODE, plugin, {"status": {"capacity": {resource: "4"}, "allocatable": {resource: "4"}}},
                     subresource="status")
    try:
        for obj in [device_class, *slices]:
            await kube.create(obj)
        if minor < 36:
            await _gate_off(kube, namespace, driver, resource, one)
            return
        pods = {
            "fits": pod("fits", namespace, eight, [container("main", {resource: "2"})]),
            "too-many": pod("too-many", namespace, one, [container("main", {resource: "2"})]),
            "init": pod("init", namespace, eight, [container("a", {resource: "1"}), container("b", {resource: "1"})],
                        init=[container("warm", {resource: "5"}), container("side", {resource: "1"}, sidecar=True)]),
            "implicit": pod("implicit", namespace, eight, [container("main", {implicit: "1", "cpu": "100m"})]),
            "unserved": pod("unserved", namespace, eight, [container("main", {resource: "1", unserved: "1"})]),
            "plugin": pod("plugin", namespace, plugin, [container("main", {resource: "2"})]),
        }
        for body in pods.values():
            await kube.create(body)
        async with AllocatorHelper(minor) as helper:
            verdicts = {name: await explain_pod(kube, helper, namespace, name, driver) for name in pods}
            for name in pods:
                await kube.patch(POD, name, {"spec": {"schedulingGates": None}}, namespace=namespace)
            decisions = await wait_for(decided(kube, namespace, list(pods)), timeout=90, interval=0.5,
                                       what="the scheduler's decision on every pod")
            expected = {"fits": True, "too-many": False, "init": True, "implicit": True, "unserved": False,
                        "plugin": True}
            assert decisions == expected, decisions
            texts = {name: as_text(v) for name, v in verdicts.items()}
            assert {name: v.satisfiable for name, v in verdicts.items()} == decisions, texts

            # The claim explain built is the one the scheduler created.
            for name in ("fits", "init", "implicit"):
                live = await kube.get(POD, name, namespace)
                status = live["status"]["extendedResourceClaimStatus"]
                created = await kube.get(CLAIM, status["resourceClaimName"], namespace)
                extended = verdicts[name].extended
                assert extended is not None, texts[name]
                assert request_shape(extended.requests) == request_shape(created["spec"]["devices"]["requests"]), \
                    (extended.requests, created["spec"])
                assert mapping_shape(extended.mappings) == mapping_shape(status["requestMappings"])
                assert "the scheduler's claim for the pod's extended resources" in texts[name]
            # Init containers: the 5 the warm-up container asks reuse the three long-lived
            # containers' requests (the sidecar's among them) and top them up by two.
            init = verdicts["init"].extended
            assert init is not None and sum(int(r["exactly"]["count"]) for r in init.requests) == 5, init.requests

            assert verdicts["too-many"].conclusion.startswith("no node can satisfy request container-0-request-0"), \
                texts["too-many"]
            assert verdicts["unserved"].conclusion.startswith("no node can run the pod: cannot fit resource "
                                                              f"{unserved}"), texts["unserved"]
            plugin_verdict = verdicts["plugin"]
            assert plugin_verdict.extended is not None and plugin_verdict.extended.device_plugin_nodes == [plugin]
            assert any("NodeResourcesFit decides" in n for n in plugin_verdict.notes), texts["plugin"]
            assert (await kube.get(POD, "plugin", namespace))["status"].get("extendedResourceClaimStatus") is None

            # Bound: explain shows the scheduler's claim, allocated on the node.
            after = await explain_pod(kube, helper, namespace, "fits", driver)
            assert after.satisfiable and after.extended is None
            assert after.conclusion.startswith(f"allocated on {eight}: {namespace}/fits-extended-resources-"), \
                as_text(after)
    finally:
        async for found in kube.list(SLICE, field_selector=f"spec.driver={driver}"):
            await kube.delete(SLICE, found["metadata"]["name"])
        await kube.delete(DEVICE_CLASS, class_name)
        await asyncio.gather(*(delete_node(kube, n) for n in (eight, one, plugin)))


async def _gate_off(kube: Kube, namespace: str, driver: str, resource: str, node: str) -> None:
    """1.35: the API server dropped extendedResourceName and the scheduler's gate is off."""
    await kube.create(pod("legacy", namespace, node, [container("main", {resource: "1"})]))
    async with AllocatorHelper(35) as helper:
        with pytest.raises(ExplainInputError, match="DRAExtendedResource gate is off"):
            await explain_pod(kube, helper, namespace, "legacy", driver)
        # An administrator who turned the gates on says so; the class (its field dropped) maps nothing.
    async with AllocatorHelper(35, feature_gates={"DRAExtendedResource": True}) as helper:
        with pytest.raises(ExplainInputError, match="no DeviceClass maps them"):
            await explain_pod(kube, helper, namespace, "legacy", driver)
