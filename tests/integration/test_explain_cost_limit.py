"""The CEL runtime cost limit: `gpudra explain` against the real kube-scheduler.

Three DeviceClasses, each with a claim and a pod on one fake node whose device has a 64-character
string attribute:

* ``admitted``: 9,000 loops of 20 ``startsWith`` on that attribute. The API server admits it (its
  estimate, 945,012, charges ``startsWith`` by its prefix), but before 1.37 the run charges it by
  the 64 characters and is stopped at the limit: the allocator stops with that error and the
  scheduler never allocates; explain (the same allocator, gpudra-allocator of the release) must say
  so. From 1.37 (cel-go 0.29) the run charges the prefix too and ends: nothing matches, as explain
  must say.
* ``bounded`` and ``runaway`` are estimated past the limit, so today's API server refuses them:
  they exist only if stored under other rules, so the test writes them straight into etcd (as JSON,
  which the API server reads as it reads its own protobuf). ``bounded`` (a thousand loops over the
  device's attribute maps) is within the limit for this device's two small maps: explain agrees
  with the scheduler, which allocates. ``runaway`` is past it whatever the device: not allocated,
  and explain names the cost-limit error that stops the scheduler.

The scheduler's own message says only "cannot allocate all claims"; the helper's ``match``
confirms that each run is stopped at the cost limit, on this device."""

from __future__ import annotations

import base64
import json
import secrets
import urllib.request
import uuid
from datetime import datetime, timezone

from kubernetes_asyncio.client.exceptions import ApiException

from schedpods import pinned_pod, scheduling_outcome
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_operator.explain import explain_live
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.waiting import wait_for

DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
POD = resource_type("v1", "Pod")
COST_STOP = "operation cancelled: actual cost limit exceeded"


def put_into_etcd(cluster: ControlPlane, key: str, value: Obj) -> None:
    """etcd's JSON gateway (``/v3/kv/put``): what the API server would refuse to write."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "value": base64.b64encode(json.dumps(value).encode()).decode()}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.etcd_port}/v3/kv/put", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.read()


def device_class(name: str, expression: str) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": name, "uid": str(uuid.uuid4()),
                         "creationTimestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")},
            "spec": {"selectors": [{"cel": {"expression": expression}}]}}


async def test_explain_names_the_cost_limit_where_the_scheduler_stops_at_it(
        kube: Kube, cluster: ControlPlane, namespace: str, fake_nodes) -> None:
    token = secrets.token_hex(3)
    driver = f"cost-{token}.gpudra.io"
    node = (await fake_nodes("cost"))["metadata"]["name"]
    kinds = ("admitted", "bounded", "runaway")
    # One device per class, told apart by an attribute each class checks first (a cheap false on
    # the others), so no claim's allocation takes another's device.
    devices = {kind: {"name": kind, "attributes": {"kind": {"string": kind}, "s": {"string": "x" * 64}}}
               for kind in kinds}
    await kube.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{token}"},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": list(devices.values())}})
    prefixes = " || ".join([f'device.attributes["{driver}"].s.startsWith("a")'] * 20)
    bodies = {
        "admitted": f"lists.range(9000).exists(i, {prefixes})",
        "bounded": "lists.range(1000).all(i, device.attributes.all(d, device.attributes[d].all(k, true)))",
        "runaway": f"lists.range(9000).exists(i, {prefixes} || {prefixes})",
    }
    classes = {kind: f'device.driver == "{driver}" && device.attributes["{driver}"].kind == "{kind}" && {body}'
               for kind, body in bodies.items()}
    minor = await kube.server_minor()
    assert minor is not None
    stops_admitted = minor < 37  # cel-go 0.29 (1.37) charges startsWith by its prefix at run time too
    async with AllocatorHelper(minor) as helper:
        stopped = {}
        for kind, expression in classes.items():
            _, ((outcome,),) = await helper.match([expression], [(driver, devices[kind])])
            stopped[kind] = outcome.error
    assert stopped == {"admitted": COST_STOP if stops_admitted else None, "bounded": None, "runaway": COST_STOP}, stopped
    try:
        for kind, expression in classes.items():
            name = f"{kind}-{token}"
            if kind == "admitted":
                await kube.create(device_class(name, expression) | {"metadata": {"name": name}})
            else:
                # The API server refuses these today ...
                try:
                    await kube.create(device_class(name, expression) | {"metadata": {"name": name}}, dry_run=True)
                    raise AssertionError(f"the API server accepted {kind}")
                except ApiException as error:
                    assert "too complex, exceeds cost limit" in str(error.body), error.body
                # ... so they are stored as if an older release had admitted them.
                put_into_etcd(cluster, f"/registry/deviceclasses/{name}", device_class(name, expression))
                await wait_for(lambda n=name: kube.get(DEVICE_CLASS, n), timeout=30, what=f"DeviceClass {name} served")
            await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": kind, "namespace": namespace},
                               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": name}}]}}})
            await kube.create(pinned_pod(kind, namespace, node, kind))

        for kind in classes:
            scheduled, message = await wait_for(
                lambda k=kind: _decision(kube, namespace, k), timeout=60, interval=0.2,
                what=f"the scheduler's decision on pod {kind}")
            verdict = await explain_live(kube, "pod", namespace, kind, driver)
            if kind == "bounded":
                assert scheduled, message
                assert verdict.satisfiable and verdict.nodes == [node] and verdict.error is None, verdict.conclusion
            elif kind == "admitted" and not stops_admitted:  # run to the end: no device matches
                assert not scheduled, f"{kind} was scheduled"
                assert not verdict.satisfiable and verdict.error is None, (verdict.conclusion, verdict.error)
            else:
                assert not scheduled, f"{kind} was scheduled"
                assert not verdict.satisfiable and verdict.error and COST_STOP in verdict.error, (
                    verdict.conclusion, verdict.notes, verdict.error)
                assert verdict.conclusion.startswith("the scheduler stops with an error"), verdict.conclusion
            over_estimate = any("exceeds the limit of 1,000,000" in note for note in verdict.notes)
            assert over_estimate == (kind != "admitted"), verdict.notes
    finally:
        for kind in classes:
            await kube.delete(POD, kind, namespace)
            await kube.delete(DEVICE_CLASS, f"{kind}-{token}")
        async for found in kube.list(SLICE, field_selector=f"spec.driver={driver}"):
            await kube.delete(SLICE, found["metadata"]["name"])


async def _decision(kube: Kube, namespace: str, name: str) -> tuple[bool, str] | None:
    return scheduling_outcome(await kube.get(POD, name, namespace))
