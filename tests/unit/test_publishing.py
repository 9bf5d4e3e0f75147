"""The pure publishing plan: what the agent writes for a given observed state of its pool."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_driver.publishing.plan import PublishPlan, SliceRef, matches, plan_publish
from gpudra_driver.publishing.slices import build_slices

DRIVER = "gpu.gpudra.io"
NODE = "node-a"
UID = "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"
_serial = itertools.count(1)


def devices(n: int, memory_mib: int = 81559) -> list[Device]:
    return [
        Device(f"gpu-{i}",
               {"type": AttrValue.of_string("gpu"),
                "uuid": AttrValue.of_string(f"GPU-{i:08x}-0000-0000-0000-000000000000"),
                "index": AttrValue.of_int(i)},
               {"memory": memory_mib * 2**20})
        for i in range(n)
    ]


def served(slice_: dict[str, Any]) -> dict[str, Any]:
    """``slice_`` as the API server returns it: with uid, resourceVersion and server metadata."""
    live = copy.deepcopy(slice_)
    n = next(_serial)
    live["metadata"].update(uid=f"uid-{n}", resourceVersion=str(1000 + n), creationTimestamp="2026-01-01T00:00:00Z",
                            managedFields=[{"manager": "gpudra-agent", "operation": "Apply"}])
    return live


def observed_at(generation: int, n: int, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return {s["metadata"]["name"]: served(s) for s in build_slices(DRIVER, NODE, UID, generation, devices(n), **kwargs)}


def plan(devs: list[Device], observed: dict[str, dict[str, Any]], last: int = 0) -> PublishPlan:
    return plan_publish(DRIVER, NODE, UID, devs, observed, last)


def test_first_publish_starts_at_generation_one() -> None:
    p = plan(devices(8), {})
    assert p.generation == 1 and not p.delete and not p.empty
    (only,) = p.apply
    assert only["metadata"]["name"] == "node-a-gpu-gpudra-io-0"
    assert only["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in only["spec"]["devices"]] == [f"gpu-{i}" for i in range(8)]


def test_nothing_to_write_when_observed_equals_desired() -> None:
    observed = observed_at(4, 300)
    p = plan(devices(300), observed, last=4)
    assert p.empty and p.generation == 4
    # After a restart the agent has no memory (last=0) and adopts the pool as it finds it.
    assert plan(devices(300), observed, last=0) == PublishPlan(4)
    # Labels and annotations that others add to our slices are not a difference.
    for live in observed.values():
        live["metadata"]["labels"]["team"] = "ml"
        live["metadata"]["annotations"] = {"note": "x"}
    assert plan(devices(300), observed, last=4).empty


def test_a_device_change_bumps_the_generation_above_observed_and_above_last() -> None:
    observed = observed_at(4, 8)
    bigger = plan(devices(8, memory_mib=40960), observed, last=2)
    assert bigger.generation == 5
    assert [s["spec"]["pool"]["generation"] for s in bigger.apply] == [5]
    assert bigger.apply[0]["spec"]["devices"][0]["capacity"]["memory"] == {"value": "40Gi"}
    # The publisher wrote generation 9 before (the pool was since rolled back by someone):
    # never reuse a generation that caches may still hold.
    assert plan(devices(8, memory_mib=40960), observed, last=9).generation == 10


def test_observed_below_our_last_generation_is_republished() -> None:
    # Equal content, but older than what we last wrote: a stale restore by someone else.
    p = plan(devices(8), observed_at(3, 8), last=5)
    assert p.generation == 6 and len(p.apply) == 1 and not p.delete


def test_a_deleted_slice_is_restored_with_a_new_generation() -> None:
    observed = observed_at(2, 300)
    del observed["node-a-gpu-gpudra-io-1"]
    p = plan(devices(300), observed, last=2)
    assert p.generation == 3 and not p.delete
    # All slices are rewritten: the scheduler only trusts a pool whose slices share one generation.
    assert [s["metadata"]["name"] for s in p.apply] == [f"node-a-gpu-gpudra-io-{i}" for i in range(3)]
    assert {s["spec"]["pool"]["generation"] for s in p.apply} == {3}


def test_obsolete_slices_are_deleted_with_uid_and_resource_version() -> None:
    observed = observed_at(6, 300)  # three slices
    p = plan(devices(3), observed, last=6)
    assert p.generation == 7
    assert [s["metadata"]["name"] for s in p.apply] == ["node-a-gpu-gpudra-io-0"]
    assert p.apply[0]["spec"]["pool"]["resourceSliceCount"] == 1
    expected = [SliceRef(name, observed[name]["metadata"]["uid"], observed[name]["metadata"]["resourceVersion"])
                for name in ("node-a-gpu-gpudra-io-1", "node-a-gpu-gpudra-io-2")]
    assert p.delete == expected


def test_a_foreign_edit_of_our_slice_is_republished() -> None:
    desired = build_slices(DRIVER, NODE, UID, 3, devices(4))[0]
    edits = {
        "device dropped": lambda s: s["spec"].__setitem__("devices", s["spec"]["devices"][:3]),
        "attribute changed": lambda s: s["spec"]["devices"][0]["attributes"]["uuid"].__setitem__("string", "GPU-x"),
        "attribute added": lambda s: s["spec"]["devices"][0]["attributes"].__setitem__("extra", {"int": 1}),
        "capacity added": lambda s: s["spec"]["devices"][1]["capacity"].__setitem__("cores", {"value": "9"}),
        "count changed": lambda s: s["spec"]["pool"].__setitem__("resourceSliceCount", 2),
        "owner removed": lambda s: s["metadata"].pop("ownerReferences"),
        "label changed": lambda s: s["metadata"]["labels"].__setitem__("gpudra.io/node", "node-b"),
        "devices emptied": lambda s: s["spec"].pop("devices"),
    }
    for what, edit in edits.items():
        live = served(desired)
        edit(live)
        assert not matches(live, desired), what
        p = plan(devices(4), {live["metadata"]["name"]: live}, last=3)
        assert p.generation == 4, what
        assert [s["metadata"]["name"] for s in p.apply] == [desired["metadata"]["name"]], what
        assert p.apply[0]["spec"]["devices"] == desired["spec"]["devices"], what
        assert not p.delete, what
    assert matches(served(desired), desired)


def test_a_foreign_slice_on_our_node_is_deleted_and_ours_goes_above_its_generation() -> None:
    observed = observed_at(2, 4)
    foreign = served({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                      "metadata": {"name": "someone-elses"},
                      "spec": {"driver": DRIVER, "nodeName": NODE,
                               "pool": {"name": NODE, "generation": 9, "resourceSliceCount": 1},
                               "devices": [{"name": "gpu-0", "attributes": {}}]}})
    observed["someone-elses"] = foreign
    p = plan(devices(4), observed, last=2)
    assert p.generation == 10  # above the foreign one: the scheduler ignores lower generations
    assert p.delete == [SliceRef("someone-elses", foreign["metadata"]["uid"], foreign["metadata"]["resourceVersion"])]
    assert [s["metadata"]["name"] for s in p.apply] == ["node-a-gpu-gpudra-io-0"]


def test_a_foreign_slice_of_another_pool_is_deleted_without_lifting_our_generation() -> None:
    observed = observed_at(2, 4)
    other = served({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "other-pool"},
                    "spec": {"driver": DRIVER, "nodeName": NODE,
                             "pool": {"name": "other", "generation": 50, "resourceSliceCount": 1}}})
    observed["other-pool"] = other
    p = plan(devices(4), observed, last=2)
    assert p.generation == 3
    assert [r.name for r in p.delete] == ["other-pool"]


def test_three_hundred_devices_split_into_three_slices_of_one_generation() -> None:
    p = plan(devices(300), {}, last=0)
    assert [len(s["spec"]["devices"]) for s in p.apply] == [128, 128, 44]
    assert [s["metadata"]["name"] for s in p.apply] == [f"node-a-gpu-gpudra-io-{i}" for i in range(3)]
    assert all(s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 3} for s in p.apply)
    assert [d["name"] for s in p.apply for d in s["spec"]["devices"]] == [f"gpu-{i}" for i in range(300)]
    # Written and read back, the same 300 devices are a no-op.
    assert plan(devices(300), {s["metadata"]["name"]: served(s) for s in p.apply}, last=1).empty


def test_growing_past_128_devices_adds_a_slice_and_rewrites_the_count_everywhere() -> None:
    observed = observed_at(1, 128)
    p = plan(devices(129), observed, last=1)
    assert p.generation == 2 and not p.delete
    assert [len(s["spec"]["devices"]) for s in p.apply] == [128, 1]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in p.apply} == {2}


def test_no_devices_publishes_one_empty_slice_and_that_is_then_a_no_op() -> None:
    p = plan([], observed_at(1, 2), last=1)
    (only,) = p.apply
    assert "devices" not in only["spec"] and p.generation == 2 and not p.delete
    assert plan([], {only["metadata"]["name"]: served(only)}, last=2).empty
