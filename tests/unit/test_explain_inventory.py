"""What explain's allocator sees of the cluster (gpudra_operator.explain.inventory), as the
scheduler's GatherPools and NodeMatches see it: which slices serve a node, only the newest
generation of a pool, incomplete and invalid pools, node selection and the devices claims hold."""

from __future__ import annotations

from typing import Any

from gpudra_operator.explain.inventory import (
    SliceIndex,
    allocated_devices,
    gather_pools,
    node_selector_matches,
    pod_fits_node,
)

DRIVER = "gpu.gpudra.io"


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def slice_(pool: str, *devices: str, generation: int = 1, count: int = 1, **where: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"{pool}-{generation}-{devices}"},
            "spec": {"driver": DRIVER, "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
                     "devices": [{"name": d} for d in devices], **where}}


def pools_of(slices: list[dict[str, Any]], of: dict[str, Any]) -> dict[str, tuple[list[str], bool, str | None]]:
    return {p.name: ([d.name for d in p.devices()], p.incomplete, p.invalid)
            for p in gather_pools(SliceIndex(slices), of)}


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


def test_allocated_devices_name_their_claim_and_admin_access_takes_nothing() -> None:
    def claim(name: str, *results: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": name},
                "status": {"allocation": {"devices": {"results": list(results)}}}}

    held = allocated_devices([
        claim("train", {"driver": DRIVER, "pool": "a", "device": "gpu-0", "request": "r"}),
        claim("monitor", {"driver": DRIVER, "pool": "a", "device": "gpu-1", "request": "r", "adminAccess": True}),
        {"metadata": {"name": "pending", "namespace": "ns"}}])
    assert held == {(DRIVER, "a", "gpu-0"): "ns/train"}
