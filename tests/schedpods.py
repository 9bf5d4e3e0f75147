"""A pod that uses one ResourceClaim and is pinned to one node, and what the scheduler decided
about it: the integration tests that compare gpudra with the real kube-scheduler share these."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def pinned_pod(name: str, namespace: str, node: str, claim_name: str, *, gate: str | None = None) -> Obj:
    """``gate``: a scheduling gate that holds the pod until the test lifts it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "schedulingGates": [{"name": gate}] if gate else [],
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": claim_name}],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": "gpus"}]}}]}}


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
