"""`gpudra explain`'s functional core on inventories discovered from the shipped GPU profiles and
DeviceClasses rendered from the operator's own templates: the verdict (the scheduler's allocation,
ported) and the conclusion that says why."""

from __future__ import annotations

from typing import Any

import pytest

from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.slices import build_slices
from gpudra_operator.deviceclasses import render_device_class
from gpudra_operator.explain import ExplainInputError, Snapshot, explain_snapshot
from gpudra_operator.explain.report import as_json, as_text, as_yaml
from gpudra_operator.explain.verdict import Verdict, explain

DRIVER = "gpu.gpudra.io"
FULL_GPU = "gpu.gpudra.io"
CLASSES = {FULL_GPU: render_device_class(FULL_GPU, DRIVER, template="full-gpu")}


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def slices_of(profile: str, node_name: str, taint: dict[str, str] | None = None) -> list[dict[str, Any]]:
    slices = build_slices(DRIVER, node_name, None, 1, discover(FakeNvml(load_profile(profile))))
    if taint:
        for device in slices[0]["spec"]["devices"]:
            device["taints"] = [taint]
    return slices


def claim(requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None, *,
          name: str = "c", allocated: list[tuple[str, str]] | None = None, node_name: str = "") -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
                           "spec": {"devices": {"requests": requests, "constraints": constraints or []}}}
    if allocated:
        obj["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": device}
                                    for pool, device in allocated]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node_name]}]}]}}}
    return obj


def gpus(count: int = 1, *selectors: str, name: str = "gpu", **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": FULL_GPU, "count": count,
                                      "selectors": [{"cel": {"expression": e}} for e in selectors], **extra}}


def run(claims: list[dict[str, Any]], nodes: list[dict[str, Any]], slices: list[dict[str, Any]], *,
        pod: dict[str, Any] | None = None, others: list[dict[str, Any]] = (), classes=CLASSES) -> Verdict:  # type: ignore[assignment]
    return explain("claim team/c", claims, pod=pod, classes=classes, slices=slices, nodes=nodes,
                   other_claims=list(others), namespace=None, driver=DRIVER)


MEMORY_64GI = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0'


def test_a_claim_no_node_can_satisfy_names_the_selector_and_the_largest_value() -> None:
    verdict = run([claim([gpus(8, MEMORY_64GI)])], [node("a100")], slices_of("dgx-a100-40gb", "a100"))
    assert not verdict.satisfiable and verdict.nodes == [] and verdict.error is None
    assert verdict.conclusion.startswith("no node can satisfy request gpu: 8 devices match the class, 0 pass request gpu #0")
    assert "memory=40Gi" in verdict.conclusion and "(largest: 40Gi on a100/gpu-" in verdict.conclusion
    (counts,) = verdict.claims[0].requests[0].nodes
    assert (counts.published, counts.class_match, counts.request_match, counts.free, counts.needed) == (8, 8, 0, 0, 8)


def test_the_nodes_where_it_fits_are_named() -> None:
    slices = slices_of("dgx-a100-40gb", "a100") + slices_of("dgx-h100", "h100-a") + slices_of("dgx-h100", "h100-b")
    verdict = run([claim([gpus(8, MEMORY_64GI)])], [node("a100"), node("h100-a"), node("h100-b")], slices)
    assert verdict.satisfiable and verdict.nodes == ["h100-a", "h100-b"]
    assert verdict.conclusion == "can be allocated on 2 nodes: h100-a, h100-b"


def test_devices_held_by_other_claims_are_counted_and_named() -> None:
    held = claim([gpus(6)], name="training", allocated=[("h100", f"gpu-{i}") for i in range(6)], node_name="h100")
    verdict = run([claim([gpus(4)])], [node("h100")], slices_of("dgx-h100", "h100"), others=[held])
    assert not verdict.satisfiable
    (counts,) = verdict.claims[0].requests[0].nodes
    assert (counts.request_match, counts.in_use, counts.free, counts.holders) == (8, 6, 2, {"team/training": 6})
    assert "at most 2 free on one node (h100)" in verdict.conclusion and "team/training (6)" in verdict.conclusion


def test_a_missing_class_and_a_failing_selector_are_the_schedulers_errors() -> None:
    missing = run([claim([{"name": "gpu", "exactly": {"deviceClassName": "nope.example.com"}}])],
                  [node("h100")], slices_of("dgx-h100", "h100"))
    assert not missing.satisfiable and missing.conclusion == "request gpu: DeviceClass nope.example.com does not exist"
    failing = run([claim([gpus(1, f'device.attributes["{DRIVER}"].memoryBandwidth > 5')])],
                  [node("h100")], slices_of("dgx-h100", "h100"))
    assert not failing.satisfiable and failing.error is not None
    assert "CEL runtime error: no such key: memoryBandwidth" in failing.conclusion
    # an error absorbed by || is no error, as in the scheduler
    absorbed = run([claim([gpus(1, f'device.attributes["{DRIVER}"].memoryBandwidth > 5 || true')])],
                   [node("h100")], slices_of("dgx-h100", "h100"))
    assert absorbed.satisfiable


def test_first_available_falls_back_to_the_next_subrequest() -> None:
    request = {"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": FULL_GPU, "count": 4,
         "selectors": [{"cel": {"expression": MEMORY_64GI}}]},
        {"name": "small", "deviceClassName": FULL_GPU, "count": 1}]}
    verdict = run([claim([request])], [node("l4")], slices_of("l4x2", "l4"))
    assert verdict.satisfiable and verdict.nodes == ["l4"]
    assert [r.name for r in verdict.claims[0].requests] == ["gpu/big", "gpu/small"]


def test_match_attribute_needs_one_value_across_requests() -> None:
    numa = f"{DRIVER}/numaNode"
    # dgx-h100 has four GPUs per NUMA node: 4 fit together, 5 do not
    fits = run([claim([gpus(2, name="a"), gpus(2, name="b")], [{"requests": ["a", "b"], "matchAttribute": numa}])],
               [node("h100")], slices_of("dgx-h100", "h100"))
    assert fits.satisfiable
    too_many = run([claim([gpus(3, name="a"), gpus(2, name="b")], [{"requests": ["a", "b"], "matchAttribute": numa}])],
                   [node("h100")], slices_of("dgx-h100", "h100"))
    assert not too_many.satisfiable and too_many.error is None
    assert too_many.conclusion.startswith("no node can satisfy all requests together under the constraints")


def test_allocation_mode_all_wants_every_matching_device_free() -> None:
    every = gpus(name="gpu", allocationMode="All")
    del every["exactly"]["count"]
    assert run([claim([every])], [node("h100")], slices_of("dgx-h100", "h100")).satisfiable
    held = claim([gpus(1)], name="other", allocated=[("h100", "gpu-3")], node_name="h100")
    blocked = run([claim([every])], [node("h100")], slices_of("dgx-h100", "h100"), others=[held])
    assert not blocked.satisfiable and "needs all 8 on one node, at most 7 free" in blocked.conclusion


def test_untolerated_taints_and_tolerations() -> None:
    taint = {"key": "gpudra.io/unhealthy", "value": "xid", "effect": "NoSchedule"}
    slices = slices_of("l4x2", "l4", taint=taint)
    tainted = run([claim([gpus(1)])], [node("l4")], slices)
    assert not tainted.satisfiable and tainted.claims[0].requests[0].nodes[0].untolerated == 2
    assert "2 with taints the request does not tolerate" in tainted.conclusion
    tolerating = gpus(1, tolerations=[{"key": "gpudra.io/unhealthy", "operator": "Exists"}])
    assert run([claim([tolerating])], [node("l4")], slices).satisfiable


def test_the_pods_node_selection_limits_the_nodes() -> None:
    pod = {"metadata": {"name": "p", "namespace": "team"}, "spec": {"nodeSelector": {"zone": "b"}}}
    slices = slices_of("l4x2", "l4-a") + slices_of("l4x2", "l4-b")
    verdict = run([claim([gpus(1)])], [node("l4-a", zone="a"), node("l4-b", zone="b")], slices, pod=pod)
    assert verdict.nodes == ["l4-b"] and "leaves 1 of 2 nodes" in " ".join(verdict.notes)
    nowhere = run([claim([gpus(1)])], [node("l4-a", zone="a")], slices_of("l4x2", "l4-a"), pod=pod)
    assert not nowhere.satisfiable and nowhere.conclusion.startswith("no node can run the pod")


def test_an_allocated_claim_says_where() -> None:
    done = claim([gpus(1)], allocated=[("h100", "gpu-0")], node_name="h100")
    verdict = run([done], [node("h100"), node("other")], slices_of("dgx-h100", "h100"))
    assert verdict.satisfiable and verdict.conclusion == f"allocated on h100: team/c: {DRIVER}/h100/gpu-0"


def test_only_the_drivers_requests_are_explained() -> None:
    foreign_class = {"metadata": {"name": "fpga.example.com"},
                     "spec": {"selectors": [{"cel": {"expression": 'device.driver == "fpga.example.com"'}}]}}
    classes = {**CLASSES, "fpga.example.com": foreign_class}
    fpga = {"name": "fpga", "exactly": {"deviceClassName": "fpga.example.com"}}
    snapshot = Snapshot(target="claim team/c", pod=None, claims=[claim([gpus(1), fpga])], classes=classes,
                        slices=slices_of("l4x2", "l4"), nodes=[node("l4")], other_claims=[], namespace=None)
    verdict = explain_snapshot(snapshot, DRIVER)
    assert verdict.satisfiable and [r.name for r in verdict.claims[0].requests] == ["gpu"]
    assert any("request fpga" in n and "not explained" in n for n in verdict.notes)
    only_foreign = Snapshot(target="claim team/f", pod=None, claims=[claim([fpga])], classes=classes,
                            slices=[], nodes=[node("l4")], other_claims=[], namespace=None)
    with pytest.raises(ExplainInputError, match="no request is for gpu.gpudra.io's devices"):
        explain_snapshot(only_foreign, DRIVER)


def test_text_ends_with_the_conclusion_and_the_data_formats_carry_everything() -> None:
    verdict = run([claim([gpus(8, MEMORY_64GI)])], [node("a100")], slices_of("dgx-a100-40gb", "a100"))
    text = as_text(verdict)
    lines = text.splitlines()
    assert lines[-1] == verdict.conclusion
    assert lines[1].split() == ["CLAIM", "REQUEST", "CLASS", "NODE", "PUBLISHED", "CLASS-MATCH", "REQUEST-MATCH",
                                "TAINTED", "IN-USE", "FREE", "NEEDED"]
    assert lines[2].split() == ["team/c", "gpu", FULL_GPU, "a100", "8", "8", "0", "0", "0", "0", "8"]
    assert '"satisfiable": false' in as_json(verdict) and "satisfiable: false" in as_yaml(verdict)


def test_an_all_subrequest_after_a_counted_one_keeps_the_schedulers_quirk() -> None:
    """The 1.35 allocator recurses out of an ``All`` subrequest without its subrequest index, so on
    a one-GPU node [8 GPUs, else All] is unschedulable (found by the differential test); explain
    must say what the scheduler does, not what the API promises."""
    every = {"name": "s1", "deviceClassName": FULL_GPU, "allocationMode": "All"}
    request = {"name": "gpu", "firstAvailable": [{"name": "s0", "deviceClassName": FULL_GPU, "count": 8}, every]}
    assert not run([claim([request])], [node("h200")], slices_of("h200", "h200")).satisfiable
    assert run([claim([request])], [node("h100")], slices_of("dgx-h100", "h100")).satisfiable
    alone = {"name": "gpu", "firstAvailable": [{**every, "name": "s0"}]}
    assert run([claim([alone])], [node("h200")], slices_of("h200", "h200")).satisfiable
    # 1.36's allocator passes the subrequest index on
    fixed = explain("claim team/c", [claim([request])], pod=None, classes=CLASSES, slices=slices_of("h200", "h200"),
                    nodes=[node("h200")], other_claims=[], namespace=None, driver=DRIVER, server_minor=36)
    assert fixed.satisfiable


def test_a_claim_allocated_without_a_node_selector_is_allocated() -> None:
    done = claim([gpus(1)], allocated=[("h100", "gpu-0")], node_name="h100")
    del done["status"]["allocation"]["nodeSelector"]  # e.g. a network-attached device: any node
    verdict = run([done], [node("h100")], slices_of("dgx-h100", "h100"))
    assert verdict.satisfiable and verdict.conclusion == f"allocated on any node: team/c: {DRIVER}/h100/gpu-0"


@pytest.mark.parametrize("expression, message", [
    ('device.driver ==', "does not compile (the scheduler fails the pod with this error too): compilation failed: "),
    (f'device.attributes["{DRIVER}"].all(k, v, k == k, k != "")',
     "does not compile (the scheduler fails the pod with this error too): compilation failed: "),
])
def test_a_selector_that_does_not_compile_here_is_bad_input(expression: str, message: str) -> None:
    snapshot = Snapshot(target="claim team/c", pod=None, claims=[claim([gpus(1, expression)])], classes=CLASSES,
                        slices=slices_of("l4x2", "l4"), nodes=[node("l4")], other_claims=[], namespace=None)
    with pytest.raises(ExplainInputError) as info:
        explain_snapshot(snapshot, DRIVER)
    assert str(info.value).startswith(f"claim team/c request gpu selector #0 {message}")
    assert "\n" not in str(info.value)
