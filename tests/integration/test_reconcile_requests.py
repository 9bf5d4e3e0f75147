"""What events on a config's children cost, counted request by request against the real API
server, with the Reconciler in-process and no operator running (so nobody else writes the
config's status): the echo of the operator's own writes and a DaemonSet whose status moved cost a
status refresh, not a full reconcile; a hand edit still gets the full reconcile that repairs it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio

from counting import CountingKube
from gpudra_core.kubeapi import Kube, Obj, ResourceType, resource_type
from gpudra_operator.childevents import ChildEvents
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.statusrefresh import StatusRefresh

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
    child_events = ChildEvents(reconciler, StatusRefresh(reconciler))
    await reconciler.reconcile(config)  # creates the children; the new DaemonSet has no status yet
    assert (await live(kube, CONFIG, name))["status"]["agents"]["desired"] == 0

    # The echo of a class it just applied needs nothing at all.
    some_class = await live(kube, DEVICE_CLASS, config["spec"]["deviceClasses"][0]["name"])
    counting.requests.clear()
    await child_events.on_event(name, "ADDED", some_class)
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
    await child_events.on_event(name, "MODIFIED", daemonset)
    writes = [(method, path) for method, path in counting.requests if method != "GET"]
    assert writes == [("PATCH", f"/apis/gpudra.io/v1alpha1/gpudraconfigs/{name}/status")], counting.requests
    assert len(counting.requests) <= 4, counting.requests  # + the device-plugin Events, when their reuse expired
    status = (await live(kube, CONFIG, name))["status"]
    assert status["agents"]["desired"] == 1 and status["agents"]["ready"] == 0

    # Nothing moved since: reads only.
    counting.requests.clear()
    await child_events.on_event(name, "MODIFIED", daemonset)
    assert counting.methods and set(counting.methods) == {"GET"} and len(counting.methods) <= 3, counting.requests

    # A hand edit is repaired by a full reconcile.
    edited = await kube.patch(DAEMONSET, "gpudra-agent", {"spec": {"template": {"spec": {"containers": [
        {"name": "agent", "image": "evil.example.com/x:1"}]}}}}, namespace=namespace, kind="strategic-merge")
    await child_events.on_event(name, "MODIFIED", edited)
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
    child_events = ChildEvents(reconciler, StatusRefresh(reconciler))
    await reconciler.reconcile(config)
    old = await live(kube, DAEMONSET, "gpudra-agent", namespace)

    await kube.patch(CONFIG, name, {"spec": {"agent": {"image": "example.com/gpudra:next"}}})
    counting.requests.clear()
    await child_events.on_event(name, "MODIFIED", old)  # as the last reconcile wrote it
    assert "PATCH" in counting.methods, counting.requests
    daemonset = await live(kube, DAEMONSET, "gpudra-agent", namespace)
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/gpudra:next"
    status = (await live(kube, CONFIG, name))["status"]
    assert status["observedGeneration"] == (await live(kube, CONFIG, name))["metadata"]["generation"]


OPTIONAL_AGENT_FIELDS: dict[str, tuple[Any, Callable[[Obj], Any]]] = {
    # spec.agent field -> (a value, where it lands in the DaemonSet)
    "nodeSelector": ({"gpudra-requests-extra": "x"}, lambda ds: ds["spec"]["template"]["spec"].get("nodeSelector")),
    "affinity": ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
        lambda ds: ds["spec"]["template"]["spec"].get("affinity")),
    "tolerations": ([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    lambda ds: ds["spec"]["template"]["spec"].get("tolerations")),
    "resources": ({"limits": {"memory": "300Mi"}}, lambda ds: ds["spec"]["template"]["spec"]["containers"][0].get("resources")),
    "extraEnv": ([{"name": "GPUDRA_EXTRA", "value": "1"}],
                 lambda ds: [e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "GPUDRA_EXTRA"]),
    "priorityClassName": ("", lambda ds: "priorityClassName" in ds["spec"]["template"]["spec"] or None),
}


async def test_an_optional_field_taken_out_of_the_spec_leaves_the_children_and_a_tick_writes_nothing(
        kube: Kube, config: Obj, namespace: str) -> None:
    """Set every optional field, then take each out: server-side apply removes what this manager
    owned and no longer sends, so the DaemonSet and the classes lose it (a `contains` check alone
    would call the live object current). After that, a drift tick reads and writes nothing."""
    name = config["metadata"]["name"]
    counting = CountingKube(kube.api, "gpudra-operator")
    reconciler = Reconciler(counting, EventRecorder(counting))
    class_name = config["spec"]["deviceClasses"][0]["name"]
    annotated = {"name": class_name, "inline": (
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {{ name }}\n"
        "  annotations: {example.com/owner: ml-team}\nspec:\n  selectors:\n  - cel:\n"
        "      expression: {{ driver_match | yaml_string }}\n"
        "  config:\n  - opaque:\n      driver: {{ driver }}\n      parameters: {kind: Example}\n")}
    agent = {**config["spec"]["agent"], **{k: v for k, (v, _) in OPTIONAL_AGENT_FIELDS.items() if k != "priorityClassName"}}
    agent["nodeSelector"] = {**config["spec"]["agent"]["nodeSelector"], "gpudra-requests-extra": "x"}
    await kube.patch(CONFIG, name, {"spec": {"agent": agent, "deviceClasses": [
        annotated, *config["spec"]["deviceClasses"][1:]]}})
    await reconciler.reconcile(await live(kube, CONFIG, name))
    daemonset = await live(kube, DAEMONSET, "gpudra-agent", namespace)
    for field, (_, where) in OPTIONAL_AGENT_FIELDS.items():
        if field != "priorityClassName":
            assert where(daemonset), f"{field} not applied"
    assert "priorityClassName" in daemonset["spec"]["template"]["spec"]
    applied = await live(kube, DEVICE_CLASS, class_name)
    assert applied["metadata"]["annotations"] == {"example.com/owner": "ml-team"} and applied["spec"]["config"]

    # Out, one at a time (each alone leaves everything else the live object has as it is); an empty
    # priorityClassName means none.
    removals: list[tuple[str, Obj]] = [
        ("nodeSelector", {"nodeSelector": {"gpudra-requests-extra": None}}), ("affinity", {"affinity": None}),
        ("tolerations", {"tolerations": None}), ("resources", {"resources": None}),
        ("extraEnv", {"extraEnv": None}), ("priorityClassName", {"priorityClassName": ""})]
    for field, patch in removals:
        await kube.patch(CONFIG, name, {"spec": {"agent": patch}})
        await reconciler.reconcile(await live(kube, CONFIG, name))
        daemonset = await live(kube, DAEMONSET, "gpudra-agent", namespace)
        if field == "nodeSelector":
            assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == config["spec"]["agent"]["nodeSelector"]
        else:
            assert not OPTIONAL_AGENT_FIELDS[field][1](daemonset), f"{field} still on the DaemonSet"
    await kube.patch(CONFIG, name, {"spec": {"deviceClasses": [
        {"name": class_name, "template": "full-gpu"}, *config["spec"]["deviceClasses"][1:]]}})
    await reconciler.reconcile(await live(kube, CONFIG, name))
    cleared = await live(kube, DEVICE_CLASS, class_name)
    assert "annotations" not in cleared["metadata"] or "example.com/owner" not in cleared["metadata"]["annotations"]
    assert "config" not in cleared["spec"]

    async def settled() -> Obj | None:  # the DaemonSet controller has caught up with the new template
        ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
        status = (ds or {}).get("status") or {}
        return ds if ds and status.get("observedGeneration") == ds["metadata"]["generation"] else None

    await wait_for(settled, timeout=30, what="the DaemonSet controller to observe the new template")
    await reconciler.reconcile(await live(kube, CONFIG, name))  # the status catches up
    counting.requests.clear()
    await reconciler.reconcile(await live(kube, CONFIG, name))  # a drift tick
    assert [r for r in counting.requests if r[0] != "GET"] == [], [r for r in counting.requests if r[0] != "GET"]
