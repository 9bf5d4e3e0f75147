"""Asking the API server's type checker about a ValidatingAdmissionPolicy (tests only)."""

from __future__ import annotations

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.waiting import wait_for

POLICY = resource_type("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy")


async def type_checked(kube: Kube, name: str) -> Obj | None:
    """A policy's status once kube-controller-manager has type-checked its current generation
    (None before). Written with observedGeneration in one apply; a clean check after a warning
    leaves no typeChecking at all (the emptied field is dropped)."""
    live = await kube.get(POLICY, name)
    status: Obj = (live or {}).get("status") or {}
    done = live is not None and status.get("observedGeneration") == live["metadata"]["generation"]
    return status if done else None


async def type_check_warnings(kube: Kube, name: str, spec: Obj) -> list[Obj]:
    """The type checker's warnings on a policy of ``spec`` (created as ``name``, unbound: it decides
    nothing). The checker checks a generation once and learns of a new CRD through discovery
    (refreshed every 30 s): a check that did not know the GpuDraConfig schema yet (undeclared
    'params') is asked again with a new generation."""
    await kube.create({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
                       "metadata": {"name": name}, "spec": spec})

    async def checked() -> list[list[Obj]] | None:
        status = await type_checked(kube, name)
        if status is None:
            return None
        warnings: list[Obj] = (status.get("typeChecking") or {}).get("expressionWarnings") or []
        if any("undeclared reference to 'params'" in w["warning"] for w in warnings):
            live = await kube.get(POLICY, name)
            assert live is not None
            flipped = "Ignore" if live["spec"]["failurePolicy"] == "Fail" else "Fail"  # a new generation
            await kube.patch(POLICY, name, {"spec": {"failurePolicy": flipped}})
            return None
        return [warnings]

    try:
        (warnings,) = await wait_for(checked, timeout=90, interval=1, what=f"{name} to be type-checked")
        return warnings
    finally:
        await kube.delete(POLICY, name)
