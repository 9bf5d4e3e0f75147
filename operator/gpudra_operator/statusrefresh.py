"""A config's status brought up to date between reconciles, from what its last reconcile decided.

Its agents' DaemonSet moves its status thousands of times in a rollout over a fleet, and its device
counts become known after the reconcile (a replica that just became active); neither changes what
the config wants. A refresh costs two GETs, and a PATCH when the numbers moved, where a reconcile
would read and compare every child."""

from __future__ import annotations

from gpudra_operator.configlocks import Coalesced
from gpudra_operator.reconcile import CONFIG, DAEMONSET, Reconciler
from gpudra_operator.spec import GpuDraConfig


class StatusRefresh:
    """Refreshes of each config's status, coalesced, under the config's lock."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self._refreshes = Coalesced(reconciler.locks)

    async def refresh_driver(self, driver: str) -> None:
        """Status again for the configs of ``driver`` (its device count has just become known)."""
        for name in self.reconciler.configs_of(driver):
            await self.refresh(name)

    async def refresh(self, name: str) -> None:
        """Status again from the DaemonSet as it is now (read here, so a queued event never takes
        status back to an older one); coalesced like child reconciles. A config that changed
        since its last reconcile, or whose last reconcile failed, is reconciled instead."""
        await self._refreshes.run(name, lambda: self._refresh(name))

    async def _refresh(self, name: str) -> None:
        kube = self.reconciler.kube
        body = await kube.get(CONFIG, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        last = self.reconciler.last(name)
        meta = body["metadata"]
        if last is None or (last.uid, last.generation) != (meta.get("uid"), meta.get("generation")):
            await self.reconciler.reconcile_current(name)
            return
        wanted = last.rendered.daemonset
        daemonset = None if wanted is None else await kube.get(
            DAEMONSET, wanted["metadata"]["name"], wanted["metadata"]["namespace"])
        await self.reconciler.report(body, GpuDraConfig.from_body(body), last.rendered, last.outcome, daemonset)
