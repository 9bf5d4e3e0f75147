"""Plays the kubelet's pod-status part for fake Nodes, so DaemonSet and Job status move as on a
real cluster: pods bound to a fake Node become Running and Ready, and pods being deleted there
are confirmed (the kubelet's job; without it a graceful delete never finishes).

It never runs containers and never touches pods on Nodes without the fake-node label."""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, is_status, resource_type

from .objects import FAKE_NODE_LABEL

POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
log = logging.getLogger(__name__)


def running_status(pod: Obj, now: str) -> dict[str, Any]:
    """The status a kubelet reports for a started pod whose containers are all ready."""
    containers = pod["spec"].get("containers") or []
    ready = [{"type": t, "status": "True", "lastTransitionTime": now}
             for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")]
    return {"status": {
        "phase": "Running", "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "startTime": now,
        "conditions": ready,
        "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "",
                               "ready": True, "started": True, "restartCount": 0,
                               "state": {"running": {"startedAt": now}}} for c in containers],
    }}


class KubeletSimulator:
    """``hold_claims``: leave pods that use ResourceClaims Pending, for a caller that prepares
    their claims through the node's DRA plugin first (as a kubelet does) and then calls
    :meth:`start_pod`."""

    def __init__(self, kube: Kube, *, hold_claims: bool = False) -> None:
        self.kube = kube
        self.hold_claims = hold_claims
        self._fake_nodes: set[str] = set()

    async def start_pod(self, pod: Obj) -> None:
        """Report ``pod`` Running and Ready, as its kubelet does once its containers started."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = pod["metadata"]
        await self.kube.patch(POD, meta["name"], running_status(pod, now), namespace=meta["namespace"],
                              subresource="status")

    async def _refresh_nodes(self) -> None:
        self._fake_nodes = {n["metadata"]["name"] async for n in
                            self.kube.list(NODE, label_selector=f"{FAKE_NODE_LABEL}=true")}

    async def _handle(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        node = spec.get("nodeName")
        if not node:
            return
        if node not in self._fake_nodes:
            await self._refresh_nodes()
            if node not in self._fake_nodes:
                return
        try:
            if meta.get("deletionTimestamp"):
                await self.kube.delete(POD, meta["name"], meta["namespace"], grace_period_seconds=0,
                                       uid=meta["uid"])
            elif (pod.get("status") or {}).get("phase") == "Pending":
                if self.hold_claims and spec.get("resourceClaims"):
                    return  # the kubelet prepares claims before it starts containers
                await self.start_pod(pod)
        except Exception as error:  # a pod gone or changed meanwhile is the next event's business
            if not is_status(error, 404, 409):
                log.warning("kubelet simulator: pod %s/%s: %s", meta["namespace"], meta["name"], error)

    async def run(self) -> None:
        """List, then watch, forever (relisting on expiry); cancel the task to stop."""
        while True:
            await self._refresh_nodes()
            page = await self.kube.request("GET", POD.path())
            for pod in page.get("items") or []:
                await self._handle(pod)
            version = page["metadata"]["resourceVersion"]
            try:
                async for kind, pod in self.kube.watch(POD, resource_version=version, timeout_seconds=240):
                    if kind in ("ADDED", "MODIFIED"):
                        await self._handle(pod)
                    elif kind == "ERROR":
                        break
            except (asyncio.TimeoutError, ConnectionError) as error:
                log.info("kubelet simulator: watch ended (%s); relisting", error)
