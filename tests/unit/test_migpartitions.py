"""Dynamic MIG publishing (pure): counters that model a GPU's MIG resources, so that the scheduler,
which only adds up counters, allocates exactly the combinations of placements the hardware can
hold; and the ResourceSlices that carry them within the API's limits."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from test_discovery import H100_GEOMETRY as H100  # as NVML reports an H100 80GB HBM3

from gpudra_core import limits
from gpudra_core.devicemodel import AttrValue, CounterConsumption, CounterSet, Device
from gpudra_core.migpartitions import partition_gpu, placement_of
from gpudra_driver.plugin.devicenodes import PLACEMENT, node_devices
from gpudra_driver.publishing.slices import build_slices

DRIVER = "gpu.gpudra.io"


def gpu(index: int = 0) -> Device:
    return Device(name=f"gpu-{index}", attributes={
        "type": AttrValue.of_string("gpu"), "uuid": AttrValue.of_string(f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"),
        "productName": AttrValue.of_string("NVIDIA H100 80GB HBM3"), "index": AttrValue.of_int(index),
        "minor": AttrValue.of_int(index), "numaNode": AttrValue.of_int(0),
        "cudaComputeCapability": AttrValue.of_version("9.0.0")}, capacity={"memory": 81559 * 2**20})


def fits(devices: list[Device]) -> bool:
    """What the scheduler decides: whether the devices' consumption, added up, fits the counters."""
    sets = {d.provides_counters.name: d.provides_counters for d in partition_gpu(gpu(), H100) if d.provides_counters}
    assert len(sets) == 1
    taken: Counter[tuple[str, str]] = Counter()
    for device in devices:
        for consumption in device.consumes_counters:
            taken.update({(consumption.counter_set, k): v for k, v in consumption.counters.items()})
    return all(amount <= sets[s].counters[k] for (s, k), amount in taken.items())


def placements(*wanted: str) -> list[Device]:
    """Devices of gpu-0 by ``profile@start``."""
    by_key = {f"{p[0]}@{p[1]}": d for d in partition_gpu(gpu(), H100) if (p := placement_of(d))}
    return [by_key[w] for w in wanted]


def test_a_gpu_becomes_every_placement_over_its_counters() -> None:
    parts = partition_gpu(gpu(), H100)
    assert parts[0].provides_counters == CounterSet("gpu-0-counters", {
        "compute-slices": 7, **{f"memory-slice-{k}": 1 for k in range(8)},
        "copy-engines": 8, "decoders": 7, "jpeg-engines": 7, "ofa-engines": 1})  # no NVENC on H100: no counter
    assert all(p.provides_counters is None for p in parts[1:])  # the set is published once
    assert all(p.type == "mig" for p in parts)  # no whole GPU: its MIG mode is enabled (module docstring)
    assert len(parts) == 7 + 7 + 4 + 3 + 2 + 1 + 1
    three = next(d for d in parts if d.name == "gpu-0-mig-3g40gb-at4")
    assert three.type == "mig" and three.attr("profile") == "3g.40gb" and three.attr("parentUUID") == gpu().attr("uuid")
    assert three.attr("productName") == "NVIDIA H100 80GB HBM3" and three.attr("numaNode") == 0
    assert three.attr("uuid") is None and three.attr("gpuInstanceId") is None  # no instance until prepare
    assert three.capacity == {"memory": 40448 * 2**20, "multiprocessors": 60, "copyEngines": 3, "decoders": 3,
                              "encoders": 0, "jpegEngines": 3, "ofaEngines": 0, "computeSlices": 3}
    assert three.consumes_counters == (CounterConsumption("gpu-0-counters", {
        "compute-slices": 3, "memory-slice-4": 1, "memory-slice-5": 1, "memory-slice-6": 1, "memory-slice-7": 1,
        "copy-engines": 3, "decoders": 3, "jpeg-engines": 3}),)
    assert placement_of(three) == ("3g.40gb", 4) and placement_of(gpu()) is None


@pytest.mark.parametrize("layout", [
    ["7g.80gb@0"],
    ["4g.40gb@0", "3g.40gb@4"],
    ["3g.40gb@0", "3g.40gb@4"],
    ["2g.20gb@0", "2g.20gb@2", "3g.40gb@4"],
    ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"],
    ["1g.20gb@0", "1g.20gb@2", "1g.20gb@4", "1g.20gb@6"],
    [f"1g.10gb@{k}" for k in range(7)],
    ["1g.10gb+me@0", *(f"1g.10gb@{k}" for k in range(1, 7))],
])
def test_layouts_the_hardware_holds_fit(layout: list[str]) -> None:
    assert fits(placements(*layout))


@pytest.mark.parametrize("layout, why", [
    (["4g.40gb@0", "3g.40gb@0"], "overlapping memory"),
    (["3g.40gb@0", "2g.20gb@2"], "overlapping memory"),
    (["1g.10gb+me@0", "1g.10gb+me@3"], "one OFA: one media-extension instance"),
    (["1g.10gb+me@0", "7g.80gb@0"], "overlap, and one OFA"),
    (["3g.40gb@0", "3g.40gb@4", "1g.10gb@6"], "no memory slice left"),
])
def test_layouts_the_hardware_refuses_do_not_fit(layout: list[str], why: str) -> None:
    assert not fits(placements(*layout)), why


def test_no_two_placements_the_counters_admit_share_a_memory_slice_or_exceed_an_instance_count() -> None:
    parts = partition_gpu(gpu(), H100)
    instances = {"1g.10gb": 7, "1g.10gb+me": 1, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}
    for a, b in itertools.combinations(parts, 2):
        (pa, sa), (pb, sb) = placement_of(a), placement_of(b)  # type: ignore[misc]
        size = {p.name: p.placement_size for p in H100.profiles}
        overlap = set(range(sa, sa + size[pa])) & set(range(sb, sb + size[pb]))
        assert not (overlap and fits([a, b])), (a.name, b.name)
    for name, most in instances.items():
        same = [d for d in parts if placement_of(d)[0] == name]  # type: ignore[index]
        assert len(same) >= most
        assert not any(fits(list(c)) for c in itertools.combinations(same, most + 1)) if len(same) > most else True


def test_slices_split_counters_from_devices_within_the_api_limits() -> None:
    plain = Device(name="gpu-2", attributes={"type": AttrValue.of_string("gpu")}, capacity={"memory": 1})
    devices = partition_gpu(gpu(0), H100) + partition_gpu(gpu(1), H100) + [plain]
    slices = build_slices(DRIVER, "node-a", None, 3, devices)
    specs = [s["spec"] for s in slices]
    assert [s["metadata"]["name"] for s in slices] == [f"node-a-gpu-gpudra-io-{i}" for i in range(4)]
    assert {s["pool"]["resourceSliceCount"] for s in specs} == {4} and {s["pool"]["generation"] for s in specs} == {3}
    assert [d["name"] for d in specs[0]["devices"]] == ["gpu-2"] and "sharedCounters" not in specs[0]
    assert "devices" not in specs[1]
    assert [c["name"] for c in specs[1]["sharedCounters"]] == ["gpu-0-counters", "gpu-1-counters"]
    assert specs[1]["sharedCounters"][0]["counters"]["memory-slice-7"] == {"value": "1"}
    assert specs[1]["sharedCounters"][0]["counters"]["compute-slices"] == {"value": "7"}
    for index, spec in ((0, specs[2]), (1, specs[3])):
        assert "sharedCounters" not in spec and len(spec["devices"]) == 25 <= limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
        assert {c["counterSet"] for d in spec["devices"] for c in d["consumesCounters"]} == {f"gpu-{index}-counters"}
    entry = next(d for d in specs[2]["devices"] if d["name"] == "gpu-0-mig-1g10gb-at6")
    assert entry["consumesCounters"] == [{"counterSet": "gpu-0-counters", "counters": {
        "compute-slices": {"value": "1"}, "copy-engines": {"value": "1"}, "decoders": {"value": "1"},
        "jpeg-engines": {"value": "1"}, "memory-slice-6": {"value": "1"}}}]
    assert entry["capacity"]["computeSlices"] == {"value": "1"} and "uuid" not in entry["attributes"]
    # unchanged devices give the same slices, so a publisher writes nothing
    assert build_slices(DRIVER, "node-a", None, 3, list(reversed(devices))) == slices


def test_more_than_eight_gpus_take_a_second_counter_slice() -> None:
    devices = [d for i in range(9) for d in partition_gpu(gpu(i), H100)]
    specs = [s["spec"] for s in build_slices(DRIVER, "node-a", None, 1, devices)]
    assert [len(s["sharedCounters"]) for s in specs if "sharedCounters" in s] == [8, 1]
    assert len(specs) == 2 + 9 and all(len(s.get("devices", [])) <= 64 for s in specs)


def test_a_consumption_the_pool_cannot_back_is_refused_before_publishing() -> None:
    first, part = partition_gpu(gpu(), H100)[:2]
    with pytest.raises(limits.LimitError, match="counter set gpu-0-counters, which pool node-a lacks"):
        build_slices(DRIVER, "node-a", None, 1, [part])
    odd = Device(name="odd", attributes={"type": AttrValue.of_string("gpu")},
                 consumes_counters=(CounterConsumption("gpu-0-counters", {"nvlinks": 1}),))
    with pytest.raises(limits.LimitError, match=r"consumes counters \['nvlinks'\]"):
        build_slices(DRIVER, "node-a", None, 1, [first, odd])


def test_an_allocated_placement_is_planned_with_its_placement() -> None:
    from gpudra_driver.plugin.allocation import read_claim
    from gpudra_driver.plugin.checkpoint import Checkpoint
    from gpudra_driver.plugin.model import ClaimError, ClaimRef, MigPlacement
    from gpudra_driver.plugin.plan import needs_prepare_started, plan_prepare

    devices = node_devices(partition_gpu(gpu(), H100))
    assert devices["gpu-0-mig-2g20gb-at2"].kind == PLACEMENT and "gpu-0" not in devices
    uid = "0c1d2e3f-0000-4000-8000-000000000001"
    ref = ClaimRef("ns", "c", uid)

    def allocated(device: str) -> dict[str, object]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "c", "namespace": "ns", "uid": uid}, "spec": {},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "mig", "driver": DRIVER, "pool": "node-a", "device": device}]}}}}

    plan = plan_prepare(ref, read_claim(ref, allocated("gpu-0-mig-2g20gb-at2"), driver=DRIVER), devices,
                        Checkpoint("boot"), node="node-a", driver=DRIVER)
    (device,) = plan.claim.devices
    assert device.mig == MigPlacement(str(gpu().attr("uuid")), "2g.20gb", 2, 2, 0) and device.uuid == ""
    assert needs_prepare_started(Checkpoint("boot"), [plan.claim])  # recorded before NVML makes it
    with pytest.raises(ClaimError, match="is not a device of node node-a"):  # a stale allocation of the whole GPU
        plan_prepare(ref, read_claim(ref, allocated("gpu-0"), driver=DRIVER), devices, Checkpoint("boot"),
                     node="node-a", driver=DRIVER)


def test_the_whole_gpu_takes_every_counter_where_mig_mode_switches_without_a_reset() -> None:
    from gpudra_core.consumable import ConsumableCapacity, share_device
    from gpudra_core.migpartitions import (geometry_from_json, geometry_to_json, is_dynamic_whole_gpu,
                                           toggles_mig_mode_live)

    parts = partition_gpu(gpu(), H100, whole=True)
    whole, placed = parts[0], parts[1:]
    assert placed == [dataclasses.replace(p, provides_counters=None) for p in partition_gpu(gpu(), H100)]
    assert whole.name == "gpu-0" and whole.attributes == gpu().attributes and whole.capacity == gpu().capacity
    assert whole.provides_counters is not None and is_dynamic_whole_gpu(whole) and placement_of(whole) is None
    assert whole.consumes_counters == (CounterConsumption("gpu-0-counters", dict(whole.provides_counters.counters)),)
    # the scheduler gives it alone: with no placement at all, and no placement after it
    assert fits([whole]) and not any(fits([whole, p]) for p in placed)
    assert not any(is_dynamic_whole_gpu(p) for p in placed) and not is_dynamic_whole_gpu(gpu())
    # NVML's architectures: Ampere (7) switches MIG mode at a reset only; Hopper (9), Blackwell (10) at once
    assert [toggles_mig_mode_live(a) for a in (None, 7, 8, 9, 10)] == [False, False, False, True, True]
    # 26 devices: one slice, within the 64 a slice with counters may hold
    specs = [s["spec"] for s in build_slices(DRIVER, "node-a", None, 1, parts)]
    assert len(specs[1]["devices"]) == 26 <= limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    entry = specs[1]["devices"][0]
    assert entry["name"] == "gpu-0" and entry["attributes"]["uuid"] == {"string": str(gpu().attr("uuid"))}
    assert entry["consumesCounters"][0]["counters"]["memory-slice-0"] == {"value": "1"}
    assert entry["consumesCounters"][0]["counters"]["compute-slices"] == {"value": "7"}
    # never shared by consumable capacity: the whole is one claim's at a time
    shared, why = share_device(whole, ConsumableCapacity(memory_step=1024**3))
    assert shared == whole and why is not None and "dynamic MIG GPU" in why
    # the geometry a whole-GPU claim's record keeps gives the same devices back
    assert geometry_from_json(geometry_to_json(H100)) == H100
    with pytest.raises(ValueError):
        geometry_from_json([{"name": "1g.10gb"}])


def test_the_whole_gpu_is_planned_with_its_mig_mode_off_and_refused_shared_or_monitored() -> None:
    from gpudra_driver.plugin.allocation import read_claim
    from gpudra_driver.plugin.checkpoint import Checkpoint, Entry
    from gpudra_driver.plugin.devicenodes import DYNAMIC_WHOLE_GPU
    from gpudra_driver.plugin.model import ClaimError, ClaimRef, MigModeOff, PreparedDevice
    from gpudra_driver.plugin.plan import needs_prepare_started, plan_prepare

    devices = node_devices(partition_gpu(gpu(), H100, whole=True))
    assert devices["gpu-0"].kind == DYNAMIC_WHOLE_GPU and devices["gpu-0"].device_nodes == ("/dev/nvidia0",)
    uid = "0c1d2e3f-0000-4000-8000-000000000002"
    ref = ClaimRef("ns", "c", uid)

    def allocated(admin: bool = False, config: list[object] | None = None) -> dict[str, object]:
        result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "c", "namespace": "ns", "uid": uid}, "spec": {},
                "status": {"allocation": {"devices": {"results": [{**result, "adminAccess": True} if admin else result],
                                                      "config": config or []}}}}

    plan = plan_prepare(ref, read_claim(ref, allocated(), driver=DRIVER), devices, Checkpoint("boot"),
                        node="node-a", driver=DRIVER)
    (device,) = plan.claim.devices
    assert device.mig_mode_off == MigModeOff() and device.mig is None
    assert device.uuid == gpu().attr("uuid") and device.device_nodes == ("/dev/nvidia0",)
    assert needs_prepare_started(Checkpoint("boot"), [plan.claim])  # recorded before MIG mode goes off
    # the record round-trips, geometry included, and needs checkpoint version 4
    recorded = PreparedDevice.from_json({**device.to_json(), "migModeOff": {"geometry": [{"x": 1}]}})
    assert recorded.mig_mode_off == MigModeOff(({"x": 1},)) and PreparedDevice.from_json(device.to_json()) == device
    assert Entry("PrepareStarted", plan.claim).version == 4
    with pytest.raises(ClaimError, match="MIG GPU as a whole, whose MIG mode is off only while a claim holds it"):
        plan_prepare(ref, read_claim(ref, allocated(admin=True), driver=DRIVER), devices, Checkpoint("boot"),
                     node="node-a", driver=DRIVER)
    sliced = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}}}]
    with pytest.raises(ClaimError, match=r"dynamic MIG GPU as a whole: sharing it \(TimeSlicing\) is not supported"):
        plan_prepare(ref, read_claim(ref, allocated(config=sliced), driver=DRIVER), devices, Checkpoint("boot"),
                     node="node-a", driver=DRIVER)
