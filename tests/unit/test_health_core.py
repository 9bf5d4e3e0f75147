"""The pure core of device health (gpudra_driver.devicehealth.plan): observations -> taints, recovery,
MIG attribution, the 1.35 fallback, what people are told."""

from __future__ import annotations

import pytest

from test_discovery import H100_GEOMETRY

from gpudra_core.devicemodel import AttrValue, Device, DeviceTaint
from gpudra_core.migpartitions import partition_gpu
from gpudra_driver.devicehealth import xids
from gpudra_driver.devicehealth.scope import instance_slices, memory_slices
from gpudra_driver.publishing.apisupport import probe_slice, taints_dropped
from gpudra_driver.devicehealth.plan import (
    MAX_FAULTS_PER_GPU, NO_INSTANCE, Ecc, Moment, Policy, Probe, Unmonitored, Xid, apply, carry_lost, expire, health_of,
    has_instance, next_expiry, observe, taints, transitions,
)
from gpudra_driver.plugin.model import MigPlacement
from gpudra_core.kubeapi import rfc3339
from gpudra_driver.publishing.slices import build_slices

D = "gpu.example.com"
POLICY = Policy(driver=D, quiet_period=60.0)
GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
T0 = 1_796_000_000.0  # 2026-11-30T...


def at(t: float) -> Moment:
    """Both clocks reading ``t`` (the tests below that step only one say so)."""
    return Moment(monotonic=t, wall=t)


def gpu(name: str, uuid: str) -> Device:
    return Device(name=name, attributes={"type": AttrValue.of_string("gpu"), "uuid": AttrValue.of_string(uuid)})


def mig(name: str, parent: str, gi: int, ci: int) -> Device:
    return Device(name=name, attributes={
        "type": AttrValue.of_string("mig"), "uuid": AttrValue.of_string(f"MIG-{name}"),
        "parentUUID": AttrValue.of_string(parent), "gpuInstanceId": AttrValue.of_int(gi),
        "computeInstanceId": AttrValue.of_int(ci)})


def keys(found: tuple[DeviceTaint, ...]) -> set[tuple[str, str, str]]:
    return {(t.key, t.value, t.effect) for t in found}


def test_a_fatal_xid_is_a_noschedule_taint_from_when_it_came() -> None:
    state = observe({}, [Xid(GPU_A, 48)], POLICY, at(T0))
    (taint,) = taints(state, gpu("gpu-0", GPU_A), POLICY)
    assert taint == DeviceTaint(f"{D}/xid", "48", "NoSchedule", rfc3339(T0))
    assert taints(state, gpu("gpu-1", GPU_B), POLICY) == ()
    assert rfc3339(T0 + 0.9) == rfc3339(T0)  # whole seconds: a republish compares equal


def test_informational_xids_are_taints_without_effect_and_the_list_is_configurable() -> None:
    state = observe({}, [Xid(GPU_A, 13)], POLICY, at(T0))
    assert keys(taints(state, gpu("gpu-0", GPU_A), POLICY)) == {(f"{D}/xid", "13", "None")}
    assert health_of(taints(state, gpu("gpu-0", GPU_A), POLICY), D) == "healthy"
    strict = Policy(driver=D, informational_xids=xids.parse_list(""))
    state = observe({}, [Xid(GPU_A, 13)], strict, at(T0))
    assert keys(taints(state, gpu("gpu-0", GPU_A), strict)) == {(f"{D}/xid", "13", "NoSchedule")}
    assert xids.parse_list("13, 31,43") == {13, 31, 43}
    with pytest.raises(ValueError):
        xids.parse_list("13,x")


def test_noexecute_only_when_asked_ecc_lost_and_recovery_action_taints() -> None:
    policy = Policy(driver=D, effect="NoExecute")
    state = observe({}, [Ecc(GPU_A), Probe(GPU_B, lost=True)], policy, at(T0))
    assert keys(taints(state, gpu("gpu-0", GPU_A), policy)) == {(f"{D}/ecc", "double-bit", "NoExecute")}
    assert keys(taints(state, gpu("gpu-1", GPU_B), policy)) == {(f"{D}/gpu-lost", "", "NoExecute")}
    state = observe(state, [Probe(GPU_B, lost=False, recovery_action=2)], policy, at(T0 + 5))
    assert keys(taints(state, gpu("gpu-1", GPU_B), policy)) == {(f"{D}/recovery-action", "node-reboot", "NoExecute")}


def test_mig_events_are_attributed_by_gpu_and_compute_instance() -> None:
    a, b, c = mig("gpu-0-mig-3g40gb-1-0", GPU_A, 1, 0), mig("gpu-0-mig-3g40gb-2-0", GPU_A, 2, 0), \
        mig("gpu-0-mig-1c3g40gb-2-1", GPU_A, 2, 1)
    state = observe({}, [Xid(GPU_A, 94, gi=2, ci=1)], POLICY, at(T0))
    assert [bool(taints(state, d, POLICY)) for d in (a, b, c)] == [False, False, True]
    state = observe({}, [Xid(GPU_A, 94, gi=2, ci=NO_INSTANCE)], POLICY, at(T0))  # the whole GPU instance
    assert [bool(taints(state, d, POLICY)) for d in (a, b, c)] == [False, True, True]
    state = observe({}, [Xid(GPU_A, 79)], POLICY, at(T0))  # not tied to an instance: every MIG device
    assert [bool(taints(state, d, POLICY)) for d in (a, b, c)] == [True, True, True]
    state = observe({}, [Probe(GPU_A, lost=True)], POLICY, at(T0))
    assert all(keys(taints(state, d, POLICY)) == {(f"{D}/gpu-lost", "", "NoSchedule")} for d in (a, b, c))


def test_an_error_the_hardware_does_not_contain_reaches_every_device_of_the_gpu() -> None:
    """Whatever instance IDs NVML gives, an uncontained XID (95, 79, 48, GSP, unknown ones) is the
    whole GPU's; a contained one (94, an application's 13/31/43/45) or an ECC event NVML places in
    an instance is that instance's."""
    a, b = mig("gpu-0-mig-3g40gb-1-0", GPU_A, 1, 0), mig("gpu-0-mig-3g40gb-2-0", GPU_A, 2, 0)
    for xid in (95, 79, 48, 119, 120, 154, 999):
        state = observe({}, [Xid(GPU_A, xid, gi=2, ci=0)], POLICY, at(T0))
        assert [bool(taints(state, d, POLICY)) for d in (a, b)] == [True, True], xid
    for xid in (94, 13, 31, 43, 45):
        state = observe({}, [Xid(GPU_A, xid, gi=2, ci=0)], POLICY, at(T0))
        assert [bool(taints(state, d, POLICY)) for d in (a, b)] == [False, True], xid
    state = observe({}, [Ecc(GPU_A, gi=2, ci=0)], POLICY, at(T0))
    assert [bool(taints(state, d, POLICY)) for d in (a, b)] == [False, True]
    assert xids.contained(94) and not xids.contained(95)


H100 = Device(name="gpu-0", attributes={
    "type": AttrValue.of_string("gpu"), "uuid": AttrValue.of_string(GPU_A), "index": AttrValue.of_int(0),
    "minor": AttrValue.of_int(0), "productName": AttrValue.of_string("NVIDIA H100 80GB HBM3")})
PLACEMENTS = partition_gpu(H100, H100_GEOMETRY)  # the 25 placements of a dynamic H100
AT0_1G = {"gpu-0-mig-1g10gb-at0", "gpu-0-mig-1g10gbme-at0", "gpu-0-mig-1g20gb-at0", "gpu-0-mig-2g20gb-at0",
          "gpu-0-mig-3g40gb-at0", "gpu-0-mig-4g40gb-at0", "gpu-0-mig-7g80gb-at0"}  # all that use memory slice 0


def tainted(state: dict, policy: Policy = POLICY) -> set[str]:
    return {d.name for d in PLACEMENTS if taints(state, d, policy)}


def created(profile: str, start: int, size: int, gi: int, ci: int = 0, gpu_uuid: str = GPU_A) -> MigPlacement:
    return MigPlacement(gpu_uuid, profile, start, size, 0, gi=gi, ci=ci)


def test_an_xid_on_a_dynamic_instance_taints_the_placements_on_its_memory_and_no_other() -> None:
    assert len(PLACEMENTS) == 25 and {n for n in AT0_1G} <= {d.name for d in PLACEMENTS}
    instances = instance_slices([created("1g.10gb", 0, 1, gi=9), created("2g.20gb", 4, 2, gi=5),
                                 MigPlacement(GPU_A, "1g.10gb", 6, 1, 0)])  # the last: not created yet
    assert instances == {(GPU_A, 9): (0, (0,)), (GPU_A, 5): (0, (4, 5))}
    state = observe({}, [Xid(GPU_A, 94, gi=9, ci=0)], POLICY, at(T0), instances)
    assert tainted(state) == AT0_1G
    (taint,) = taints(state, PLACEMENTS[0], POLICY)
    assert (taint.key, taint.value, taint.effect) == (f"{D}/xid", "94", "NoSchedule")
    # the whole GPU instance (no compute instance named) is the same placement
    assert tainted(observe({}, [Xid(GPU_A, 94, gi=9, ci=NO_INSTANCE)], POLICY, at(T0), instances)) == AT0_1G
    # a 2g at slices 4-5: what overlaps 4 or 5, the 7g included
    assert tainted(observe({}, [Ecc(GPU_A, gi=5, ci=0)], POLICY, at(T0), instances)) == {
        "gpu-0-mig-1g10gb-at4", "gpu-0-mig-1g10gb-at5", "gpu-0-mig-1g10gbme-at4", "gpu-0-mig-1g10gbme-at5",
        "gpu-0-mig-1g20gb-at4", "gpu-0-mig-2g20gb-at4", "gpu-0-mig-3g40gb-at4", "gpu-0-mig-7g80gb-at0"}
    # an application's XID stays in the instance too, as a taint without effect
    state = observe({}, [Xid(GPU_A, 43, gi=9, ci=0)], POLICY, at(T0), instances)
    assert tainted(state) == AT0_1G and health_of(taints(state, PLACEMENTS[0], POLICY), D) == "healthy"
    # another GPU's instance with the same IDs is not this one's
    assert tainted(observe({}, [Xid(GPU_B, 94, gi=9, ci=0)], POLICY, at(T0), instances)) == set()
    assert memory_slices(H100) is None and memory_slices(mig("m", GPU_A, 1, 0)) is None


def test_what_cannot_be_placed_or_is_not_contained_taints_every_placement() -> None:
    instances = instance_slices([created("1g.10gb", 0, 1, gi=9)])
    every = {d.name for d in PLACEMENTS}
    for seen in (Xid(GPU_A, 79), Xid(GPU_A, 95, gi=9, ci=0), Xid(GPU_A, 48, gi=9, ci=0),
                 Xid(GPU_A, 94, gi=3, ci=0),  # an instance no checkpoint entry names
                 Xid(GPU_A, 94, gi=9, ci=2),  # a compute instance that is not the entry's
                 Ecc(GPU_A)):
        assert tainted(observe({}, [seen], POLICY, at(T0), instances)) == every, seen
    assert tainted(observe({}, [Probe(GPU_A, lost=True)], POLICY, at(T0), instances)) == every
    assert tainted(observe({}, [Probe(GPU_A, lost=False, recovery_action=1)], POLICY, at(T0), instances)) == every
    assert not has_instance(Xid(GPU_A, 79)) and has_instance(Xid(GPU_A, 94, gi=9, ci=0))
    assert not has_instance(Probe(GPU_A, lost=True))


def test_a_placement_taint_outlives_the_claim_and_follows_the_ids_nvml_gives_the_next() -> None:
    """The IDs are resolved when the event is folded in: the fault keeps the memory slices, so the
    taint stays on the same memory for the quiet period once the claim is unprepared, and the same
    IDs on the next claim's instance elsewhere taint that placement's memory, not the old one's."""
    state = observe({}, [Xid(GPU_A, 94, gi=9, ci=0)], POLICY, at(T0), instance_slices([created("1g.10gb", 0, 1, 9)]))
    state = observe(state, [], POLICY, at(T0 + 30), {})  # unprepared: no entry names the instance
    assert tainted(state) == AT0_1G
    state = observe(state, [Xid(GPU_A, 94, gi=9, ci=0)], POLICY, at(T0 + 40),
                    instance_slices([created("1g.10gb", 6, 1, 9)]))  # NVML gave ID 9 to a 1g at slice 6
    at6 = {"gpu-0-mig-1g10gb-at6", "gpu-0-mig-1g10gbme-at6", "gpu-0-mig-1g20gb-at6", "gpu-0-mig-3g40gb-at4",
           "gpu-0-mig-7g80gb-at0"}
    assert tainted(state) == AT0_1G | at6
    assert tainted(observe(state, [], POLICY, at(T0 + 61))) == at6  # slice 0's quiet period is over
    assert observe(state, [], POLICY, at(T0 + 101)) == {}


def test_recovery_after_the_quiet_period_only_once_the_gpu_is_back_and_needs_no_action() -> None:
    state = observe({}, [Xid(GPU_A, 48), Probe(GPU_A, lost=False, recovery_action=1)], POLICY, at(T0))
    assert next_expiry(state, POLICY) == T0 + 60
    state = observe(state, [], POLICY, at(T0 + 61))  # quiet, but the GPU still needs a reset
    assert keys(taints(state, gpu("gpu-0", GPU_A), POLICY)) == {
        (f"{D}/xid", "48", "NoSchedule"), (f"{D}/recovery-action", "gpu-reset", "NoSchedule")}
    state = observe(state, [Probe(GPU_A, lost=False, recovery_action=0)], POLICY, at(T0 + 62))  # reset done
    assert taints(state, gpu("gpu-0", GPU_A), POLICY) == () and state == {}

    state = observe({}, [Xid(GPU_A, 48)], POLICY, at(T0))
    state = observe(state, [Xid(GPU_A, 48)], POLICY, at(T0 + 50))  # a new one restarts the quiet period...
    assert taints(observe(state, [], POLICY, at(T0 + 61)), gpu("gpu-0", GPU_A), POLICY)
    (taint,) = taints(state, gpu("gpu-0", GPU_A), POLICY)
    assert taint.time_added == rfc3339(T0)  # ...but the taint dates from the first
    assert expire(state, POLICY, at(T0 + 110)) == {}

    state = observe({}, [Probe(GPU_A, lost=True), Xid(GPU_A, 79)], POLICY, at(T0))
    assert taints(observe(state, [], POLICY, at(T0 + 600)), gpu("gpu-0", GPU_A), POLICY)  # lost: kept
    assert observe(state, [Probe(GPU_A, lost=False)], POLICY, at(T0 + 600)) == {}  # back: all gone


@pytest.mark.parametrize("wall_step", [+3600.0, -3600.0])
def test_a_step_of_the_wall_clock_neither_clears_a_fatal_xid_early_nor_holds_it_late(wall_step: float) -> None:
    """The quiet period counts on the monotonic clock: NTP stepping the clock (or a VM restored from
    a snapshot) must not clear a fatal XID's taint while the GPU is still in its quiet period."""
    mono = 5_000.0  # the monotonic clock counts from boot: nothing to do with the wall clock
    state = observe({}, [Xid(GPU_A, 48)], POLICY, Moment(mono, T0))
    (taint,) = taints(state, gpu("gpu-0", GPU_A), POLICY)
    assert taint.time_added == rfc3339(T0)  # the date people read is the wall clock's

    stepped = Moment(mono + 10, T0 + 10 + wall_step)  # 10 s later, the wall clock stepped
    assert keys(taints(observe(state, [], POLICY, stepped), gpu("gpu-0", GPU_A), POLICY)) == {
        (f"{D}/xid", "48", "NoSchedule")}
    assert next_expiry(state, POLICY) == mono + 60
    quiet = Moment(mono + 61, T0 + 61 + wall_step)  # the quiet period is over, whatever the wall says
    assert observe(state, [], POLICY, quiet) == {}


def test_a_storm_changes_values_never_the_size() -> None:
    state = observe({}, [Xid(GPU_A, n) for n in range(1, 10_000)], POLICY, at(T0))
    assert len(state[GPU_A].faults) <= 2  # fatal and informational, one each
    state = observe({}, [Xid(GPU_A, 94, gi=g, ci=c) for g in range(100) for c in range(10)], POLICY, at(T0))
    assert len(state[GPU_A].faults) == MAX_FAULTS_PER_GPU
    # dynamic instances: one fault per memory-slice set, bounded the same
    instances = instance_slices(MigPlacement(GPU_A, "1g.10gb", g % 8, 1, 0, gi=g, ci=0) for g in range(100))
    state = observe({}, [Xid(GPU_A, 94, gi=g, ci=0) for g in range(100)], POLICY, at(T0), instances)
    assert len(state[GPU_A].faults) == 8
    state = observe(state, [Xid(GPU_A, x, gi=g, ci=0) for g in range(100) for x in (13, 31, 43, 45)], POLICY,
                    at(T0), instances)
    assert len(state[GPU_A].faults) == 16  # and the informational ones, per memory slice too


def test_unmonitored_is_a_none_taint() -> None:
    state = observe({}, [Unmonitored(GPU_A, "Not Supported")], POLICY, at(T0))
    found = taints(state, gpu("gpu-0", GPU_A), POLICY)
    assert keys(found) == {(f"{D}/unmonitored", "", "None")}
    assert health_of(found, D) == "unmonitored"
    assert observe(state, [], POLICY, at(T0 + 10_000)) == state  # not an event: it stays


def test_omit_mode_leaves_unhealthy_devices_out_and_publishes_no_taints() -> None:
    state = observe({}, [Xid(GPU_A, 48), Xid(GPU_B, 13)], POLICY, at(T0))
    devices = [gpu("gpu-0", GPU_A), gpu("gpu-1", GPU_B)]
    assert [(d.name, len(d.taints)) for d in apply(devices, state, POLICY, "taint")] == [("gpu-0", 1), ("gpu-1", 1)]
    assert [(d.name, d.taints) for d in apply(devices, state, POLICY, "omit")] == [("gpu-1", ())]


def test_a_lost_gpu_that_discovery_no_longer_sees_stays_published_tainted() -> None:
    previous = [gpu("gpu-0", GPU_A), gpu("gpu-1", GPU_B)]
    state = observe({}, [Probe(GPU_A, lost=True)], POLICY, at(T0))
    assert [d.name for d in carry_lost(previous[1:], previous, state)] == ["gpu-1", "gpu-0"]
    assert [d.name for d in carry_lost(previous[1:], previous, {})] == ["gpu-1"]  # removed for real


def test_transitions_name_the_xid_and_its_meaning() -> None:
    device = gpu("gpu-0", GPU_A)
    sick = taints(observe({}, [Xid(GPU_A, 48)], POLICY, at(T0)), device, POLICY)
    (turned,) = transitions({"gpu-0": ()}, {"gpu-0": sick}, {"gpu-0": GPU_A}, D)
    assert turned.unhealthy and turned.message == (
        f"gpu-0 ({GPU_A}) is unhealthy: {D}/xid=48:NoSchedule (XID 48: double-bit ECC error)")
    (back,) = transitions({"gpu-0": sick}, {"gpu-0": ()}, {"gpu-0": GPU_A}, D)
    assert not back.unhealthy and back.message.startswith(f"gpu-0 ({GPU_A}) recovered")
    informational = taints(observe({}, [Xid(GPU_A, 13)], POLICY, at(T0)), device, POLICY)
    assert transitions({"gpu-0": ()}, {"gpu-0": informational}, {}, D) == []


def test_slices_with_taints_hold_at_most_64_devices_and_serialise_them() -> None:
    devices = [gpu(f"gpu-{i}", f"GPU-{i:04d}") for i in range(100)]
    assert [len(s["spec"]["devices"]) for s in build_slices(D, "n1", None, 1, devices)] == [100]
    state = observe({}, [Xid("GPU-0007", 48)], POLICY, at(T0))
    slices = build_slices(D, "n1", None, 1, apply(devices, state, POLICY, "taint"))
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 36]
    tainted = next(d for d in slices[0]["spec"]["devices"] if d["name"] == "gpu-7")
    assert tainted["taints"] == [{"key": f"{D}/xid", "value": "48", "effect": "NoSchedule", "timeAdded": rfc3339(T0)}]


def test_dropped_taints_are_detected_from_what_the_server_stored() -> None:
    written = probe_slice(D, "n1")
    assert taints_dropped(written, {"spec": {"devices": [{"name": "probe"}]}})
    assert not taints_dropped(written, written)
    assert not taints_dropped({"spec": {"devices": [{"name": "x"}]}}, {"spec": {"devices": [{"name": "x"}]}})
