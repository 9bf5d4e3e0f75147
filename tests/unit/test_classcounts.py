"""Per-class device counts (status.deviceClasses[]) and the ClassMatchesNoDevice condition. The
selectors run in gpudra-allocator (Kubernetes' own DRA CEL, the real helper binary: `make
allocator` builds it; without it these tests fail with the helper's message on how to get it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest_asyncio

from gpudra_core.kubeapi import Obj
from gpudra_operator.allocatorhelper import AllocatorHelper, Compiled, Outcome
from gpudra_operator.classcounts import (ClassCount, ClassSelectors, SliceMatches, allocated_devices,
                                         class_selectors, count, known_matches, match_slices)
from gpudra_operator.conditions import class_matches_no_device

DRIVER = "gpu.gpudra.io"


@pytest_asyncio.fixture
async def helper() -> AsyncIterator[AllocatorHelper]:
    async with AllocatorHelper() as helper:  # the oldest supported release
        yield helper


class Counted:
    """The helper's match, and the requests made of it."""

    def __init__(self, helper: AllocatorHelper) -> None:
        self.helper = helper
        self.requests: list[tuple[int, int]] = []  # (expressions, devices)

    async def __call__(self, expressions: Sequence[str],
                       devices: Sequence[tuple[str, Obj]]) -> tuple[list[Compiled], list[list[Outcome]]]:
        self.requests.append((len(expressions), len(devices)))
        return await self.helper.match(expressions, devices)


def device_class(name: str, *expressions: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]}}


def device(name: str, memory: str, product: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    return {"name": name, "attributes": {"type": {"string": "gpu"}, "productName": {"string": product}},
            "capacity": {"memory": {"value": memory}}}


def slice_(node: str, *devices: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node}, "devices": list(devices)}}


def classes() -> list[ClassSelectors]:
    return [
        class_selectors(device_class("all", f'device.driver == "{DRIVER}"')),
        class_selectors(device_class("big", f'device.driver == "{DRIVER}"',
                                     f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0')),
        class_selectors(device_class("typo", f'device.attributes["{DRIVER}"].productNme == "x"')),  # an error: no match
        class_selectors(device_class("broken", "device.driver ==")),  # does not compile: matches nothing
    ]


async def test_a_device_matches_a_class_when_every_selector_is_true_and_none_fails(helper: AllocatorHelper) -> None:
    kinds = classes()
    (kept,) = await match_slices(helper.match, DRIVER, [slice_("n1", device("gpu-0", "80Gi"), device("gpu-1", "40Gi"))],
                                 kinds)
    assert kept == SliceMatches("n1", "n1", {"gpu-0": frozenset({"all", "big"}), "gpu-1": frozenset({"all"})})
    broken = kinds[3]
    assert broken.error is not None and "compilation failed" in broken.error  # the release's own words
    assert all(c.error is None for c in kinds[:3])
    # the classes are equal to those a later reconcile renders, whatever was learnt of them
    assert kinds == classes() and kinds[0] != class_selectors(device_class("all", f'device.driver == "{DRIVER}"'), 36)


async def test_counts_follow_the_claims_allocations_and_nodes_with_free_devices(helper: AllocatorHelper) -> None:
    kinds = classes()
    slices = await match_slices(helper.match, DRIVER, [slice_("n1", device("gpu-0", "80Gi"), device("gpu-1", "40Gi")),
                                                       slice_("n2", device("gpu-0", "80Gi"))], kinds)
    claim = {"status": {"allocation": {"devices": {"results": [
        {"driver": DRIVER, "pool": "n1", "device": "gpu-0"},
        {"driver": DRIVER, "pool": "n2", "device": "gpu-0", "adminAccess": True}]}}}}  # monitoring: holds nothing
    held = allocated_devices(claim)
    assert held == ((DRIVER, "n1", "gpu-0"),)
    counts = count([c.name for c in kinds], DRIVER, slices, held)
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


async def test_a_fleet_of_the_same_gpus_costs_one_request_of_one_device_per_distinct_values(
        helper: AllocatorHelper) -> None:
    big = class_selectors(device_class("big", f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0',
                                       f'device.attributes["{DRIVER}"].type == "gpu"'))
    gpu = class_selectors(device_class("gpu", f'device.attributes["{DRIVER}"].type == "gpu"'))
    assert big.references == (("attributes", DRIVER, "type"), ("capacity", DRIVER, "memory"))
    fleet = [slice_(f"n{n}", *(dict(device(f"gpu-{i}", "80Gi"), attributes={
        "type": {"string": "gpu"}, "uuid": {"string": f"GPU-{n}-{i}"}}) for i in range(8))) for n in range(64)]
    fleet.append(slice_("odd", device("gpu-0", "40Gi")))
    match = Counted(helper)
    kept = await match_slices(match, DRIVER, fleet, [big, gpu])
    assert [m.devices["gpu-0"] for m in kept] == [frozenset({"big", "gpu"})] * 64 + [frozenset({"gpu"})]
    # one request: both classes' selectors (one shared) on one 80Gi GPU and the 40Gi one; the uuids play no part
    assert match.requests == [(2, 2)]
    assert len(big._memo) == 2
    # the memos answer the next slices without a request, at once (the watch's own path)
    again = known_matches(DRIVER, slice_("n99", device("gpu-0", "80Gi")), [big, gpu])
    assert again is not None and again.devices == {"gpu-0": frozenset({"big", "gpu"})}
    assert known_matches(DRIVER, slice_("n98", device("gpu-0", "20Gi")), [big, gpu]) is None  # new values: ask
    # a selector that reads a map whole, or by a variable, is run on every device
    whole = class_selectors(device_class("whole", f'"type" in device.attributes["{DRIVER}"]'))
    assert whole.references is None
    await match_slices(match, DRIVER, fleet[:2], [whole])
    assert match.requests[1] == (1, 16)
    # a missing attribute is its own value (an error: no match), not a cache hit of another
    sparse = class_selectors(device_class("sparse", f'device.attributes["{DRIVER}"].productName == "x"'))
    kept = await match_slices(match, DRIVER, [slice_("s", {"name": "d", "attributes": {"type": {"string": "gpu"}}},
                                                     {"name": "e", "attributes": {"productName": {"string": "x"}}})],
                              [sparse])
    assert kept[0].devices == {"d": frozenset(), "e": frozenset({"sparse"})}


async def test_a_class_that_does_not_compile_is_asked_once(helper: AllocatorHelper) -> None:
    broken, fine = class_selectors(device_class("broken", "device.driver ==")), \
        class_selectors(device_class("fine", f'device.capacity["{DRIVER}"].memory.isGreaterThan(quantity("1Gi"))'))
    match = Counted(helper)
    await match_slices(match, DRIVER, [slice_("n1", device("gpu-0", "80Gi"))], [broken, fine])
    kept = await match_slices(match, DRIVER, [slice_("n2", device("gpu-0", "20Gi"))], [broken, fine])
    assert kept[0].devices == {"gpu-0": frozenset({"fine"})}
    assert match.requests == [(2, 1), (1, 1)]  # other values asked, without the broken class's selector


async def test_a_device_tainted_unhealthy_is_counted_and_never_free(helper: AllocatorHelper) -> None:
    sick = dict(device("gpu-1", "40Gi"), taints=[{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}])
    noted = dict(device("gpu-2", "40Gi"), taints=[{"key": f"{DRIVER}/xid", "value": "13", "effect": "None"}])
    foreign = dict(device("gpu-3", "40Gi"), taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}])
    (kept,) = await match_slices(helper.match, DRIVER, [slice_("n1", device("gpu-0", "80Gi"), sick, noted, foreign)],
                                 classes()[:1])
    assert kept.tainted == frozenset({"gpu-1"}) and kept.unhealthy == 1  # ours, and keeping pods off
    # the foreign taint is not health: counted free here (the scheduler may still refuse it)
    assert count(["all"], DRIVER, [kept], []) == [ClassCount("all", 4, 0, 3, 1)]
