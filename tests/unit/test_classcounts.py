"""Per-class device counts (status.deviceClasses[]) and the ClassMatchesNoDevice condition: pure."""

from __future__ import annotations

from typing import Any

from gpudra_operator.classcounts import (ClassCount, SliceMatches, allocated_devices, class_selectors, count,
                                         slice_matches)
from gpudra_operator.conditions import class_matches_no_device

DRIVER = "gpu.gpudra.io"


def device_class(name: str, *expressions: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]}}


def device(name: str, memory: str, product: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    return {"name": name, "attributes": {"type": {"string": "gpu"}, "productName": {"string": product}},
            "capacity": {"memory": {"value": memory}}}


def slice_(node: str, *devices: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node}, "devices": list(devices)}}


CLASSES = [
    class_selectors(device_class("all", f'device.driver == "{DRIVER}"')),
    class_selectors(device_class("big", f'device.driver == "{DRIVER}"',
                                 f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0')),
    class_selectors(device_class("typo", f'device.attributes["{DRIVER}"].productNme == "x"')),  # an error: no match
    class_selectors(device_class("broken", "device.driver ==")),  # does not compile: matches nothing
]


def test_a_device_matches_a_class_when_every_selector_is_true_and_none_fails() -> None:
    kept = slice_matches(DRIVER, slice_("n1", device("gpu-0", "80Gi"), device("gpu-1", "40Gi")), CLASSES)
    assert kept == SliceMatches("n1", "n1", {"gpu-0": frozenset({"all", "big"}), "gpu-1": frozenset({"all"})})
    assert CLASSES[3].error is not None and "compilation failed" in CLASSES[3].error


def test_counts_follow_the_claims_allocations_and_nodes_with_free_devices() -> None:
    slices = [slice_matches(DRIVER, slice_("n1", device("gpu-0", "80Gi"), device("gpu-1", "40Gi")), CLASSES),
              slice_matches(DRIVER, slice_("n2", device("gpu-0", "80Gi")), CLASSES)]
    claim = {"status": {"allocation": {"devices": {"results": [
        {"driver": DRIVER, "pool": "n1", "device": "gpu-0"},
        {"driver": DRIVER, "pool": "n2", "device": "gpu-0", "adminAccess": True}]}}}}  # monitoring: holds nothing
    held = allocated_devices(claim)
    assert held == ((DRIVER, "n1", "gpu-0"),)
    counts = count([c.name for c in CLASSES], DRIVER, slices, held)
    assert counts == [ClassCount("all", 3, 1, 2, 2), ClassCount("big", 2, 1, 1, 1),
                      ClassCount("typo", 0, 0, 0, 0), ClassCount("broken", 0, 0, 0, 0)]
    assert counts[1].to_status() == {"name": "big", "devices": 2, "allocated": 1, "free": 1, "nodesWithFree": 1}
    # another driver's device of the same name holds nothing of ours
    assert count(["all"], DRIVER, slices, [("other.example.com", "n1", "gpu-1")])[0].allocated == 0


def test_a_class_that_matches_nothing_is_a_warning_only_once_the_agents_publish() -> None:
    counts = [ClassCount("all", 3, 0, 3, 2), ClassCount("typo", 0, 0, 0, 0)]
    warning = class_matches_no_device(counts, DRIVER, 3, agents_ready=True)
    assert (warning.status, warning.reason) == ("True", "ClassMatchesNoDevice")
    assert warning.message.startswith(f"DeviceClass typo matches none of the 3 devices driver {DRIVER} publishes")
    assert class_matches_no_device(counts, DRIVER, 3, agents_ready=False).status == "False"
    assert class_matches_no_device(counts, DRIVER, 0, agents_ready=True).reason == "NoDevicesYet"
    assert class_matches_no_device(counts[:1], DRIVER, 3, agents_ready=True).reason == "EveryClassMatches"


def test_a_fleet_of_the_same_gpus_costs_one_cel_run_per_class_and_distinct_values() -> None:
    big = class_selectors(device_class("big", f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0',
                                       f'device.attributes["{DRIVER}"].type == "gpu"'))
    assert big.references == (("attributes", DRIVER, "type"), ("capacity", DRIVER, "memory"))
    fleet = [dict(device(f"gpu-{i}", "80Gi"), attributes={"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{i}"}})
             for i in range(64)] + [device("gpu-64", "40Gi")]
    assert [big.matches(DRIVER, d) for d in fleet] == [True] * 64 + [False]
    assert len(big._memo) == 2  # 80Gi GPUs, the 40Gi one: the uuids play no part
    # a selector that reads a map whole, or by a variable, is run on every device
    whole = class_selectors(device_class("whole", f'"type" in device.attributes["{DRIVER}"]'))
    assert whole.references is None and whole.matches(DRIVER, fleet[0])
    # a missing attribute is its own value (an error: no match), not a cache hit of another
    sparse = class_selectors(device_class("sparse", f'device.attributes["{DRIVER}"].productName == "x"'))
    assert not sparse.matches(DRIVER, {"name": "d", "attributes": {"type": {"string": "gpu"}}})
    assert sparse.matches(DRIVER, {"name": "e", "attributes": {"productName": {"string": "x"}}})


def test_a_device_tainted_unhealthy_is_counted_and_never_free() -> None:
    sick = dict(device("gpu-1", "40Gi"), taints=[{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}])
    noted = dict(device("gpu-2", "40Gi"), taints=[{"key": f"{DRIVER}/xid", "value": "13", "effect": "None"}])
    foreign = dict(device("gpu-3", "40Gi"), taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}])
    kept = slice_matches(DRIVER, slice_("n1", device("gpu-0", "80Gi"), sick, noted, foreign), CLASSES[:1])
    assert kept.tainted == frozenset({"gpu-1"}) and kept.unhealthy == 1  # ours, and keeping pods off
    # the foreign taint is not health: counted free here (the scheduler may still refuse it)
    assert count(["all"], DRIVER, [kept], []) == [ClassCount("all", 4, 0, 3, 1)]
