"""`gpudra explain` on inventories discovered from the shipped GPU profiles, DeviceClasses rendered
from the operator's own templates and hand-written partitionable slices: the verdict is Kubernetes'
own allocator's (gpudra-allocator of each release, the real binary: no stand-in), and the
explanation around it (counts, the rejecting selector, the room left on shared devices, the
conclusion) is gpudra's. A missing gpudra-allocator fails these tests with its message."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from gpudra_core.consumable import ConsumableCapacity, share_devices
from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices
from gpudra_operator.allocatorhelper import AllocatorError, AllocatorHelper
from gpudra_operator.deviceclasses import render_device_class
from gpudra_operator.explain import ExplainInputError, Snapshot, explain_snapshot
from gpudra_operator.explain.countersets import Left
from gpudra_operator.explain.report import as_json, as_text, as_yaml
from gpudra_operator.explain.verdict import Verdict

DRIVER = "gpu.gpudra.io"
FULL_GPU = "gpu.gpudra.io"
CLASSES = {FULL_GPU: render_device_class(FULL_GPU, DRIVER, template="full-gpu")}
RELEASES = (35, 36, 37)

Obj = dict[str, Any]


@pytest.fixture(scope="module")
async def helpers() -> AsyncIterator[dict[int, AllocatorHelper]]:
    """One gpudra-allocator per release for the module (each starts in milliseconds, but once is enough)."""
    opened = {minor: AllocatorHelper(minor) for minor in RELEASES}
    yield opened
    for helper in opened.values():
        await helper.close()


def node(name: str, **labels: str) -> Obj:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def slices_of(profile: str, node_name: str, taint: dict[str, str] | None = None,
              sharing: ConsumableCapacity | None = None) -> list[Obj]:
    devices = discover(FakeNvml(load_profile(profile)))
    if sharing is not None:
        devices, _ = share_devices(devices, sharing)
    slices = build_slices(DRIVER, node_name, None, 1, devices)
    if taint:
        for device in slices[0]["spec"]["devices"]:
            device["taints"] = [taint]
    return slices


def claim(requests: list[Obj], constraints: list[Obj] | None = None, *, name: str = "c",
          allocated: list[tuple[str, str]] | None = None, node_name: str = "", **result: Any) -> Obj:
    """A ResourceClaim as the API server stores it; ``allocated``: (pool, device) it holds, each
    result carrying ``result``'s fields (shareID, consumedCapacity, adminAccess)."""
    obj: Obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
                "spec": {"devices": {"requests": requests, "constraints": constraints or []}}}
    if allocated:
        obj["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": device,
                                     **copy.deepcopy(result)} for pool, device in allocated]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node_name]}]}]}}}
    return obj


def exactly(count: int = 1, *selectors: str, class_name: str = FULL_GPU, **extra: Any) -> Obj:
    """A request body with the API server's defaults (allocationMode ExactCount, count)."""
    body: Obj = {"deviceClassName": class_name, "allocationMode": "ExactCount", "count": count,
                 "selectors": [{"cel": {"expression": e}} for e in selectors], **extra}
    if body["allocationMode"] == "All":
        del body["count"]
    return body


def gpus(count: int = 1, *selectors: str, name: str = "gpu", **extra: Any) -> Obj:
    return {"name": name, "exactly": exactly(count, *selectors, **extra)}


async def run(helper: AllocatorHelper, claims: list[Obj], nodes: list[Obj], slices: list[Obj], *,
              pod: Obj | None = None, others: list[Obj] | tuple[Obj, ...] = (), classes: dict[str, Obj] = CLASSES,
              namespace: Obj | None = None) -> Verdict:
    snapshot = Snapshot(target="claim team/c", pod=pod, claims=claims, classes=classes, slices=slices, nodes=nodes,
                        other_claims=list(others), namespace=namespace, server_minor=helper.choice.minor)
    return await explain_snapshot(snapshot, DRIVER, helper)


MEMORY_64GI = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0'


async def test_a_claim_no_node_can_satisfy_names_the_selector_and_the_largest_value(helpers: dict[int, AllocatorHelper]) -> None:
    verdict = await run(helpers[35], [claim([gpus(8, MEMORY_64GI)])], [node("a100")], slices_of("dgx-a100-40gb", "a100"))
    assert not verdict.satisfiable and verdict.nodes == [] and verdict.error is None
    assert verdict.conclusion.startswith("no node can satisfy request gpu: 8 devices match the class, 0 pass request gpu #0")
    assert "memory=40Gi" in verdict.conclusion and "(largest: 40Gi on a100/gpu-" in verdict.conclusion
    (counts,) = verdict.claims[0].requests[0].nodes
    assert (counts.published, counts.class_match, counts.request_match, counts.free, counts.needed) == (8, 8, 0, 0, 8)


async def test_the_nodes_where_it_fits_are_named(helpers: dict[int, AllocatorHelper]) -> None:
    slices = slices_of("dgx-a100-40gb", "a100") + slices_of("dgx-h100", "h100-a") + slices_of("dgx-h100", "h100-b")
    verdict = await run(helpers[35], [claim([gpus(8, MEMORY_64GI)])], [node("a100"), node("h100-a"), node("h100-b")], slices)
    assert verdict.satisfiable and verdict.nodes == ["h100-a", "h100-b"]
    assert verdict.conclusion == "can be allocated on 2 nodes: h100-a, h100-b"
    assert verdict.allocator == "Kubernetes 1.35.4"


async def test_devices_held_by_other_claims_are_counted_and_named(helpers: dict[int, AllocatorHelper]) -> None:
    held = claim([gpus(6)], name="training", allocated=[("h100", f"gpu-{i}") for i in range(6)], node_name="h100")
    verdict = await run(helpers[35], [claim([gpus(4)])], [node("h100")], slices_of("dgx-h100", "h100"), others=[held])
    assert not verdict.satisfiable
    (counts,) = verdict.claims[0].requests[0].nodes
    assert (counts.request_match, counts.in_use, counts.free, counts.holders) == (8, 6, 2, {"team/training": 6})
    assert "at most 2 free on one node (h100)" in verdict.conclusion and "team/training (6)" in verdict.conclusion


async def test_a_missing_class_and_a_failing_selector_are_the_schedulers_errors(helpers: dict[int, AllocatorHelper]) -> None:
    helper = helpers[35]
    missing = await run(helper, [claim([{"name": "gpu", "exactly": exactly(class_name="nope.example.com")}])],
                        [node("h100")], slices_of("dgx-h100", "h100"))
    assert not missing.satisfiable and missing.conclusion == "request gpu: DeviceClass nope.example.com does not exist"
    failing = await run(helper, [claim([gpus(1, f'device.attributes["{DRIVER}"].memoryBandwidth > 5')])],
                        [node("h100"), node("l4")], slices_of("dgx-h100", "h100") + slices_of("l4x2", "l4"))
    # the allocator's error on the first node stops the scheduler on every node
    assert not failing.satisfiable and failing.error is not None and failing.error.startswith("on node h100: ")
    assert failing.conclusion.startswith("the scheduler stops with an error on node h100: ")
    assert "no such key: memoryBandwidth" in failing.conclusion
    assert "no such key: memoryBandwidth" in (failing.claims[0].requests[0].rejection.error or "")  # type: ignore[union-attr]
    # an error absorbed by || is no error, as in the scheduler
    absorbed = await run(helper, [claim([gpus(1, f'device.attributes["{DRIVER}"].memoryBandwidth > 5 || true')])],
                         [node("h100")], slices_of("dgx-h100", "h100"))
    assert absorbed.satisfiable


async def test_first_available_falls_back_to_the_next_subrequest(helpers: dict[int, AllocatorHelper]) -> None:
    request = {"name": "gpu", "firstAvailable": [{"name": "big", **exactly(4, MEMORY_64GI)}, {"name": "small", **exactly(1)}]}
    verdict = await run(helpers[35], [claim([request])], [node("l4")], slices_of("l4x2", "l4"))
    assert verdict.satisfiable and verdict.nodes == ["l4"]
    assert [r.name for r in verdict.claims[0].requests] == ["gpu/big", "gpu/small"]


async def test_match_attribute_needs_one_value_across_requests(helpers: dict[int, AllocatorHelper]) -> None:
    numa = f"{DRIVER}/numaNode"
    # dgx-h100 has four GPUs per NUMA node: 4 fit together, 5 do not
    fits = await run(helpers[35], [claim([gpus(2, name="a"), gpus(2, name="b")],
                                         [{"requests": ["a", "b"], "matchAttribute": numa}])],
                     [node("h100")], slices_of("dgx-h100", "h100"))
    assert fits.satisfiable
    too_many = await run(helpers[35], [claim([gpus(3, name="a"), gpus(2, name="b")],
                                             [{"requests": ["a", "b"], "matchAttribute": numa}])],
                         [node("h100")], slices_of("dgx-h100", "h100"))
    assert not too_many.satisfiable and too_many.error is None
    assert too_many.conclusion.startswith("no node can satisfy all requests together under the constraints")


async def test_allocation_mode_all_wants_every_matching_device_free(helpers: dict[int, AllocatorHelper]) -> None:
    every = gpus(name="gpu", allocationMode="All")
    assert (await run(helpers[35], [claim([every])], [node("h100")], slices_of("dgx-h100", "h100"))).satisfiable
    held = claim([gpus(1)], name="other", allocated=[("h100", "gpu-3")], node_name="h100")
    blocked = await run(helpers[35], [claim([every])], [node("h100")], slices_of("dgx-h100", "h100"), others=[held])
    assert not blocked.satisfiable and "needs all 8 on one node, at most 7 free" in blocked.conclusion


async def test_admin_access_takes_a_device_in_use_and_needs_the_namespace_label(helpers: dict[int, AllocatorHelper]) -> None:
    held = claim([gpus(2)], name="training", allocated=[("l4", "gpu-0"), ("l4", "gpu-1")], node_name="l4")
    namespace = {"metadata": {"name": "team", "labels": {}}}
    monitor = await run(helpers[35], [claim([gpus(2, adminAccess=True)])], [node("l4")], slices_of("l4x2", "l4"),
                        others=[held], namespace=namespace)
    assert monitor.satisfiable and monitor.claims[0].requests[0].nodes[0].free == 2
    assert any("ask for adminAccess, but namespace team lacks the label resource.kubernetes.io/admin-access=true" in n
               for n in monitor.notes)
    # what an admin-access result holds is held by nobody
    watched = claim([gpus(2)], name="monitor", allocated=[("l4", "gpu-0"), ("l4", "gpu-1")], node_name="l4",
                    adminAccess=True)
    assert (await run(helpers[35], [claim([gpus(2)])], [node("l4")], slices_of("l4x2", "l4"), others=[watched])).satisfiable


@pytest.mark.parametrize("minor, heeded", [(35, False), (36, True)])
async def test_untolerated_taints_where_the_scheduler_heeds_them(helpers: dict[int, AllocatorHelper], minor: int,
                                                                 heeded: bool) -> None:
    """DRADeviceTaints is off in 1.35's scheduler (taints are ignored) and on from 1.36."""
    taint = {"key": "gpudra.io/unhealthy", "value": "xid", "effect": "NoSchedule"}
    slices = slices_of("l4x2", "l4", taint=taint)
    tainted = await run(helpers[minor], [claim([gpus(1)])], [node("l4")], slices)
    assert tainted.satisfiable is not heeded
    assert tainted.claims[0].requests[0].nodes[0].untolerated == (2 if heeded else 0)
    if heeded:
        assert "2 with taints the request does not tolerate" in tainted.conclusion
    tolerating = gpus(1, tolerations=[{"key": "gpudra.io/unhealthy", "operator": "Exists"}])
    assert (await run(helpers[minor], [claim([tolerating])], [node("l4")], slices)).satisfiable


async def test_device_taint_rules_taint_the_devices_they_select(helpers: dict[int, AllocatorHelper]) -> None:
    """1.37's scheduler adds the taints of DeviceTaintRules (resource.k8s.io/v1) to the devices they select."""
    rule = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "maintenance"},
            "spec": {"deviceSelector": {"driver": DRIVER, "pool": "l4", "device": "gpu-0"},
                     "taint": {"key": "gpudra.io/maintenance", "effect": "NoSchedule"}}}
    snapshot = Snapshot(target="claim team/c", pod=None, claims=[claim([gpus(2)])], classes=CLASSES,
                        slices=slices_of("l4x2", "l4"), nodes=[node("l4")], other_claims=[], namespace=None,
                        server_minor=37, taint_rules=[rule])
    verdict = await explain_snapshot(snapshot, DRIVER, helpers[37])
    assert not verdict.satisfiable and verdict.claims[0].requests[0].nodes[0].untolerated == 1
    assert verdict.conclusion.endswith("at most 1 free on one node (l4) of 2 matching; 1 with taints the request "
                                       "does not tolerate")
    snapshot.claims = [claim([gpus(2, tolerations=[{"key": "gpudra.io/maintenance", "operator": "Exists"}])])]
    assert (await explain_snapshot(snapshot, DRIVER, helpers[37])).satisfiable


async def test_the_pods_node_selection_limits_the_nodes(helpers: dict[int, AllocatorHelper]) -> None:
    pod = {"metadata": {"name": "p", "namespace": "team"}, "spec": {"nodeSelector": {"zone": "b"}}}
    slices = slices_of("l4x2", "l4-a") + slices_of("l4x2", "l4-b")
    verdict = await run(helpers[35], [claim([gpus(1)])], [node("l4-a", zone="a"), node("l4-b", zone="b")], slices, pod=pod)
    assert verdict.nodes == ["l4-b"] and "leaves 1 of 2 nodes" in " ".join(verdict.notes)
    nowhere = await run(helpers[35], [claim([gpus(1)])], [node("l4-a", zone="a")], slices_of("l4x2", "l4-a"), pod=pod)
    assert not nowhere.satisfiable and nowhere.conclusion.startswith("no node can run the pod")


async def test_an_allocated_claim_says_where(helpers: dict[int, AllocatorHelper]) -> None:
    done = claim([gpus(1)], allocated=[("h100", "gpu-0")], node_name="h100")
    verdict = await run(helpers[35], [done], [node("h100"), node("other")], slices_of("dgx-h100", "h100"))
    assert verdict.satisfiable and verdict.conclusion == f"allocated on h100: team/c: {DRIVER}/h100/gpu-0"
    del done["status"]["allocation"]["nodeSelector"]  # e.g. a network-attached device: any node
    anywhere = await run(helpers[35], [done], [node("h100")], slices_of("dgx-h100", "h100"))
    assert anywhere.satisfiable and anywhere.conclusion == f"allocated on any node: team/c: {DRIVER}/h100/gpu-0"


async def test_only_the_drivers_requests_are_explained(helpers: dict[int, AllocatorHelper]) -> None:
    foreign_class = {"metadata": {"name": "fpga.example.com"},
                     "spec": {"selectors": [{"cel": {"expression": 'device.driver == "fpga.example.com"'}}]}}
    classes = {**CLASSES, "fpga.example.com": foreign_class}
    fpga = {"name": "fpga", "exactly": exactly(class_name="fpga.example.com")}
    verdict = await run(helpers[35], [claim([gpus(1), fpga])], [node("l4")], slices_of("l4x2", "l4"), classes=classes)
    assert verdict.satisfiable and [r.name for r in verdict.claims[0].requests] == ["gpu"]
    assert any("request fpga" in n and "not explained" in n for n in verdict.notes)
    with pytest.raises(ExplainInputError, match="no request is for gpu.gpudra.io's devices"):
        await run(helpers[35], [claim([fpga])], [node("l4")], [], classes=classes)


async def test_text_ends_with_the_conclusion_and_the_data_formats_carry_everything(helpers: dict[int, AllocatorHelper]) -> None:
    verdict = await run(helpers[35], [claim([gpus(8, MEMORY_64GI)])], [node("a100")], slices_of("dgx-a100-40gb", "a100"))
    text = as_text(verdict)
    lines = text.splitlines()
    assert lines[-1] == verdict.conclusion
    assert lines[1].split() == ["CLAIM", "REQUEST", "CLASS", "NODE", "PUBLISHED", "CLASS-MATCH", "REQUEST-MATCH",
                                "TAINTED", "IN-USE", "NO-ROOM", "FREE", "NEEDED"]
    assert lines[2].split() == ["team/c", "gpu", FULL_GPU, "a100", "8", "8", "0", "0", "0", "0", "0", "8"]
    assert "  allocator: Kubernetes 1.35.4" in lines
    assert '"satisfiable": false' in as_json(verdict) and '"allocator": "Kubernetes 1.35.4"' in as_json(verdict)
    assert "satisfiable: false" in as_yaml(verdict) and "allocator: Kubernetes 1.35.4" in as_yaml(verdict)


async def test_an_all_subrequest_after_a_counted_one_is_each_releases_own(helpers: dict[int, AllocatorHelper]) -> None:
    """The 1.35 allocator recurses out of an ``All`` subrequest without its subrequest index, so on
    a one-GPU node [8 GPUs, else All] is unschedulable there; 1.36's passes the index on. Explain
    says what the cluster's scheduler does, since it runs that release's allocator."""
    every = {"name": "s1", "deviceClassName": FULL_GPU, "allocationMode": "All"}
    request = {"name": "gpu", "firstAvailable": [{"name": "s0", **exactly(8)}, every]}
    assert not (await run(helpers[35], [claim([request])], [node("h200")], slices_of("h200", "h200"))).satisfiable
    assert (await run(helpers[35], [claim([request])], [node("h100")], slices_of("dgx-h100", "h100"))).satisfiable
    assert (await run(helpers[36], [claim([request])], [node("h200")], slices_of("h200", "h200"))).satisfiable


@pytest.mark.parametrize("expression", ["device.driver ==", f'device.attributes["{DRIVER}"].nope(1)'])
async def test_a_selector_that_does_not_compile_is_bad_input(helpers: dict[int, AllocatorHelper], expression: str) -> None:
    with pytest.raises(ExplainInputError) as info:
        await run(helpers[35], [claim([gpus(1, expression)])], [node("l4")], slices_of("l4x2", "l4"))
    assert str(info.value).startswith("claim team/c request gpu selector #0 does not compile (the scheduler fails the "
                                      "pod with this error too): compilation failed: ")
    assert "\n" not in str(info.value)


# --- consumable capacity -------------------------------------------------------------------------

SHARING = ConsumableCapacity.parse("1Gi", 4)  # each L4 (23034Mi): memory in 1Gi steps up to 22Gi, 4 shares


def shares(name: str, *devices: str, memory: str) -> Obj:
    return claim([gpus(1, capacity={"requests": {"memory": memory}})], name=name, node_name="l4",
                 allocated=[("l4", d) for d in devices], shareID=f"share-{name}",
                 consumedCapacity={"memory": memory, "shares": "1"})


async def test_a_shared_device_is_not_in_use_while_its_capacity_lasts(helpers: dict[int, AllocatorHelper]) -> None:
    slices = slices_of("l4x2", "l4", sharing=SHARING)
    others = [shares("a", "gpu-0", "gpu-1", memory="10Gi"), shares("b", "gpu-0", "gpu-1", memory="10Gi")]
    small = await run(helpers[37], [claim([gpus(1, capacity={"requests": {"memory": "2Gi"}})])], [node("l4")], slices,
                      others=others)
    assert small.satisfiable and small.conclusion == "can be allocated on 1 node: l4"
    (counts,) = small.claims[0].requests[0].nodes
    assert (counts.in_use, counts.no_room, counts.free) == (0, 0, 2)
    memory = next(r for r in small.claims[0].requests[0].rooms if r.name == "memory")
    assert (memory.fits, memory.total, memory.held, memory.left, memory.asks) == (True, "23034Mi", "20Gi", "2554Mi", "2Gi")
    assert memory.holders == {"team/a": "10Gi", "team/b": "10Gi"}

    big = await run(helpers[37], [claim([gpus(1, capacity={"requests": {"memory": "4Gi"}})])], [node("l4")], slices,
                    others=others)
    assert not big.satisfiable
    (counts,) = big.claims[0].requests[0].nodes
    assert (counts.in_use, counts.no_room, counts.free) == (0, 2, 0)
    assert "in use" not in big.conclusion
    assert big.conclusion.endswith("; 2 without room for it, e.g. l4/gpu-0 has 2554Mi of 23034Mi memory left, "
                                   "the request asks 4Gi (held: team/a 10Gi, team/b 10Gi)")
    assert "request gpu: no room: l4/gpu-0 has 2554Mi of 23034Mi memory left" in as_text(big)


async def test_shares_counted_and_the_request_policy(helpers: dict[int, AllocatorHelper]) -> None:
    slices = slices_of("l4x2", "l4", sharing=SHARING)
    four = [shares(f"share-{i}", "gpu-0", "gpu-1", memory="1Gi") for i in range(4)]
    full = await run(helpers[37], [claim([gpus(1, capacity={"requests": {"memory": "1Gi"}})])], [node("l4")], slices,
                     others=four)
    assert not full.satisfiable and "l4/gpu-0 has 0 of 4 shares left, the request asks 1" in full.conclusion
    # a request past the policy's maximum: no device can give it, shared or not
    greedy = await run(helpers[37], [claim([gpus(1, capacity={"requests": {"memory": "30Gi"}})])], [node("l4")], slices)
    assert not greedy.satisfiable
    assert ("l4/gpu-0 cannot give the 30Gi memory the request asks: its request policy allows at most 22Gi"
            in greedy.conclusion)
    unknown = await run(helpers[37], [claim([gpus(1, capacity={"requests": {"bandwidth": "1"}})])], [node("l4")], slices)
    assert not unknown.satisfiable and "l4/gpu-0 has no capacity bandwidth, which the request asks for" in unknown.conclusion


async def test_without_consumable_capacity_a_share_holds_the_whole_device(helpers: dict[int, AllocatorHelper]) -> None:
    slices = slices_of("l4x2", "l4", sharing=SHARING)
    others = [shares("a", "gpu-0", "gpu-1", memory="1Gi")]
    async with AllocatorHelper(37, feature_gates={"DRAConsumableCapacity": False}) as helper:
        verdict = await run(helper, [claim([gpus(1)])], [node("l4")], slices, others=others)
    assert not verdict.satisfiable and "in use by team/a (2)" in verdict.conclusion
    assert verdict.feature_gates == {"DRAConsumableCapacity": False}
    assert "  allocator: Kubernetes 1.37.2, feature gates DRAConsumableCapacity=false" in as_text(verdict).splitlines()
    # the same cluster with the release's default gates: the devices are shared, and a request that
    # asks no memory asks the policy's default, the whole GPU
    whole = await run(helpers[37], [claim([gpus(1)])], [node("l4")], slices, others=others)
    assert not whole.satisfiable and "in use" not in whole.conclusion
    assert "l4/gpu-0 has 22010Mi of 23034Mi memory left, the request asks 22Gi (held: team/a 1Gi)" in whole.conclusion
    part = gpus(1, capacity={"requests": {"memory": "2Gi"}})
    assert (await run(helpers[37], [claim([part])], [node("l4")], slices, others=others)).satisfiable


# --- partitionable devices -----------------------------------------------------------------------

PARTITION_CLASS = {"metadata": {"name": "partition.gpudra.io"},
                   "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}


def partitioned(node_name: str, sizes: dict[str, str], total: str = "40Gi") -> list[Obj]:
    """A GPU of ``total`` memory as partitions ``sizes`` (name -> memory), drawing on one counter
    set published in a slice of its own (1.35+)."""
    pool = {"name": node_name, "generation": 1, "resourceSliceCount": 2}
    counters = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node_name}-counters"},
                "spec": {"driver": DRIVER, "pool": pool, "nodeName": node_name,
                         "sharedCounters": [{"name": "gpu-0", "counters": {"memory": {"value": total}}}]}}
    devices = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node_name}-devices"},
               "spec": {"driver": DRIVER, "pool": pool, "nodeName": node_name, "devices": [
                   {"name": name, "attributes": {"size": {"string": name}},
                    "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": size}}}]}
                   for name, size in sizes.items()]}}
    return [counters, devices]


def partition(count: int = 1, *selectors: str) -> Obj:
    return {"name": "gpu", "exactly": exactly(count, *selectors, class_name="partition.gpudra.io")}


async def test_partitions_say_how_much_of_the_counters_is_left(helpers: dict[int, AllocatorHelper]) -> None:
    classes = {"partition.gpudra.io": PARTITION_CLASS}
    slices = partitioned("a100", {"half-0": "20Gi", "half-1": "20Gi", "whole": "40Gi"})
    holder = claim([partition()], name="half", allocated=[("a100", "half-0")], node_name="a100")
    whole = f'device.attributes["{DRIVER}"].size == "whole"'
    verdict = await run(helpers[36], [claim([partition(1, whole)])], [node("a100")], slices, others=[holder],
                        classes=classes)
    assert not verdict.satisfiable
    (counts,) = verdict.claims[0].requests[0].nodes
    assert (counts.request_match, counts.in_use, counts.no_room, counts.free) == (1, 0, 1, 0)
    assert verdict.conclusion.endswith("e.g. a100/whole needs 40Gi of counter memory of counter set gpu-0, "
                                       "20Gi of 40Gi left; counter set gpu-0 on a100: memory 20Gi of 40Gi left; "
                                       "held by team/half (half-0)")
    half = f'device.attributes["{DRIVER}"].size != "whole"'
    assert (await run(helpers[36], [claim([partition(1, half)])], [node("a100")], slices, others=[holder],
                      classes=classes)).satisfiable
    # 1.35's scheduler has DRAPartitionableDevices off: such devices are never allocated
    old = await run(helpers[35], [claim([partition(1, half)])], [node("a100")], slices, classes=classes)
    assert not old.satisfiable
    assert "consumes counters, which the scheduler allocates only with DRAPartitionableDevices on" in old.conclusion


async def test_partitions_that_fit_alone_but_not_together(helpers: dict[int, AllocatorHelper]) -> None:
    slices = partitioned("a100", {"big-0": "30Gi", "big-1": "30Gi"})
    verdict = await run(helpers[36], [claim([partition(2)])], [node("a100")], slices,
                        classes={"partition.gpudra.io": PARTITION_CLASS})
    assert not verdict.satisfiable and verdict.claims[0].requests[0].nodes[0].free == 2
    assert verdict.conclusion.startswith("no node can satisfy all requests together: each fits alone, but the devices "
                                         "draw on the same counters")


def mig_claim(name: str, profile: str, gpu: int = 0, *, held: str | None = None, **result: Any) -> Obj:
    """A claim for one dynamic MIG placement of ``profile`` on GPU ``gpu``; ``held``: the placement
    it is allocated, its result carrying ``result``'s fields."""
    attributes = f'device.attributes["{DRIVER}"]'
    expression = f'{attributes}.type == "mig" && {attributes}.parentIndex == {gpu} && {attributes}.profile == "{profile}"'
    return claim([{"name": "gpu", "exactly": exactly(1, expression, class_name="partition.gpudra.io")}], name=name,
                 allocated=[("h100", held)] if held else None, node_name="h100", **result)


async def test_a_mig_claim_short_of_counters_names_the_placements_taken_and_their_claims(
        helpers: dict[int, AllocatorHelper]) -> None:
    """The scene of tests/integration/test_dynamic_mig.py: a 4g.40gb, a 2g.20gb and a 1g.10gb fill GPU 0;
    an adminAccess claim on its 7g.80gb holds nothing, as for the allocator."""
    slices = build_slices(DRIVER, "h100", None, 1, discover(FakeNvml(load_profile("h100-dynamic-mig")), mig="dynamic"))
    holders = [mig_claim("four", "4g.40gb", held="gpu-0-mig-4g40gb-at0"),
               mig_claim("two", "2g.20gb", held="gpu-0-mig-2g20gb-at4"),
               mig_claim("one", "1g.10gb", held="gpu-0-mig-1g10gb-at6"),
               mig_claim("watch", "7g.80gb", held="gpu-0-mig-7g80gb-at0", adminAccess=True)]
    classes = {"partition.gpudra.io": PARTITION_CLASS}
    for minor in (36, 37):
        verdict = await run(helpers[minor], [mig_claim("c", "1g.10gb")], [node("h100")], slices, others=holders,
                            classes=classes)
        assert not verdict.satisfiable
        assert verdict.conclusion.endswith(
            "e.g. h100/gpu-0-mig-1g10gb-at0 needs 1 of counter compute-slices of counter set gpu-0-counters, 0 of 7 "
            "left; counter set gpu-0-counters on h100: compute-slices 0 of 7, decoders 0 of 7, jpeg-engines 0 of 7 "
            "left; memory slices 0-6 taken, 7 free; held by team/four (gpu-0-mig-4g40gb-at0), team/two "
            "(gpu-0-mig-2g20gb-at4), team/one (gpu-0-mig-1g10gb-at6)"), verdict.conclusion
    (request,) = verdict.claims[0].requests
    (use,) = request.counter_sets
    assert (use.pool, use.name, use.node, use.more_taken) == ("h100", "gpu-0-counters", "h100", 0)
    assert [(t.device, t.claims) for t in use.taken] == [("gpu-0-mig-4g40gb-at0", ["team/four"]),
                                                         ("gpu-0-mig-2g20gb-at4", ["team/two"]),
                                                         ("gpu-0-mig-1g10gb-at6", ["team/one"])]
    assert use.counters["copy-engines"] == Left(total="8", left="1")
    assert use.counters["memory-slice-7"] == Left(total="1", left="1")
    assert sorted(use.short) == ["compute-slices", "decoders", "jpeg-engines"] + [f"memory-slice-{i}" for i in range(6)]
    # the detail names every counter; -o yaml and -o json carry the structure
    assert ("  request gpu: short of counter set gpu-0-counters on h100: compute-slices 0 of 7, copy-engines 1 of 8, "
            "decoders 0 of 7, jpeg-engines 0 of 7, ofa-engines 1 of 1 left; memory slices 0-6 taken, 7 free; held by "
            "team/four (gpu-0-mig-4g40gb-at0), team/two (gpu-0-mig-2g20gb-at4), team/one (gpu-0-mig-1g10gb-at6)"
            ) in as_text(verdict).splitlines()
    data = yaml.safe_load(as_yaml(verdict))["claims"][0]["requests"][0]["counter_sets"][0]
    assert data["taken"][0] == {"device": "gpu-0-mig-4g40gb-at0", "claims": ["team/four"], "more_claims": 0}
    assert data["counters"]["compute-slices"] == {"total": "7", "left": "0"}
    assert '"name": "gpu-0-counters"' in as_json(verdict)
    # GPU 1 is untouched: a 1g.10gb fits there, and nothing is short
    free = await run(helpers[37], [mig_claim("c", "1g.10gb", 1)], [node("h100")], slices, others=holders,
                     classes=classes)
    assert free.satisfiable and free.claims[0].requests[0].counter_sets == []
    # once a claim holds GPU 1 whole (every counter of its set), that claim is named
    whole = claim([gpus(1)], name="whole", allocated=[("h100", "gpu-1")], node_name="h100")
    taken = await run(helpers[37], [mig_claim("c", "1g.10gb", 1)], [node("h100")], slices, others=[*holders, whole],
                      classes=classes)
    assert taken.conclusion.endswith(
        "; counter set gpu-1-counters on h100: compute-slices 0 of 7, copy-engines 0 of 8, decoders 0 of 7, "
        "jpeg-engines 0 of 7 left; memory slices 0-7 taken; held by team/whole (gpu-1)"), taken.conclusion


async def test_binding_conditions_make_the_allocation_wait(helpers: dict[int, AllocatorHelper]) -> None:
    slices = slices_of("l4x2", "l4")
    for device in slices[0]["spec"]["devices"]:
        device.update(bindingConditions=["gpudra.io/attached"], bindingFailureConditions=["gpudra.io/failed"])
    waits = await run(helpers[36], [claim([gpus(1)])], [node("l4")], slices)
    assert waits.satisfiable
    assert any(n.startswith("the allocation waits for its devices' binding conditions") and
               "l4: l4/gpu-0 (gpudra.io/attached)" in n for n in waits.notes)
    never = await run(helpers[35], [claim([gpus(1)])], [node("l4")], slices)
    assert not never.satisfiable and ("has binding conditions, which the scheduler allocates only with "
                                      "DRADeviceBindingConditions and DRAResourceClaimDeviceStatus on") in never.conclusion


# --- the allocator itself --------------------------------------------------------------------------

async def test_an_unknown_feature_gate_is_the_helpers_refusal() -> None:
    async with AllocatorHelper(37, feature_gates={"DRANope": True}) as helper:
        with pytest.raises(AllocatorError, match=r"unknown DRA feature gate\(s\) for Kubernetes 1.37.2: \[DRANope\]"):
            await run(helper, [claim([gpus(1)])], [node("l4")], slices_of("l4x2", "l4"))


async def test_a_release_without_its_own_allocator_is_said() -> None:
    async with AllocatorHelper(99) as helper:
        verdict = await run(helper, [claim([gpus(1)])], [node("l4")], slices_of("l4x2", "l4"))
    assert verdict.satisfiable and verdict.allocator.startswith(f"Kubernetes 1.{helper.choice.minor}.")
    assert verdict.notes[0].startswith("the cluster runs Kubernetes 1.99; gpudra has no allocator of that release and "
                                       f"answers with 1.{helper.choice.minor}'s")
    assert f"  note: {verdict.notes[0]}" in as_text(verdict)


async def test_a_selector_estimated_past_the_cost_limit_gets_a_note(helpers: dict[int, AllocatorHelper]) -> None:
    """The API server refuses it today (it was stored under older rules); the scheduler still runs it."""
    attributes = f'device.attributes["{DRIVER}"]'
    costly = f"{attributes}.all(a, {attributes}.all(b, {attributes}.all(c, {attributes}.all(d, true))))"
    verdict = await run(helpers[35], [claim([gpus(1, costly)])], [node("l4")], slices_of("l4x2", "l4"))
    assert verdict.satisfiable
    assert any(n.startswith("claim team/c request gpu selector #0: its estimated CEL cost (3,382,500) exceeds the "
                            "limit of 1,000,000") for n in verdict.notes)


async def test_a_pod_pinned_away_from_its_allocated_claims_node_cannot_run() -> None:
    # Found by the differential test: every claim allocated on n1, the pod pinned to n2.
    from gpudra_operator.explain.verdict import explain, scene
    from gpudra_operator.explain.verdict import Answers

    node = lambda name: {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}  # noqa: E731
    allocated = {"metadata": {"name": "c", "namespace": "team", "uid": "c"},
                 "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu"}}]}},
                 "status": {"allocation": {"devices": {"results": [
                     {"request": "r", "driver": "gpu.example.com", "pool": "n1", "device": "gpu-0"}]},
                     "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                         {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}}
    for pinned, runs in (("n2", False), ("n1", True)):
        pod = {"metadata": {"name": "p", "namespace": "team"}, "spec": {"nodeSelector": {"kubernetes.io/hostname": pinned}}}
        asked = scene("pod team/p", [allocated], pod=pod, classes={}, slices=[], nodes=[node("n1"), node("n2")],
                      other_claims=[], namespace=None, driver="gpu.example.com", gates={}, taint_rules=[])
        verdict = explain(asked, Answers(release="1.36.3", nodes=[], selectors={}, feature_gates={}, note=None))
        assert verdict.satisfiable is runs, verdict.conclusion
        if not runs:
            assert "excludes every node" in verdict.conclusion, verdict.conclusion
