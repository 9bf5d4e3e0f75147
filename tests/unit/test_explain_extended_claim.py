"""explain's view of the claim kube-scheduler builds for a pod's extended resources
(gpudra_operator.explain.extended): which variant is explained, trimmed to the driver's requests;
which nodes device plugins serve or the scheduler turns down; whether a claim in the cluster is the
one the scheduler already created for the pod. The variants themselves come from
gpudra-allocator (tests/unit/test_allocator_helper.py)."""

from __future__ import annotations

from typing import Any

from gpudra_operator.allocatorhelper import ExtendedNode, ExtendedPlan
from gpudra_operator.explain.extended import EXTENDED_CLAIM_ANNOTATION, extended_claim, owns_extended_claim

DRIVER = "gpu.gpudra.io"
POD = {"metadata": {"name": "legacy", "namespace": "team", "uid": "uid-legacy"}}
OURS = {"metadata": {"name": "gpu"}, "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}
THEIRS = {"metadata": {"name": "fpga"}, "spec": {"selectors": [{"cel": {"expression": 'device.driver == "fpga.example.com"'}}]}}


def request(name: str, class_name: str, count: int) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": class_name, "allocationMode": "ExactCount", "count": count}}


def plan(nodes: list[ExtendedNode], *variants: list[dict[str, Any]]) -> ExtendedPlan:
    return ExtendedPlan(resources={"nvidia.com/gpu": 2}, classes={"nvidia.com/gpu": "gpu"}, prior=None,
                        variants=[{"requests": v, "mappings": []} for v in variants], nodes=nodes)


def test_the_variant_most_nodes_get_is_explained_trimmed_to_the_drivers_requests() -> None:
    both = [request("container-0-request-0", "fpga", 1), request("container-0-request-1", "gpu", 2)]
    gpu_only = [request("container-0-request-1", "gpu", 2)]
    nodes = [ExtendedNode("a", 0, None), ExtendedNode("b", 1, None), ExtendedNode("c", 1, None),
             ExtendedNode("d", None, None), ExtendedNode("e", None, "cannot fit resource example.com/x")]
    built = extended_claim(POD, plan(nodes, gpu_only, both), {"gpu": OURS, "fpga": THEIRS}, DRIVER)
    assert built.main == 1
    assert built.claim is not None
    assert built.claim["metadata"]["name"] == "legacy-extended-resources"
    assert built.claim["metadata"]["annotations"] == {EXTENDED_CLAIM_ANNOTATION: "true"}
    assert [r["name"] for r in built.claim["spec"]["devices"]["requests"]] == ["container-0-request-1"]
    # Every variant goes to the allocator trimmed the same way.
    assert [[r["name"] for r in v["requests"]] for v in built.variants] == [["container-0-request-1"]] * 2
    report = built.report([{"metadata": {"name": n}} for n in "abcde"])
    assert report.claim == "team/legacy-extended-resources"
    assert report.device_plugin_nodes == ["d"] and report.unfit == {"e": "cannot fit resource example.com/x"}
    assert [r["name"] for r in report.requests] == [r["name"] for r in both]  # as the scheduler builds it


def test_no_claim_to_explain_when_device_plugins_serve_every_node_or_no_request_is_ours() -> None:
    served = extended_claim(POD, plan([ExtendedNode("a", None, None)]), {"gpu": OURS}, DRIVER)
    assert served.main is None and served.claim is None
    theirs = extended_claim(POD, plan([ExtendedNode("a", 0, None)], [request("container-0-request-0", "fpga", 1)]),
                            {"gpu": OURS, "fpga": THEIRS}, DRIVER)
    assert theirs.claim is None and any("not for gpu.gpudra.io's devices" in n for n in theirs.notes)


def test_the_claim_the_scheduler_created_is_recognised_by_annotation_and_controller_owner() -> None:
    def claim(annotated: bool, uid: str, controller: bool) -> dict[str, Any]:
        return {"metadata": {"name": "c", "annotations": {EXTENDED_CLAIM_ANNOTATION: "true"} if annotated else {},
                             "ownerReferences": [{"kind": "Pod", "name": "legacy", "uid": uid,
                                                  "controller": controller}]}}
    assert owns_extended_claim(POD, [claim(True, "uid-legacy", True)])
    assert not owns_extended_claim(POD, [claim(False, "uid-legacy", True)])
    assert not owns_extended_claim(POD, [claim(True, "uid-other", True)])
    assert not owns_extended_claim(POD, [claim(True, "uid-legacy", False)])
