"""Whether the API server keeps device taints in ResourceSlices.

Device taints (KEP-5055) are beta and on by default from Kubernetes 1.36; in 1.35 the
DRADeviceTaints gate is alpha and off, and the API server drops ``taints`` from a slice without an
error. Publishing them there would leave every slice different from what the server stored, so the
agent leaves unhealthy devices out of its slices instead. Two ways to find out, both here:
a server-side dry run at start (nothing is stored) and, should the server change its mind later
(a downgrade, a gate turned off), every write the publisher makes (:func:`taints_dropped`).
"""

from __future__ import annotations

from typing import Any

from gpudra_core.kubeapi import Obj

FEATURE_GATE = "DRADeviceTaints"
WHY_DROPPED = (f"the API server drops device taints from ResourceSlices: its {FEATURE_GATE} feature gate is off "
               "(alpha and off by default in Kubernetes 1.35, beta and on from 1.36)")


def probe_slice(driver: str, node: str) -> Obj:
    """A ResourceSlice of ``node`` with one tainted device, for a server-side dry run."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": "gpudra-device-taints-probe-"},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
                 "devices": [{"name": "probe", "taints": [
                     {"key": f"{driver}/probe", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}]}]},
    }


def _has_taints(slice_obj: Obj) -> bool:
    return any(d.get("taints") for d in (slice_obj.get("spec") or {}).get("devices") or [])


def taints_dropped(written: Obj, stored: Obj) -> bool:
    """Whether the server stored a slice we wrote with taints without any (pure)."""
    return _has_taints(written) and not _has_taints(stored)


async def api_server_keeps_taints(kube: Any, driver: str, node: str) -> bool:
    """One dry-run create. A refusal counts as "not kept" (the slice with taints would be refused
    too); other errors (the API server unreachable) are raised for the caller to retry."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from gpudra_core.kubeapi import is_status

    probe = probe_slice(driver, node)
    try:
        stored = await kube.create(probe, dry_run=True)
    except ApiException as error:
        if not is_status(error, 400, 403, 404, 422):
            raise
        return False
    return not taints_dropped(probe, stored)
