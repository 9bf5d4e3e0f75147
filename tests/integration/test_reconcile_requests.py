"""What events on a config's children cost, counted request by request against the real API
server, with the Reconciler in-process and no operator running (so nobody else writes the
config's status): the echo of the operator's own writes and a DaemonSet whose status moved cost a
status refresh, not a full reconcile; a hand edit still gets the full reconcile that repairs it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest_asyncio

from counting import CountingKube
from gpudra_driver.kubeapi import Kube, Obj, ResourceType, resource_type
from gpudra_operator.events import EventRecorder
from gpudra_operator.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")


@pytest_asyncio.fixture(loop_scope="session")
async def config(kube: Kube, crd_installed: Obj, namespace: str,
                 fake_nodes: Callable[..., Awaitable[Obj]]) -> AsyncIterator[Obj]:
    """A GpuDraConfig whose DaemonSet selects one fake Node (so the DaemonSet controller gives it
    a status to report), created without an operator; the garbage collector removes its children."""
    suffix = secrets.token_hex(3)
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    await fake_nodes("gpu", labels={"gpudra-requests": suffix})
    body = await kube.create({
        "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": f"requests-{suffix}"},
        "spec": {"driverName": f"q{suffix}.gpudra.io",
                 "agent": {"namespace": namespace, "nodeSelector": {"gpudra-requests": suffix}},
                 "deviceClasses": [{"name": f"q{i}-{suffix}.gpudra.io", "template": "full-gpu"} for i in range(3)]}})
    try:
        yield body
    finally:
        await kube.delete(CONFIG, body["metadata"]["name"])


async def test_child_events_cost_a_status_refresh_unless_a_child_was_edited(kube: Kube, config: Obj,
                                                                             namespace: str) -> None:
    name = config["metadata"]["name"]
    counting = CountingKube(kube.api, "gpudra-operator")
    reconciler = Reconciler(counting, EventRecorder(counting))
    await reconciler.reconcile(config)  # creates the children; the new DaemonSet has no status yet
    assert (await live(kube, CONFIG, name))["status"]["agents"]["desired"] == 0

    # The echo of a class it just applied needs nothing at all.
    some_class = await live(kube, DEVICE_CLASS, config["spec"]["deviceClasses"][0]["name"])
    counting.requests.clear()
    await reconciler.on_child_event(name, "ADDED", some_class)
    assert counting.requests == []

    # The DaemonSet controller schedules the agent on the fake Node: its status moves, and so does
    # the config's, through a status refresh (reads of the config and the DaemonSet, one PATCH).
    async def scheduled() -> Obj | None:  # and settled: the pod stays Pending (no kubelet here)
        daemonset = await kube.get(DAEMONSET, "gpudra-agent", namespace)
        status = (daemonset or {}).get("status") or {}
        settled = (status.get("desiredNumberScheduled") == status.get("updatedNumberScheduled") == 1
                   and status.get("observedGeneration") == (daemonset or {}).get("metadata", {}).get("generation"))
        return daemonset if settled else None

    daemonset = await wait_for(scheduled, timeout=30, what="the DaemonSet controller to schedule the agent")
    counting.requests.clear()
    await reconciler.on_child_event(name, "MODIFIED", daemonset)
    writes = [(method, path) for method, path in counting.requests if method != "GET"]
    assert writes == [("PATCH", f"/apis/gpudra.io/v1alpha1/gpudraconfigs/{name}/status")], counting.requests
    assert len(counting.requests) <= 4, counting.requests  # + the slice count, when its cache expired
    status = (await live(kube, CONFIG, name))["status"]
    assert status["agents"]["desired"] == 1 and status["agents"]["ready"] == 0

    # Nothing moved since: reads only.
    counting.requests.clear()
    await reconciler.on_child_event(name, "MODIFIED", daemonset)
    assert counting.methods and set(counting.methods) == {"GET"} and len(counting.methods) <= 3, counting.requests

    # A hand edit is repaired by a full reconcile.
    edited = await kube.patch(DAEMONSET, "gpudra-agent", {"spec": {"template": {"spec": {"containers": [
        {"name": "agent", "image": "evil.example.com/x:1"}]}}}}, namespace=namespace, kind="strategic-merge")
    await reconciler.on_child_event(name, "MODIFIED", edited)
    restored = await live(kube, DAEMONSET, "gpudra-agent", namespace)
    assert restored["spec"]["template"]["spec"]["containers"][0]["image"] == reconciler.agent_image


async def live(kube: Kube, rtype: ResourceType, name: str, namespace: str | None = None) -> Obj:
    obj = await kube.get(rtype, name, namespace)
    assert obj is not None, f"{rtype} {name} is gone"
    return obj


async def test_a_refresh_after_a_spec_change_reconciles_instead(kube: Kube, config: Obj, namespace: str) -> None:
    """The cache of the last reconcile never stands in for a newer spec: when the config's
    generation moved (its update not reconciled yet), a DaemonSet event that matches the old
    DaemonSet gets a full reconcile, which writes the new one."""
    name = config["metadata"]["name"]
    counting = CountingKube(kube.api, "gpudra-operator")
    reconciler = Reconciler(counting, EventRecorder(counting))
    await reconciler.reconcile(config)
    old = await live(kube, DAEMONSET, "gpudra-agent", namespace)

    await kube.patch(CONFIG, name, {"spec": {"agent": {"image": "example.com/gpudra:next"}}})
    counting.requests.clear()
    await reconciler.on_child_event(name, "MODIFIED", old)  # as the last reconcile wrote it
    assert "PATCH" in counting.methods, counting.requests
    daemonset = await live(kube, DAEMONSET, "gpudra-agent", namespace)
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/gpudra:next"
    status = (await live(kube, CONFIG, name))["status"]
    assert status["observedGeneration"] == (await live(kube, CONFIG, name))["metadata"]["generation"]
