"""One node's kubelet, as far as DRA goes, for the chaos run: it registers with the node's agent
through its registration socket (again whenever the socket is made anew, as the kubelet's plugin
watcher does), prepares a pod's claims through the agent's gRPC API before it reports the pod
Running, unprepares them before it confirms the pod's deletion (once no other pod of the node uses
them), and starts pods without claims (the DaemonSets') at once.

It polls the API server (a LIST of its node's pods every ``interval``) instead of watching: under
chaos the API server and etcd come and go, and a poll needs no resume logic. It keeps nothing
across a restart: a new instance re-prepares the claims of the pods it finds Running (prepare is
idempotent), as a kubelet that lost its state would."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpudra_core.kubeapi import Kube, Obj, is_status, resource_type
from gpudra_dev.kubelet_client import DraClient, register
from gpudra_dev.localcluster.kubelet_sim import running_status

POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
log = logging.getLogger(__name__)


@dataclass
class KubeletStats:
    """Counts over every instance of one node's kubelet (a restart keeps them)."""
    registrations: int = 0
    prepared: int = 0  # claims NodePrepareResources reported prepared (again for each pod, each restart)
    prepare_errors: int = 0
    unprepared: int = 0  # claims NodeUnprepareResources reported unprepared
    unprepare_errors: int = 0
    claims_prepared: set[str] = field(default_factory=set)  # their UIDs
    claims_unprepared: set[str] = field(default_factory=set)
    started: int = 0  # pods with claims reported Running
    confirmed_deletions: int = 0
    problems: list[str] = field(default_factory=list)  # what no kubelet may see (an invariant broken)


def claim_names(pod: Obj) -> list[str] | None:
    """The names of the ResourceClaims ``pod`` uses; None while one made from a template has no
    name yet (the resourceclaim controller has not created it)."""
    generated = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    names = []
    for entry in pod["spec"].get("resourceClaims") or []:
        name = entry.get("resourceClaimName") or generated.get(entry["name"])
        if not name:
            return None
        names.append(name)
    return names


def allocated_devices(claim: Obj, driver: str) -> set[tuple[str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {(r["pool"], r["device"]) for r in results if r["driver"] == driver}


def reserved_for(claim: Obj, pod_uid: str) -> bool:
    return any(r.get("uid") == pod_uid for r in (claim.get("status") or {}).get("reservedFor") or [])


class NodeKubelet:
    def __init__(self, kube: Kube, node: str, *, driver: str, registration_socket: Path, cdi_dir: Path,
                 stats: KubeletStats, on_running: Callable[[Obj], None], interval: float = 0.5) -> None:
        self.kube, self.node, self.driver = kube, node, driver
        self.registration_socket, self.cdi_dir = registration_socket, cdi_dir
        self.stats, self.on_running, self.interval = stats, on_running, interval
        self._client: DraClient | None = None
        self._socket_id: tuple[int, int] | None = None  # (inode, ctime) of the socket registered with
        self._prepared_pods: set[str] = set()  # pods whose claims this instance prepared
        self._started_pods: set[str] = set()  # ... and whose start it reported

    async def run(self) -> None:
        """Sync every ``interval`` until cancelled (a kubelet restart cancels it)."""
        try:
            while True:
                try:
                    await self._sync()
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # the API server or the agent away: the next sync retries
                    log.debug("kubelet %s: sync failed: %s", self.node, error)
                await asyncio.sleep(self.interval)
        finally:
            await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client, self._socket_id = self._client, None, None
        if client is not None:
            await client.close()

    def _current_socket(self) -> tuple[int, int] | None:
        try:
            info = os.stat(self.registration_socket)
        except OSError:
            return None
        return info.st_ino, info.st_ctime_ns

    async def _dra(self) -> DraClient | None:
        """The agent's DRA client, registering first (again when the agent made a new socket)."""
        current = self._current_socket()
        if current is None:
            await self._drop_client()
            return None
        if self._client is not None and current == self._socket_id:
            return self._client
        await self._drop_client()
        registered = await register(self.registration_socket, driver=self.driver)
        self.stats.registrations += 1
        self._client, self._socket_id = DraClient(registered.endpoint, registered.version), current
        return self._client

    async def _sync(self) -> None:
        client = await self._dra()  # registers even while no pod needs it: the agent waits for it
        pods = [p async for p in self.kube.list(POD, field_selector=f"spec.nodeName={self.node}")]
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                await self._terminate(pod, pods, client)
            elif not pod["spec"].get("resourceClaims"):
                if (pod.get("status") or {}).get("phase") == "Pending":
                    await self._report_running(pod)
            elif pod["metadata"]["uid"] not in self._prepared_pods and client is not None:
                await self._prepare_and_start(pod, client)
            elif pod["metadata"]["uid"] in self._prepared_pods and pod["metadata"]["uid"] not in self._started_pods:
                await self._start(pod)  # prepared, but its report failed (the API server restarting): again

    async def _claims(self, pod: Obj) -> list[Obj] | None:
        names = claim_names(pod)
        if names is None:
            return None
        claims = []
        for name in names:
            claim = await self.kube.get(CLAIM, name, pod["metadata"]["namespace"])
            if claim is None:
                return None
            claims.append(claim)
        return claims

    async def _prepare_and_start(self, pod: Obj, client: DraClient) -> None:
        meta = pod["metadata"]
        claims = await self._claims(pod)
        # The kubelet prepares a claim only once it is allocated and reserved for the pod.
        if claims is None or not all(allocated_devices(c, self.driver) and reserved_for(c, meta["uid"]) for c in claims):
            return
        refs = [(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
        try:
            response = await client.prepare(refs)
        except grpc.aio.AioRpcError as error:
            self.stats.prepare_errors += 1
            log.info("kubelet %s: NodePrepareResources for %s/%s: %s", self.node, meta["namespace"], meta["name"],
                     error.code())
            await self._drop_client()  # the agent may have restarted: register again
            return
        for claim in claims:
            uid = claim["metadata"]["uid"]
            result = response.claims.get(uid)
            if result is None or result.error:
                self.stats.prepare_errors += 1
                log.info("kubelet %s: prepare of %s: %s", self.node, claim["metadata"]["name"],
                         result.error if result else "no answer")
                return
            got = {(d.pool_name, d.device_name) for d in result.devices}
            want = allocated_devices(claim, self.driver)
            if got != want:
                self.stats.problems.append(f"{self.node}: claim {claim['metadata']['name']} ({uid}) prepared "
                                           f"{sorted(got)}, allocated {sorted(want)}")
            if not (self.cdi_dir / f"k8s.{self.driver}-claim_{uid}.json").is_file():
                self.stats.problems.append(f"{self.node}: claim {claim['metadata']['name']} ({uid}) prepared "
                                           "without its CDI spec")
        self.stats.prepared += len(claims)
        self.stats.claims_prepared.update(c["metadata"]["uid"] for c in claims)
        self._prepared_pods.add(meta["uid"])
        await self._start(pod)

    async def _start(self, pod: Obj) -> None:
        """Report a prepared pod Running; raises while the API server cannot take it (the next sync
        tries again: the pod's claims stay prepared)."""
        if (pod.get("status") or {}).get("phase") == "Pending":
            await self._report_running(pod)
            self.stats.started += 1
        self._started_pods.add(pod["metadata"]["uid"])
        self.on_running(pod)

    async def _report_running(self, pod: Obj) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = pod["metadata"]
        try:
            await self.kube.patch(POD, meta["name"], running_status(pod, now), namespace=meta["namespace"],
                                  subresource="status")
        except Exception as error:
            if not is_status(error, 404, 409):
                raise

    async def _terminate(self, pod: Obj, pods: list[Obj], client: DraClient | None) -> None:
        """Unprepare what only this pod used, then confirm the deletion (grace period 0)."""
        meta = pod["metadata"]
        if pod["spec"].get("resourceClaims"):
            if client is None:
                return  # the agent is away: the pod waits, as its claims stay prepared
            names = claim_names(pod) or []
            in_use = {name for other in pods if other is not pod and not other["metadata"].get("deletionTimestamp")
                      for name in claim_names(other) or []}
            refs = []
            for name in names:
                if name in in_use:
                    continue
                claim = await self.kube.get(CLAIM, name, meta["namespace"])
                if claim is not None:
                    refs.append((meta["namespace"], name, claim["metadata"]["uid"]))
            if refs:
                try:
                    response = await client.unprepare(refs)
                except grpc.aio.AioRpcError as error:
                    self.stats.unprepare_errors += 1
                    log.info("kubelet %s: NodeUnprepareResources: %s", self.node, error.code())
                    await self._drop_client()
                    return
                errors = [r.error for r in response.claims.values() if r.error]
                if errors:
                    self.stats.unprepare_errors += 1
                    log.info("kubelet %s: unprepare: %s", self.node, "; ".join(errors))
                    return
                self.stats.unprepared += len(refs)
                self.stats.claims_unprepared.update(uid for _, _, uid in refs)
        try:
            await self.kube.delete(POD, meta["name"], meta["namespace"], grace_period_seconds=0, uid=meta["uid"])
            self.stats.confirmed_deletions += 1
        except Exception as error:
            if not is_status(error, 404, 409):
                raise
        self._prepared_pods.discard(meta["uid"])
        self._started_pods.discard(meta["uid"])
