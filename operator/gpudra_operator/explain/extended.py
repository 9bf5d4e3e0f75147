"""The claim kube-scheduler builds for a pod's extended resources (KEP-5004), as explain replays it.

A DeviceClass with ``spec.extendedResourceName`` (or any class, by the implicit name
``deviceclass.resource.kubernetes.io/<class>``) lets a pod ask for devices as an extended resource,
``example.com/gpu: 2``, with no ResourceClaim. Where no device plugin serves that resource on a node,
the scheduler's DynamicResources plugin builds a claim for the pod on that node (one request per
container and resource; init containers reuse what later containers ask), allocates it with the
pod's own claims, and creates it in PreBind. gpudra-allocator builds it with the release's own code
(:meth:`~gpudra_operator.allocatorhelper.AllocatorHelper.extended`); this module only turns that
answer into a claim to explain and a report. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudra_operator.allocatorhelper import ExtendedNode, ExtendedPlan
from gpudra_operator.explain.claims import claim_label
from gpudra_operator.explain.inventory import Obj
from gpudra_operator.explain.ownership import ours_only
from gpudra_operator.explain.verdict import ExtendedReport

# resourceapi.ExtendedResourceClaimAnnotation: on the claim the scheduler creates for a pod
EXTENDED_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"


def owns_extended_claim(pod: Obj, claims: Sequence[Obj]) -> bool:
    """Whether one of ``claims`` is the one the scheduler created for ``pod``'s extended resources
    (then it is explained as the pod's claim, allocated or not, and none is built)."""
    uid = (pod.get("metadata") or {}).get("uid")
    for claim in claims:
        meta = claim.get("metadata") or {}
        if (meta.get("annotations") or {}).get(EXTENDED_CLAIM_ANNOTATION) == "true" and any(
                owner.get("uid") == uid and owner.get("controller") for owner in meta.get("ownerReferences") or []):
            return True
    return False


@dataclass
class ExtendedClaim:
    """The scheduler's claim for the pod, per node, trimmed to the driver's requests."""

    plan: ExtendedPlan
    variants: list[dict[str, Any]]  # per variant of the plan: {"requests": the driver's requests}
    main: int | None  # the variant most of the nodes get: the one explained
    claim: dict[str, Any] | None  # that variant as a claim to explain; None when none of its requests is the driver's
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._nodes = {n.name: n for n in self.plan.nodes}

    def node(self, name: str) -> ExtendedNode | None:
        return self._nodes.get(name)

    def report(self, candidates: Sequence[Obj]) -> ExtendedReport:
        label = claim_label(self.claim) if self.claim is not None else ""
        main: Obj = self.plan.variants[self.main] if self.main is not None else {}
        report = ExtendedReport(claim=label, resources=dict(self.plan.resources), classes=dict(self.plan.classes),
                                requests=list(main.get("requests") or []), mappings=list(main.get("mappings") or []))
        for node in candidates:
            name = node["metadata"]["name"]
            plan = self.node(name)
            if plan is None:
                continue
            if plan.unschedulable is not None:
                report.unfit[name] = plan.unschedulable
            elif plan.variant is None:
                report.device_plugin_nodes.append(name)
        return report


def extended_claim(pod: Obj, plan: ExtendedPlan, classes: Mapping[str, Obj], driver: str) -> ExtendedClaim:
    """The claim to explain for ``pod``: the variant most nodes in ``plan`` get, as the scheduler
    keeps it in memory before PreBind creates it (named here ``<pod>-extended-resources``), with
    only the requests whose class is ``driver``'s; each variant trimmed the same way for the
    allocator."""
    meta = pod.get("metadata") or {}
    notes: list[str] = []
    variants: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []
    for index, variant in enumerate(plan.variants):
        claim: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": f"{meta.get('name')}-extended-resources", "namespace": meta.get("namespace"),
                              "uid": f"extended-resources-{meta.get('uid')}",
                              "annotations": {EXTENDED_CLAIM_ANNOTATION: "true"}},
                 "spec": {"devices": {"requests": list(variant.get("requests") or [])}}}
        trimmed, dropped = ours_only(claim, classes, driver)
        if index == 0:
            notes += dropped
        variants.append({"requests": trimmed["spec"]["devices"]["requests"]})
        shown.append(trimmed)
    counts = Counter(n.variant for n in plan.nodes if n.variant is not None and n.unschedulable is None)
    main = min(counts, key=lambda v: (-counts[v], v)) if counts else None
    explained = shown[main] if main is not None and variants[main]["requests"] else None
    asked = ", ".join(f"{name}: {amount} (DeviceClass {plan.classes.get(name)})"
                      for name, amount in sorted(plan.resources.items()))
    if explained is not None:
        notes.append(f"the pod asks for extended resources that DeviceClasses map to DRA devices ({asked}): the "
                     f"scheduler builds claim {claim_label(explained)} for it on each node (created when the pod "
                     "is bound); explained below with the pod's claims")
    if plan.prior:
        notes.append(f"claim {meta.get('namespace')}/{plan.prior} is from an earlier scheduling attempt: the scheduler "
                     "deletes it and tries again")
    return ExtendedClaim(plan=plan, variants=variants, main=main, claim=explained, notes=notes)
