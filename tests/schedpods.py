"""A pod that uses one ResourceClaim (or several, or one from a template) and is pinned to one node,
and what the scheduler decided about it: the integration tests that compare gpudra with the real
kube-scheduler share these."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]


def pinned_pod(name: str, namespace: str, node: str, claim_name: str, *, gate: str | None = None) -> Obj:
    """``gate``: a scheduling gate that holds the pod until the test lifts it."""
    return pinned_pod_with(name, namespace, node, {"gpus": {"resourceClaimName": claim_name}}, gate=gate)


def pinned_pod_with(name: str, namespace: str, node: str, claims: Mapping[str, Obj], *, gate: str | None = None) -> Obj:
    """A pod pinned to ``node`` whose one container uses every entry of ``claims``: the pod's name
    for the claim -> ``{"resourceClaimName": ...}`` or ``{"resourceClaimTemplateName": ...}``."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "schedulingGates": [{"name": gate}] if gate else [],
                     "resourceClaims": [{"name": entry, **source} for entry, source in claims.items()],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": entry} for entry in claims]}}]}}


def claim_names(pod: Obj | None) -> list[str] | None:
    """The names of the ResourceClaims the pod uses, in its spec's order: a template's claim by
    the name the resourceclaim controller gave it; None while one of those is not created yet."""
    statuses = {s.get("name"): s.get("resourceClaimName")
                for s in ((pod or {}).get("status") or {}).get("resourceClaimStatuses") or []}
    names = []
    for entry in ((pod or {}).get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("resourceClaimName") or statuses.get(entry.get("name"))
        if not name:
            return None
        names.append(str(name))
    return names


def scheduling_outcome(pod: Obj | None) -> tuple[bool, str] | None:
    """(True, "") once bound to a node; (False, the scheduler's message) once it marked the pod
    unschedulable; None before either."""
    if pod is None:
        return None
    if (pod.get("spec") or {}).get("nodeName"):
        return True, ""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") in ("Unschedulable", "SchedulerError"):
            return False, str(condition.get("message"))
    return None
