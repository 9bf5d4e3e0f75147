"""Who holds a counter set, and what is left of it (gpudra_operator.explain.countersets): slices and
allocated claims in, a summary out, counted as the allocator counts (an allocated device consumes
its counters once, whole or shared; adminAccess holds nothing), bounded however many claims there are."""

from __future__ import annotations

from typing import Any

from gpudra_operator.explain.countersets import MAX_CLAIMS, MAX_NAME, MAX_TAKEN, counter_set_use, ranges, unit_runs, Left
from gpudra_operator.explain.inventory import SliceIndex, counters_left, holdings

DRIVER = "gpu.gpudra.io"
Obj = dict[str, Any]


def gpu(node: str | None = "node-a", placements: int = 8) -> list[Obj]:
    """A counter set of 8 one-unit memory slices and 7 compute slices, and a one-slice placement at
    each memory slice (``p<k>``), plus a device of another set; one pool, two slices."""
    pool = {"name": "pool-a", "generation": 1, "resourceSliceCount": 2}
    where = {"nodeName": node} if node else {"allNodes": True}
    counters = {"compute-slices": {"value": "7"}, **{f"memory-slice-{k}": {"value": "1"} for k in range(8)}}
    devices = [{"name": f"p{k}", "allowMultipleAllocations": True, "consumesCounters": [{"counterSet": "gpu-0", "counters": {
        "compute-slices": {"value": "1"}, f"memory-slice-{k % 8}": {"value": "1"}}}]} for k in range(placements)]
    devices.append({"name": "other", "consumesCounters": [{"counterSet": "gpu-1", "counters": {"x": {"value": "1"}}}]})
    return [{"metadata": {"name": "counters"}, "spec": {"driver": DRIVER, "pool": pool, **where, "sharedCounters": [
                {"name": "gpu-0", "counters": counters}, {"name": "gpu-1", "counters": {"x": {"value": "1"}}}]}},
            {"metadata": {"name": "devices"}, "spec": {"driver": DRIVER, "pool": pool, **where, "devices": devices}}]


def claim(name: str, *results: Obj, namespace: str = "ns") -> Obj:
    return {"metadata": {"name": name, "namespace": namespace},
            "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": DRIVER, "pool": "pool-a", **r} for r in results]}}}}


def use_of(slices: list[Obj], claims: list[Obj], *, consumable: bool = True, short: tuple[str, ...] = ()) -> Any:
    held = holdings(claims, consumable=consumable)
    index = SliceIndex(slices)
    counters = counters_left(index, held)[(DRIVER, "pool-a")]["gpu-0"]
    return counter_set_use(DRIVER, "pool-a", "gpu-0", index.newest[(DRIVER, "pool-a")], counters, held, short)


def test_ranges_and_runs_of_one_unit_counters() -> None:
    assert ranges([7, 0, 1, 2, 3, 5, 8]) == "0-3, 5 and 7-8"
    assert ranges([4]) == "4" and ranges([4, 6]) == "4 and 6" and ranges([]) == ""
    runs = unit_runs({"memory-slice-1": Left("1", "0"), "memory-slice-0": Left("1", "1"), "lane-0": Left("1", "1"),
                      "engine-0": Left("2", "2"), "engine-1": Left("2", "2"), "compute-slices": Left("7", "7")})
    # one member is no run, nor are counters of more than one unit
    assert runs == {"memory-slice": {0: "memory-slice-0", 1: "memory-slice-1"}}


def test_the_placements_taken_in_memory_order_with_their_claims_and_what_is_left() -> None:
    claims = [claim("late", {"device": "p6"}), claim("early", {"device": "p1"}),
              claim("admin", {"device": "p3", "adminAccess": True}),  # holds nothing, as for the allocator
              claim("elsewhere", {"device": "other"})]  # another counter set
    use = use_of(gpu(), claims, short=("compute-slices",))
    assert (use.pool, use.name, use.node) == ("pool-a", "gpu-0", "node-a")
    assert [(t.device, t.claims) for t in use.taken] == [("p1", ["ns/early"]), ("p6", ["ns/late"])]
    assert use.counters["compute-slices"] == Left("7", "5")
    assert use.describe() == ("counter set gpu-0 on node-a: compute-slices 5 of 7 left; memory slices 1 and 6 "
                              "taken, 0, 2-5 and 7 free; held by ns/early (p1), ns/late (p6)")
    assert use_of(gpu(node=None), []).describe() == ("counter set gpu-0 of pool pool-a: compute-slices 7 of 7 left; "
                                                     "memory slices 0-7 free; nothing allocated from it")


def test_the_short_line_names_only_the_short_counters_and_a_few_holders() -> None:
    claims = [claim(f"c{k}", {"device": f"p{k}"}) for k in range(7)]
    use = use_of(gpu(), claims, short=("memory-slice-7",))
    assert use.describe(every_counter=False, holders=2) == (
        "counter set gpu-0 on node-a: memory slices 0-6 taken, 7 free; held by ns/c0 (p0), ns/c1 (p1) and 5 more")
    assert use_of(gpu(), claims, short=("compute-slices",)).describe(every_counter=False, holders=8).startswith(
        "counter set gpu-0 on node-a: compute-slices 0 of 7 left; memory slices 0-6 taken, 7 free; held by ns/c0 (p0)")


def test_shares_of_one_device_consume_its_counters_once_and_name_each_claim() -> None:
    shares = [claim(f"s{k}", {"device": "p2", "shareID": f"uid-{k}"}) for k in range(MAX_CLAIMS + 2)]
    use = use_of(gpu(), shares)
    assert use.counters["compute-slices"] == Left("7", "6")
    (taken,) = use.taken
    assert (taken.claims, taken.more_claims) == ([f"ns/s{k}" for k in range(MAX_CLAIMS)], 2)
    assert "held by ns/s0, ns/s1, ns/s2, ns/s3 and 2 more (p2)" in use.describe()
    # without consumable capacity a share holds the device whole: the last claim read holds it
    assert [t.claims for t in use_of(gpu(), shares, consumable=False).taken] == [[f"ns/s{MAX_CLAIMS + 1}"]]


def test_however_many_claims_hold_the_set_the_summary_is_bounded() -> None:
    many = gpu(placements=MAX_TAKEN + 10)  # over-committed on purpose: placements beyond 8 share memory slices
    long_namespace = "n" * 63
    claims = [claim("x" * 253 + str(k), {"device": f"p{k}"}, namespace=long_namespace) for k in range(MAX_TAKEN + 10)]
    use = use_of(many, claims)
    assert (len(use.taken), use.more_taken) == (MAX_TAKEN, 10)
    assert all(len(c) == MAX_NAME and c.endswith("…") for t in use.taken for c in t.claims)
    assert use.counters["compute-slices"] == Left("7", f"-{MAX_TAKEN + 10 - 7}")
    text = use.describe(holders=3)
    assert text.endswith(f" and {MAX_TAKEN + 10 - 3} more") and len(text) < 3 * (MAX_NAME + 10) + 200


def test_the_verdict_and_the_detail_name_a_bounded_number_of_counter_sets() -> None:
    from gpudra_operator.explain.report import as_text
    from gpudra_operator.explain.room import Room
    from gpudra_operator.explain.verdict import (COUNTER_SETS_IN_LINE, MAX_COUNTER_SETS, ClaimReport, NodeCounts,
                                                 RequestReport, Verdict, conclude)

    sets = [use_of(gpu(), [claim(f"c{k}", {"device": f"p{k}"}) for k in range(7)], short=("compute-slices",))
            for _ in range(MAX_COUNTER_SETS)]
    for k, use in enumerate(sets):
        use.name = f"gpu-{k}"
    nearest = Room("node-a", "pool-a/p7", "counter", "gpu-3/compute-slices", False, total="7", held="7", left="0",
                   asks="1", pool="pool-a")
    request = RequestReport(name="mig", class_name="mig", class_exists=True, mode="ExactCount", count=1,
                            admin_access=False, nodes=[NodeCounts("node-a", published=8, class_match=8,
                                                                  request_match=8, no_room=8)],
                            rooms=[nearest], counter_sets=sets, more_counter_sets=5)
    verdict = Verdict(target="claim ns/c", satisfiable=False, nodes=[], error=None, conclusion="",
                      claims=[ClaimReport("ns/c", None, None, requests=[request])])
    line = conclude(verdict, DRIVER, candidates=1)
    # the nearest miss's set first, then the next; at most 4 holders each; the rest counted
    assert line.count("; counter set ") == COUNTER_SETS_IN_LINE
    assert "0 of 7 left; counter set gpu-3 on node-a: compute-slices 0 of 7 left; memory slices 0-6 taken, 7 free; " \
           "held by ns/c0 (p0), ns/c1 (p1), ns/c2 (p2), ns/c3 (p3) and 3 more; counter set gpu-0 on node-a:" in line
    assert line.endswith(f"; {MAX_COUNTER_SETS - COUNTER_SETS_IN_LINE + 5} more counter sets short of it")
    verdict.conclusion = line
    detail = [entry for entry in as_text(verdict).splitlines()
              if entry.startswith("  request mig:") and "counter sets" in entry or "short of counter set" in entry]
    assert len(detail) == 4 and detail[0].startswith("  request mig: short of counter set gpu-0 on node-a: ")
    assert detail[0].endswith("ns/c6 (p6)")  # every holder of a full GPU of one-slice placements
    assert detail[3] == (f"  request mig: {MAX_COUNTER_SETS - 3 + 5} more counter sets short of room not shown "
                         f"(-o yaml lists {MAX_COUNTER_SETS - 3})")
