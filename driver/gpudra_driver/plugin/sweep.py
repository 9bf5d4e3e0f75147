"""Prepared claims whose unprepare never came: found by asking the API server, and released.

The kubelet unprepares a claim when its last pod is gone. That call is lost when the kubelet's
own state is lost, or when a claim is deleted while its node is away. The checkpoint then keeps
the claim prepared (or adopted: its spec kept when a corrupt checkpoint was set aside), and its GPU stays refused ("already prepared for claim X") on this node,
while the scheduler, which sees the claim gone, allocates the GPU again and the new pod hangs in
ContainerCreating. So, at start and every ``interval`` seconds (NVIDIA's driver has the same
cleanup), each prepared claim, and each adopted one whose name is known, is looked up by
namespace/name (:meth:`.state.DeviceState.held_claims`):

* gone (404), or re-created (another UID): leaked;
* no longer allocated any device of ours on this node: leaked;
* anything else, a failed GET included: kept (only evidence releases a claim).

A claim is released only when two sweeps in a row found it leaked (an interval apart: the kubelet's
own unprepare, which follows a pod's teardown, normally comes first; a claim deallocated and
allocated again on this node in between is seen allocated by the second look). Leaked claims are
unprepared through the same path as the kubelet's calls (node lock, spec and checkpoint entry
removed), with a Node event and ``gpudra_agent_leaked_claims_released_total``.
The GETs are spaced at ``rate`` per second, so a node with many claims never bursts.
:func:`leak_reason` is the pure decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_driver.plugin.model import ClaimRef, PreparedClaim

log = logging.getLogger("gpudra.agent")

GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]
Unprepare = Callable[[Sequence[ClaimRef]], Awaitable[Mapping[str, str | None]]]
Report = Callable[[str, str, str], Awaitable[None]]
Seen = Callable[[ClaimRef, Mapping[str, Any] | None], None]
DEFAULT_INTERVAL = 300.0


@dataclass(frozen=True)
class HeldClaim:
    """A claim this node holds devices for, prepared or adopted: what the sweep looks up."""

    ref: ClaimRef
    devices: tuple[tuple[str, str], ...]  # (pool, device)

    @property
    def uid(self) -> str:
        return self.ref.uid

    @classmethod
    def of(cls, claim: PreparedClaim) -> HeldClaim:
        return cls(claim.ref, tuple((d.pool, d.device) for d in claim.devices))


def leak_reason(prepared: HeldClaim, live: Mapping[str, Any] | None, *, driver: str, node: str) -> str | None:
    """Why ``prepared`` is leaked given the API server's ``live`` claim (None: not found), or None
    when it is still this node's to hold."""
    if live is None:
        return "deleted"
    if (live.get("metadata") or {}).get("uid") != prepared.uid:
        return f"deleted and re-created (now UID {(live.get('metadata') or {}).get('uid')})"
    allocation = (live.get("status") or {}).get("allocation") or {}
    ours = {(r.get("pool"), r.get("device")) for r in (allocation.get("devices") or {}).get("results") or []
            if r.get("driver") == driver and r.get("pool") == node}
    if not ours & set(prepared.devices) and prepared.devices:
        return "no longer allocated any of its devices on this node"
    return None


class LeakSweeper:
    def __init__(self, *, prepared: Callable[[], Sequence[HeldClaim]], get_claim: GetClaim,
                 unprepare: Unprepare, driver: str, node: str, report: Report | None = None,
                 interval: float = DEFAULT_INTERVAL, rate: float = 10.0, seen: Seen | None = None) -> None:
        """``seen``: told each claim as the API server returned it (the claim reporter's view)."""
        self.prepared, self.get_claim, self.unprepare = prepared, get_claim, unprepare
        self.driver, self.node, self.report, self.seen = driver, node, report, seen
        self.interval, self.rate = interval, rate
        self._suspects: set[str] = set()  # UIDs the previous sweep found leaked

    async def run(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the next sweep tries again
                log.warning("checkpoint sweep failed: %r", error)
            await asyncio.sleep(self.interval)  # the sweep period itself, not a synchronisation

    async def sweep_once(self) -> list[str]:
        """Release the leaked claims; returns their UIDs."""
        leaked: list[tuple[HeldClaim, str]] = []
        for index, claim in enumerate(self.prepared()):
            if index:
                await asyncio.sleep(1 / self.rate)  # the rate limit of the GETs
            try:
                live = await self.get_claim(claim.ref.namespace, claim.ref.name)
            except Exception as error:  # noqa: BLE001 - no evidence: keep it
                log.debug("checkpoint sweep: %s: %r", claim.ref, error)
                continue
            if self.seen is not None:
                self.seen(claim.ref, live)
            reason = leak_reason(claim, live, driver=self.driver, node=self.node)
            if reason is not None:
                leaked.append((claim, reason))
        suspects, self._suspects = self._suspects, {claim.uid for claim, _ in leaked}
        leaked = [(claim, reason) for claim, reason in leaked if claim.uid in suspects]  # the second look
        if not leaked:
            return []
        self._suspects -= {claim.uid for claim, _ in leaked}
        results = await self.unprepare([claim.ref for claim, _ in leaked])
        released = []
        for claim, reason in leaked:
            failure = results.get(claim.uid)
            if failure:
                log.warning("checkpoint sweep: releasing %s failed: %s", claim.ref, failure)
                continue
            released.append(claim.uid)
            devices = ", ".join(device for _, device in claim.devices) or "none"
            message = (f"released {claim.ref} ({reason}): its unprepare never came; device(s) {devices} "
                       "can be prepared again")
            log.warning("checkpoint sweep: %s", message)
            from gpudra_driver import metrics

            metrics.LEAKED_CLAIMS_RELEASED.inc()
            if self.report is not None:
                await self.report("Warning", "LeakedClaimReleased", message)
        return released
