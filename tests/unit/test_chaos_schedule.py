"""The chaos run's pure parts: its fault schedule (seeded, every kind guaranteed, spaced) and the
invariants it checks over observed state (gpudra_dev.chaos)."""

from __future__ import annotations

import pytest

from gpudra_dev.chaos import invariants as inv
from gpudra_dev.chaos.schedule import FAULT_KINDS, counts_by_kind, make_schedule

NODES = ("n0", "n1", "n2")
GI = 1 << 30


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    one = make_schedule(7, 600, nodes=NODES, replicas=2, mean_gap=20)
    assert one == make_schedule(7, 600, nodes=NODES, replicas=2, mean_gap=20)
    assert one != make_schedule(8, 600, nodes=NODES, replicas=2, mean_gap=20)


@pytest.mark.parametrize("seed", range(40))
def test_every_kind_comes_at_least_once_spaced_within_the_window(seed: int) -> None:
    faults = make_schedule(seed, 90, nodes=NODES, replicas=2, mean_gap=15, warmup=5, cooldown=10, min_gap=3)
    assert all(n >= 1 for n in counts_by_kind(faults).values()), faults
    times = [f.at for f in faults]
    assert times == sorted(times) and 5 <= times[0] and times[-1] <= 80
    assert all(b - a >= 3 - 1e-6 for a, b in zip(times, times[1:])), times
    for fault in faults:
        if fault.kind in ("agent", "kubelet"):
            assert fault.target in NODES
        elif fault.kind == "operator":
            assert fault.target in ("0", "1")
        else:
            assert fault.target is None and fault.signal in ("SIGTERM", "SIGKILL")


@pytest.mark.parametrize("seed", range(20))
def test_the_guaranteed_agent_and_kubelet_faults_hit_a_real_node_whose_kubelet_gets_a_signal(seed: int) -> None:
    faults = make_schedule(seed, 90, nodes=NODES, replicas=2, mean_gap=10, real_nodes=("n1",))
    assert {f.kind for f in faults if f.target == "n1"} >= {"agent", "kubelet"}, faults
    for fault in faults:
        if fault.kind == "kubelet":  # a real kubelet is a process; a stand-in is restarted
            assert fault.signal in (("SIGTERM", "SIGKILL") if fault.target == "n1" else ("restart",)), fault
    with pytest.raises(ValueError, match="real node.*n9 not among the nodes"):
        make_schedule(seed, 90, nodes=NODES, replicas=2, mean_gap=10, real_nodes=("n9",))


def test_mean_gap_adds_faults_and_zero_gives_only_the_guaranteed() -> None:
    assert sorted(f.kind for f in make_schedule(3, 600, nodes=NODES, replicas=1, mean_gap=0)) == sorted(FAULT_KINDS)
    many = make_schedule(3, 600, nodes=NODES, replicas=1, mean_gap=10)
    assert 30 <= len(many) <= 80  # ~59 expected from a Poisson process of rate 1/10 over 590 s, less the dropped


def test_a_window_too_short_for_the_guaranteed_faults_is_refused() -> None:
    with pytest.raises(ValueError, match="no room for 5 faults"):
        make_schedule(1, 12, nodes=NODES, replicas=1, mean_gap=0)
    with pytest.raises(ValueError, match="unknown fault kind"):
        make_schedule(1, 100, nodes=NODES, replicas=1, mean_gap=0, guaranteed=("meteor",))


# --- invariants -------------------------------------------------------------------------------

def held(uid: str, device: str, share: str | None = None, memory: int = 0, pool: str = "n0") -> inv.Holding:
    consumed = (("memory", memory), ("shares", 1)) if share else ()
    return inv.Holding(uid, pool, device, share, consumed)


CAPACITY = {("n0", "gpu-0"): {"memory": 24 * GI, "shares": 4}, ("n0", "gpu-1"): {"memory": 24 * GI, "shares": 4}}


def test_two_claims_on_one_device_are_a_violation_unless_both_are_shares_within_capacity() -> None:
    assert inv.overcommitted([held("a", "gpu-0"), held("b", "gpu-1")], CAPACITY, where="w") == []
    [whole] = inv.overcommitted([held("a", "gpu-0"), held("b", "gpu-0", "s1", 4 * GI)], CAPACITY, where="nodes")
    assert whole.kind == "device-shared" and "n0/gpu-0 held by a, b" in whole.detail and "held whole by a" in whole.detail
    fits = [held(u, "gpu-0", f"s{u}", 6 * GI) for u in "abcd"]
    assert inv.overcommitted(fits, CAPACITY, where="w") == []
    [shares] = inv.overcommitted([*fits, held("e", "gpu-0", "se", 0)], CAPACITY, where="w")
    assert "shares consumed 5 of 4" in shares.detail
    [memory] = inv.overcommitted([held("a", "gpu-1", "s1", 20 * GI), held("b", "gpu-1", "s2", 8 * GI)], CAPACITY, where="w")
    assert f"memory consumed {28 * GI} of {24 * GI}" in memory.detail


def node(name: str = "n0", checkpoint: dict | None = None, cdi: set[str] = set(), mps: set[str] = set()) -> inv.NodeState:
    return inv.NodeState(name, checkpoint or {}, frozenset(cdi), frozenset(mps))


def claim(uid: str, devices: tuple[inv.Holding, ...] = (), pods: tuple[str, ...] = ("p",)) -> inv.ClaimState:
    return inv.ClaimState(uid, "ns", f"c-{uid}", devices, frozenset(pods))


def test_a_node_preparing_a_device_its_claim_was_not_allocated_is_a_violation() -> None:
    claims = {"a": claim("a", (held("a", "gpu-0"),))}
    assert inv.prepared_not_allocated([node(checkpoint={"a": ("PrepareCompleted", (held("a", "gpu-0"),))})], claims) == []
    [wrong] = inv.prepared_not_allocated([node(checkpoint={"a": ("PrepareStarted", (held("a", "gpu-1"),))})], claims)
    assert wrong.kind == "prepared-not-allocated" and "holds n0/gpu-1, allocated n0/gpu-0" in wrong.detail
    # a claim gone or deallocated is no mismatch: it is an orphan, which the tracker times
    assert inv.prepared_not_allocated([node(checkpoint={"z": ("PrepareCompleted", (held("z", "gpu-1"),))})], claims) == []


def test_orphans_are_node_state_of_claims_gone_or_reserved_for_no_pod() -> None:
    claims = {"a": claim("a", (held("a", "gpu-0"),)), "b": claim("b", (held("b", "gpu-1"),), pods=())}
    state = node(checkpoint={"a": ("PrepareCompleted", ()), "b": ("PrepareCompleted", ())}, cdi={"a", "c"}, mps={"d"})
    assert inv.orphans([state], claims) == {("n0", "checkpoint entry", "b"), ("n0", "CDI spec", "c"), ("n0", "MPS daemon", "d")}


def test_the_tracker_reports_an_orphan_once_after_its_grace_and_forgets_one_released() -> None:
    tracker = inv.OrphanTracker(grace=30)
    key = ("n0", "CDI spec", "c")
    assert tracker.update(0, {key}) == []
    assert tracker.update(29, {key}) == []
    [late] = tracker.update(31, {key})
    assert late.kind == "outlived-claim" and "CDI spec of claim c for 31s" in late.detail
    assert tracker.update(40, {key}) == []  # once
    other = ("n1", "MPS daemon", "d")
    assert tracker.update(50, {other}) == [] and tracker.update(70, set()) == []  # released in time
    assert tracker.update(200, {other}) == []  # seen anew: its clock starts again


def slice_(node_name: str, devices: list[str], generation: int = 1, count: int = 1) -> dict:
    return {"spec": {"nodeName": node_name, "pool": {"name": node_name, "generation": generation,
                                                      "resourceSliceCount": count},
                     "devices": [{"name": d} for d in devices]}}


def test_slices_must_publish_each_gpu_once_in_one_generation() -> None:
    hardware = {"n0": ["gpu-0", "gpu-1"], "n1": ["gpu-0", "gpu-1"]}
    assert inv.slice_mismatch(hardware, [slice_("n0", ["gpu-0", "gpu-1"]), slice_("n1", ["gpu-1", "gpu-0"])]) == []
    problems = inv.slice_mismatch(hardware, [slice_("n0", ["gpu-0"], 2, 2), slice_("n0", ["gpu-1"], 3, 2),
                                             slice_("n1", ["gpu-0", "gpu-0", "gpu-1"])])
    assert [str(p) for p in problems] == ["slices: n0: generations [2, 3]",
                                          "slices: n1: devices ['gpu-0', 'gpu-0', 'gpu-1'], hardware ['gpu-0', 'gpu-1']"]
    [missing] = inv.slice_mismatch(hardware, [slice_("n0", ["gpu-0", "gpu-1"])])
    assert str(missing) == "slices: n1: devices [], hardware ['gpu-0', 'gpu-1']"
    [count] = inv.slice_mismatch({"n0": ["gpu-0"]}, [slice_("n0", ["gpu-0"], count=2)])
    assert "1 slice(s), resourceSliceCount [2]" in str(count)


def test_a_pod_waiting_past_the_deadline_is_a_violation_unless_it_ran_or_was_deleted() -> None:
    pods = [inv.PodRecord("ns", "waiting", created=0), inv.PodRecord("ns", "ran", created=0, running=5),
            inv.PodRecord("ns", "gone", created=0, deleted=3), inv.PodRecord("ns", "young", created=90)]
    assert [str(v) for v in inv.pods_not_run(pods, now=100, deadline=60)] == ["pod-not-run: ns/waiting waiting 100s"]


def test_allocation_results_become_holdings_with_capacity_in_base_units() -> None:
    shared = inv.holding_from_result({"pool": "n0", "device": "gpu-0", "driver": "d", "shareID": "s-1",
                                      "consumedCapacity": {"memory": "4Gi", "shares": "1"}}, "a")
    assert shared == inv.Holding("a", "n0", "gpu-0", "s-1", (("memory", 4 * GI), ("shares", 1)))
    assert inv.holding_from_result({"pool": "n0", "device": "gpu-1", "driver": "d"}, "b") == inv.Holding("b", "n0", "gpu-1")
    both = inv.check_state([node(checkpoint={"a": ("PrepareCompleted", (shared,))})],
                           {"a": claim("a", (shared,)), "b": claim("b", (held("b", "gpu-0"),))}, CAPACITY)
    assert [v.kind for v in both] == ["device-shared"]  # allocated: a share beside a whole-device claim


def test_the_kubelet_stand_in_knows_a_pods_claims_only_once_each_has_a_name() -> None:
    from gpudra_dev.chaos.kubelet import allocated_devices, claim_names, reserved_for

    pod = {"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "plain"},
                                       {"name": "shared", "resourceClaimName": "mps-1"}]}, "status": {}}
    assert claim_names(pod) is None  # the template's claim is not made yet
    pod["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}]
    assert claim_names(pod) == ["p-gpu-x1", "mps-1"]
    claim = {"status": {"allocation": {"devices": {"results": [
        {"driver": "gpu.gpudra.io", "pool": "n0", "device": "gpu-1"},
        {"driver": "other.example.com", "pool": "n0", "device": "nic-0"}]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}]}}
    assert allocated_devices(claim, "gpu.gpudra.io") == {("n0", "gpu-1")}
    assert reserved_for(claim, "u-1") and not reserved_for(claim, "u-2") and not reserved_for({}, "u-1")
