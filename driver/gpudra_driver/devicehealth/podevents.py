"""Telling the pods that hold a device when it turns unhealthy or recovers (issue: "an Event on the
Node, and on pods holding the device").

The pods come from the claims this node prepared (the checkpoint) that hold the device, and, for
each, the claim's ``status.reservedFor`` (the pods the scheduler reserved it for), read with the one
GET per claim the agent already may do. Best effort, like every Event: a claim that cannot be read is
logged, and the Node event says it anyway. The agent may create Events in every namespace for this
(manifests/base/agent-rbac.yaml), and nothing else there."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from gpudra_driver.devicehealth.plan import Transition
from gpudra_driver.plugin.model import PreparedClaim

log = logging.getLogger("gpudra.agent.health")

GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]
PostOnPod = Callable[[str, str, str, str, str, str], Awaitable[None]]  # ns, name, uid, type, reason, message


def holders(device: str, claims: Sequence[PreparedClaim]) -> list[PreparedClaim]:
    """The prepared claims that hold ``device`` (a device name of this node's pool)."""
    return [c for c in claims if any(d.device == device for d in c.devices)]


def reserved_pods(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, uid) of each pod the claim is reserved for."""
    return [(str(r.get("name")), str(r.get("uid"))) for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods" and not r.get("apiGroup") and r.get("name")]


class PodNotifier:
    def __init__(self, claims: Callable[[], Sequence[PreparedClaim]], get_claim: GetClaim, post: PostOnPod) -> None:
        self.claims, self.get_claim, self.post = claims, get_claim, post

    async def __call__(self, change: Transition) -> None:
        kind, reason = ("Warning", "DeviceUnhealthy") if change.unhealthy else ("Normal", "DeviceRecovered")
        for claim in holders(change.device, self.claims()):
            try:
                live = await self.get_claim(claim.ref.namespace, claim.ref.name)
            except Exception as error:  # noqa: BLE001 - best effort: the Node event has it
                log.warning("device health: cannot read %s to tell its pods: %r", claim.ref, error)
                continue
            if live is None or (live.get("metadata") or {}).get("uid") != claim.uid:
                continue
            for name, uid in reserved_pods(live):
                await self.post(claim.ref.namespace, name, uid, kind, reason,
                                f"ResourceClaim {claim.ref.name}: {change.message}")
