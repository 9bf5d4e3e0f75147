"""A pod that uses one ResourceClaim (or several, or one from a template, or extended resources
backed by DRA) and is pinned to one node, and what the scheduler decided about it: the
integration tests that compare gpudra with the real kube-scheduler share these."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

Obj = dict[str, Any]
PAUSE = "registry.k8s.io/pause:3.10"


def pinned_pod(name: str, namespace: str, node: str, claim_name: str, *, gate: str | None = None) -> Obj:
    """``gate``: a scheduling gate that holds the pod until the test lifts it."""
    return pinned_pod_with(name, namespace, node, {"gpus": {"resourceClaimName": claim_name}}, gate=gate)


def pinned_pod_with(name: str, namespace: str, node: str, claims: Mapping[str, Obj], *, gate: str | None = None,
                    containers: Sequence[Obj] | None = None, init_containers: Sequence[Obj] = ()) -> Obj:
    """A pod pinned to ``node`` whose first container uses every entry of ``claims``: the pod's name
    for the claim -> ``{"resourceClaimName": ...}`` or ``{"resourceClaimTemplateName": ...}``.
    ``containers`` and ``init_containers``: their names, resources (extended resources, KEP-5004)
    and restartPolicy (a sidecar), given the pause image; None: one container. A pod with no claims
    has neither ``resourceClaims`` nor ``resources.claims``."""
    def with_image(container: Obj) -> Obj:
        return {"image": PAUSE, **copy.deepcopy(container)}

    regular: list[Obj] = [with_image(c) for c in containers] if containers else [{"name": "main", "image": PAUSE}]
    if claims:
        resources = regular[0].setdefault("resources", {})
        resources["claims"] = [*(resources.get("claims") or []), *({"name": entry} for entry in claims)]
    spec: Obj = {"nodeSelector": {"kubernetes.io/hostname": node},
                 "schedulingGates": [{"name": gate}] if gate else []}
    if claims:
        spec["resourceClaims"] = [{"name": entry, **source} for entry, source in claims.items()]
    if init_containers:
        spec["initContainers"] = [with_image(c) for c in init_containers]
    spec["containers"] = regular
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


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


def extended_claim_name(pod: Obj | None) -> str | None:
    """The ResourceClaim kube-scheduler created for the pod's extended resources backed by DRA
    (KEP-5004), from pod.status.extendedResourceClaimStatus: it exists once the scheduler placed
    the pod (PreBind), not before; None until then, or for a pod that asks for none. Not among
    :func:`claim_names`, which are the claims the pod's spec names."""
    status = ((pod or {}).get("status") or {}).get("extendedResourceClaimStatus") or {}
    name = status.get("resourceClaimName")
    return str(name) if name else None


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
