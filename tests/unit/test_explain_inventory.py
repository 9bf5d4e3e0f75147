"""What explain sees of the cluster to explain the allocator's verdict (gpudra_operator.explain
.inventory and .room), as the scheduler's GatherPools, NodeMatches and allocated state see it:
which slices serve a node, only the newest generation of a pool, incomplete and invalid pools,
per-device node selection, the taints DeviceTaintRules add, node selection, what claims hold (whole devices, shares), the counters
allocated partitions leave, and the room a shared device has for a request."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from gpudra_operator.explain.claims import Request
from gpudra_operator.explain.inventory import (
    Device,
    SliceIndex,
    counters_left,
    gather_pools,
    holdings,
    node_selector_matches,
    pod_fits_node,
    with_taint_rules,
)
from gpudra_operator.explain.room import capacity_rooms, consumed, policy_refuses, show

DRIVER = "gpu.gpudra.io"


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def slice_(pool: str, *devices: str, generation: int = 1, count: int = 1, **where: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"{pool}-{generation}-{devices}"},
            "spec": {"driver": DRIVER, "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
                     "devices": [{"name": d} for d in devices], **where}}


def pools_of(slices: list[dict[str, Any]], of: dict[str, Any], *,
             partitionable: bool = False) -> dict[str, tuple[list[str], bool, str | None]]:
    return {p.name: ([d.name for d in p.devices()], p.incomplete, p.invalid)
            for p in gather_pools(SliceIndex(slices), of, partitionable=partitionable)}


def claim(name: str, *results: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": name},
            "status": {"allocation": {"devices": {"results": list(results)}}}}


def result(device: str, **extra: Any) -> dict[str, Any]:
    return {"driver": DRIVER, "pool": "a", "device": device, "request": "r", **extra}


def test_a_node_sees_its_own_slices_all_nodes_slices_and_those_whose_selector_matches() -> None:
    slices = [slice_("a", "gpu-0", nodeName="a"), slice_("b", "gpu-0", nodeName="b"),
              slice_("shared", "fabric-0", allNodes=True),
              slice_("zone-b", "nic-0", nodeSelector={"nodeSelectorTerms": [{"matchExpressions": [
                  {"key": "zone", "operator": "In", "values": ["b"]}]}]})]
    assert set(pools_of(slices, node("a", zone="a"))) == {"a", "shared"}
    assert set(pools_of(slices, node("b", zone="b"))) == {"b", "shared", "zone-b"}


def test_only_the_newest_generation_counts_and_a_pool_missing_slices_is_incomplete() -> None:
    slices = [slice_("a", "gpu-0", generation=1, nodeName="a"), slice_("a", "gpu-1", generation=2, count=2, nodeName="a")]
    assert pools_of(slices, node("a")) == {"a": (["gpu-1"], True, None)}
    complete = [*slices, slice_("a", "gpu-2", generation=2, count=2, nodeName="a")]
    assert pools_of(complete, node("a")) == {"a": (["gpu-1", "gpu-2"], False, None)}


def test_a_pool_short_of_slices_with_a_newer_generation_elsewhere_is_obsolete() -> None:
    # GatherPools looks for a newer generation only when the node's slices of the pool are too few
    moved = [slice_("p", "gpu-0", generation=1, count=2, nodeName="a"), slice_("p", "gpu-0", generation=2, nodeName="b")]
    assert pools_of(moved, node("a")) == {}
    complete_here = [slice_("p", "gpu-0", generation=1, nodeName="a"), slice_("p", "gpu-0", generation=2, nodeName="b")]
    assert pools_of(complete_here, node("a")) == {"p": (["gpu-0"], False, None)}


def test_duplicate_device_names_make_a_pool_invalid() -> None:
    duplicated = [slice_("a", "gpu-0", "gpu-0", nodeName="a")]
    assert pools_of(duplicated, node("a")) == {"a": (["gpu-0", "gpu-0"], False, "duplicate device name gpu-0")}


def test_per_device_node_selection_and_counter_slices_need_partitionable_devices() -> None:
    per_device = slice_("fabric", perDeviceNodeSelection=True, count=2)
    per_device["spec"]["devices"] = [{"name": "link-a", "nodeName": "a"}, {"name": "link-any", "allNodes": True},
                                     {"name": "link-b", "nodeName": "b"}]
    counters = slice_("fabric", count=2, nodeName="a", sharedCounters=[{"name": "s", "counters": {}}])
    del counters["spec"]["devices"]
    assert pools_of([per_device, counters], node("a"), partitionable=True) == {"fabric": (["link-a", "link-any"], False, None)}
    assert pools_of([per_device, counters], node("b"), partitionable=True) == {"fabric": (["link-any", "link-b"], False, None)}
    # without the gate both kinds of slice are left out: nothing for the node
    assert pools_of([per_device, counters], node("a")) == {}


def test_node_selectors_and_the_pods_own_node_selection() -> None:
    selector = {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["special"]}]}]}
    assert node_selector_matches(selector, node("big", gpus="8"))
    assert not node_selector_matches(selector, node("small", gpus="2"))
    assert node_selector_matches(selector, node("special"))
    assert not node_selector_matches({"nodeSelectorTerms": [{}]}, node("any"))  # an empty term matches nothing
    pod = {"spec": {"nodeSelector": {"zone": "b"}, "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "NotIn", "values": ["spot"]}]}]}}}}}
    assert pod_fits_node(pod, node("n1", zone="b"))
    assert not pod_fits_node(pod, node("n2", zone="b", pool="spot"))
    assert not pod_fits_node(pod, node("n3", zone="a"))


def test_what_claims_hold_whole_and_in_shares_and_admin_access_takes_nothing() -> None:
    claims = [claim("train", result("gpu-0")),
              claim("monitor", result("gpu-1", adminAccess=True)),
              claim("infer", result("gpu-2", shareID="s1", consumedCapacity={"memory": "10Gi", "shares": "1"})),
              claim("infer-2", result("gpu-2", shareID="s2", consumedCapacity={"memory": "4Gi", "shares": "1"})),
              {"metadata": {"name": "pending", "namespace": "ns"}}]
    held = holdings(claims, consumable=True)
    assert held.whole == {(DRIVER, "a", "gpu-0"): "ns/train"}
    assert [s.claim for s in held.shares[(DRIVER, "a", "gpu-2")]] == ["ns/infer", "ns/infer-2"]
    assert held.consumed((DRIVER, "a", "gpu-2")) == {"memory": Decimal(14 * 2**30), "shares": Decimal(2)}
    # without DRAConsumableCapacity in the scheduler a share holds its device whole
    assert holdings(claims, consumable=False).whole[(DRIVER, "a", "gpu-2")] == "ns/infer-2"


def test_counters_left_are_the_counter_sets_less_what_allocated_partitions_consume() -> None:
    pool = {"name": "a", "generation": 1, "resourceSliceCount": 2}
    counters = {"metadata": {"name": "counters"}, "spec": {"driver": DRIVER, "pool": pool, "nodeName": "a",
                "sharedCounters": [{"name": "gpu-0", "counters": {"memory": {"value": "40Gi"}, "sm": {"value": "98"}}}]}}
    partitions = {"metadata": {"name": "devices"}, "spec": {"driver": DRIVER, "pool": pool, "nodeName": "a", "devices": [
        {"name": f"mig-{i}", "consumesCounters": [{"counterSet": "gpu-0", "counters": {
            "memory": {"value": "10Gi"}, "sm": {"value": "14"}}}]} for i in range(4)]}}
    held = holdings([claim("x", result("mig-0")), claim("y", result("mig-3", shareID="s", consumedCapacity={}))],
                    consumable=True)
    left = counters_left(SliceIndex([counters, partitions]), held)[(DRIVER, "a")]["gpu-0"]
    assert (left["memory"].total, left["memory"].left, left["memory"].binary) == (40 * 2**30, 20 * 2**30, True)
    assert (left["sm"].left, left["sm"].binary) == (70, False)


def test_the_capacity_a_request_consumes_follows_the_request_policy() -> None:
    memory = {"value": "80Gi", "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "2Gi"}}}
    gib = Decimal(2**30)
    assert consumed(None, memory) == 80 * gib  # nothing asked: the default
    assert consumed("512Mi", memory) == 1 * gib  # up to the minimum
    assert consumed("4Gi", memory) == 5 * gib  # up to the next step from the minimum
    assert consumed(None, {"value": "4"}) == 4  # no policy: the whole capacity
    assert consumed("3", {"value": "8", "requestPolicy": {"validValues": ["2", "4", "8"]}}) == 4
    assert policy_refuses(81 * gib, memory, True) == "at most 80Gi"
    assert policy_refuses(5 * gib, memory, True) is None
    assert policy_refuses(Decimal(3), {"value": "8", "requestPolicy": {"validValues": ["2", "4"]}}, False) == "one of 2, 4"
    shown: list[tuple[Decimal, bool]] = [(Decimal(2554 * 2**20), True), (Decimal(4), False), (Decimal("0.5"), False),
                                         (Decimal(-2 * 2**30), True)]
    assert [show(amount, binary) for amount, binary in shown] == ["2554Mi", "4", "500m", "-2Gi"]


def test_the_room_of_a_shared_device_counts_every_share() -> None:
    device = Device(DRIVER, "a", {"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}}})
    held = holdings([claim("x", result("gpu-0", shareID="s", consumedCapacity={"memory": "60Gi"}))], consumable=True)
    request = Request("gpu", None, "c", (), False, 1, False, (), {"memory": "30Gi"})
    (room,) = capacity_rooms("n", device, request.capacity, held)
    assert not room.fits and room.describe() == "a/gpu-0 has 20Gi of 80Gi memory left, the request asks 30Gi (held: ns/x 60Gi)"


def test_device_taint_rules_add_their_taint_to_the_devices_they_select() -> None:
    slices = [slice_("a", "gpu-0", "gpu-1", nodeName="a"), slice_("b", "gpu-0", nodeName="b")]
    taint = {"key": "gpudra.io/maintenance", "effect": "NoSchedule"}

    def rule(**selector: str) -> dict[str, Any]:
        return {"spec": {"deviceSelector": selector, "taint": taint}}

    def tainted(rules: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(s["spec"]["pool"]["name"], d["name"]) for s in with_taint_rules(slices, rules)
                for d in s["spec"]["devices"] if d.get("taints")]

    assert tainted([rule(driver=DRIVER, pool="a", device="gpu-1")]) == [("a", "gpu-1")]
    assert tainted([rule(device="gpu-0")]) == [("a", "gpu-0"), ("b", "gpu-0")]
    assert tainted([rule(driver="other.example.com")]) == []
    assert tainted([{"spec": {"taint": taint}}]) == []  # no selector selects nothing
    assert "taints" not in slices[0]["spec"]["devices"][1]  # the slices read are left as they are


def test_extended_resources_are_those_outside_kubernetes_io() -> None:
    from gpudra_operator.explain.gather import extended_resources, taint_rule_type

    pod = {"spec": {"initContainers": [{"resources": {"limits": {"example.com/fpga": "1"}}}],
                    "containers": [{"resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "1",
                                                             "hugepages-2Mi": "1Gi"},
                                                  "requests": {"node.kubernetes.io/x": "1",
                                                               "deviceclass.resource.kubernetes.io/gpu": "1"}}}]}}
    assert extended_resources(pod) == ["deviceclass.resource.kubernetes.io/gpu", "example.com/fpga", "nvidia.com/gpu"]
    assert [taint_rule_type(m).api_version for m in (35, 36, 37, 38)] == [
        "resource.k8s.io/v1alpha3", "resource.k8s.io/v1beta2", "resource.k8s.io/v1", "resource.k8s.io/v1"]
