"""Two operator replicas (`gpudra operator` subprocesses, default leader-election settings) on a
control plane of this module's own, whose audit log tells them apart: each replica connects as a
user of its own. One is active (it holds the Lease; its metric and /healthz say so), the other
stands by and writes nothing. SIGKILL of the active one: the standby takes over and applies a
change made in the gap, each write once, with no Event posted twice and no condition flapping.
SIGTERM: the Lease is handed over at once. A partition longer than the Lease: the isolated
replica exits before the other one starts, and none of its requests arrives afterwards."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.leaderelection import LEASE, LEASE_NAME, LOST_LEASE_EXIT, Timing
from gpudra_dev.localcluster.audit import AuditLog, is_dry_run, received
from gpudra_dev.localcluster.controlplane import HOST, ControlPlane, find_binaries
from gpudra_dev.localcluster.objects import events_about, install_crd
from gpudra_dev.localcluster.replicas import Replica, Replicas
from gpudra_dev.localcluster.tcpproxy import TcpProxy
from gpudra_dev.localcluster.waiting import wait_for
from scrape import sample_value, scrape

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
LEASE_NAMESPACE = "gpudra-ha"
TIMING = Timing()  # what a deployment runs with
FAILOVER_TARGET = 15.0  # seconds from SIGKILL of the active replica to a change converged (issue 26)
HANDOVER_TARGET = 2.0  # seconds from SIGTERM to the standby holding the Lease


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(find_binaries(), tmp_path_factory.mktemp("ha-cluster"), audit_log=True)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def kube(plane: ControlPlane) -> AsyncIterator[Kube]:
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, "gpudra-tests")
    await install_crd(kube)
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LEASE_NAMESPACE}})
    try:
        yield kube
    finally:
        await api.close()


def leader_metric(replica: Replica) -> float | None:
    return sample_value(scrape(replica.metrics_port), "gpudra_leader_election_master_status", f'name="{LEASE_NAME}"')


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(plane: ControlPlane, kube: Kube, tmp_path: Path) -> AsyncIterator[Replicas]:
    await kube.delete(LEASE, LEASE_NAME, LEASE_NAMESPACE)  # each test starts with no holder
    replicas = Replicas(plane, kube, tmp_path, LEASE_NAMESPACE)
    try:
        yield replicas
    finally:
        replicas.stop_all()
        for replica in replicas.started:
            print(f"\n--- {replica.user} log tail ({replica.operator.log_path}) ---\n{replica.operator.log_tail(15)}")
        async for config in kube.list(CONFIG):
            await kube.delete(CONFIG, config["metadata"]["name"])


@pytest.fixture(scope="module")
def audit(plane: ControlPlane) -> AuditLog:
    return AuditLog(plane.audit_log_path)


def classes_of(name: str) -> list[str]:
    return [f"{name}-c{i}.gpudra.io" for i in range(3)]


def config_spec(name: str, memory: str) -> Obj:
    return {"driverName": f"{name}.gpudra.io",
            "agent": {"namespace": name, "nodeSelector": {"gpudra-ha": "none"}},
            "deviceClasses": [{"name": c, "template": "min-memory", "parameters": {"memory": memory}}
                              for c in classes_of(name)],
            # no GC pass inside a test: its status write would blur the count of the reconcile's
            "resourceSliceGC": {"interval": "1h"}}


def ready(config: Obj | None) -> Obj | None:
    return next((c for c in ((config or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)


def converged(kube: Kube, name: str, memory: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        live = await kube.get(CONFIG, name)
        condition = ready(live)
        if not live or not condition or condition["status"] != "True" \
                or live["status"].get("observedGeneration") != live["metadata"]["generation"]:
            return False
        classes = await asyncio.gather(*(kube.get(DEVICE_CLASS, c) for c in classes_of(name)))
        return all(c and f'quantity("{memory}")' in c["spec"]["selectors"][0]["cel"]["expression"] for c in classes)

    return probe


async def create_config(kube: Kube) -> str:
    name = f"ha-{secrets.token_hex(3)}"  # its agent namespace too
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "gpudra-agent", "namespace": name}})
    await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                       "spec": config_spec(name, "64Gi")})
    try:
        await wait_for(converged(kube, name, "64Gi"), timeout=30, what=f"GpuDraConfig {name} Ready")
    except AssertionError as error:
        raise AssertionError(f"{error}\nstatus: {((await kube.get(CONFIG, name)) or {}).get('status')}") from None

    # The Ready Event is posted just after the status write that the probe above saw: a test that
    # reads the Events now must find it there.
    async def ready_event() -> bool:
        return any(e["reason"] == "Ready" for e in await events_about(kube, name))

    await wait_for(ready_event, timeout=10, what=f"the Ready Event of GpuDraConfig {name}")
    return name


async def change(kube: Kube, name: str, memory: str) -> None:
    await kube.patch(CONFIG, name, {"spec": config_spec(name, memory)})


class StatusHistory:
    """Every version of a config's Ready condition from a watch, from now on."""

    def __init__(self, kube: Kube, name: str) -> None:
        self.kube, self.name = kube, name
        self.ready: list[Obj | None] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StatusHistory:
        live = await self.kube.get(CONFIG, self.name)
        assert live is not None
        self.ready.append(ready(live))
        self._task = asyncio.create_task(self._follow(live["metadata"]["resourceVersion"]))
        return self

    async def _follow(self, version: str) -> None:
        async for _, obj in self.kube.watch(CONFIG, field_selector=f"metadata.name={self.name}",
                                            resource_version=version):
            self.ready.append(ready(obj))

    async def __aexit__(self, *_: Any) -> None:
        assert self._task is not None
        self._task.cancel()

    def assert_steady(self) -> None:
        """Ready was True throughout, and never moved its lastTransitionTime."""
        assert all(r and r["status"] == "True" for r in self.ready), self.ready
        assert len({r["lastTransitionTime"] for r in self.ready if r}) == 1, self.ready


def writes_to(entries: list[Obj], resource: str, subresource: str = "") -> Counter[str]:
    """Non-dry-run writes to each object of ``resource`` (and ``subresource``)."""
    return Counter(e["objectRef"]["name"] for e in entries if not is_dry_run(e)
                   and e["objectRef"].get("resource") == resource and e["objectRef"].get("subresource", "") == subresource)


async def assert_events_posted_once(kube: Kube, name: str) -> list[Obj]:
    events = await events_about(kube, name)
    posted = Counter((e["reason"], e["message"]) for e in events)
    assert all(n == 1 for n in posted.values()), posted
    return events


# --- tests ----------------------------------------------------------------------------------------

async def test_one_replica_is_active_and_the_standby_writes_nothing(replicas: Replicas, kube: Kube,
                                                                    audit: AuditLog) -> None:
    audit.mark()
    active, standby = await replicas.pair()
    name = await create_config(kube)
    await change(kube, name, "80Gi")
    await wait_for(converged(kube, name, "80Gi"), timeout=30, what="the change applied")

    assert await replicas.holder() == active.identity
    assert (active.role(), standby.role()) == ("active", "standby")
    assert (leader_metric(active), leader_metric(standby)) == (1, 0)
    # The standby only read (and watched) the Lease; the active replica did the work.
    assert audit.writes(user=standby.user) == []
    assert {(e["verb"], e["objectRef"]["resource"]) for e in audit.entries(user=standby.user)} <= {
        ("get", "leases"), ("watch", "leases")}
    assert writes_to(audit.writes(user=active.user), "deviceclasses") == {c: 2 for c in classes_of(name)}
    await assert_events_posted_once(kube, name)


async def test_sigkill_the_active_replica_and_the_standby_applies_a_change_made_in_the_gap_once(
        replicas: Replicas, kube: Kube, audit: AuditLog) -> None:
    active, standby = await replicas.pair()
    name = await create_config(kube)
    events_before = await assert_events_posted_once(kube, name)
    async with StatusHistory(kube, name) as history:
        audit.mark()
        killed_at, killed = time.time(), time.monotonic()
        active.operator.process.send_signal(signal.SIGKILL)
        await change(kube, name, "80Gi")
        await wait_for(converged(kube, name, "80Gi"), timeout=TIMING.lease_duration + 30,
                       what="the change made while no replica was active to be applied")
        failover = time.monotonic() - killed
    assert await replicas.holder() == standby.identity
    print(f"\n[ha] SIGKILL -> change converged: {failover:.2f}s")
    assert failover <= FAILOVER_TARGET, f"failover took {failover:.2f}s"

    # Each write once: the three changed classes (a dry run and an apply each), one status
    # update, no DaemonSet write (it did not change), nothing from the dead replica.
    written = audit.writes(user=standby.user)
    assert writes_to(written, "deviceclasses") == {c: 1 for c in classes_of(name)}, written
    assert writes_to(written, "gpudraconfigs", "status") == {name: 1}, written
    assert writes_to(written, "daemonsets") == {}, written
    assert [e for e in audit.entries(user=active.user) if received(e) > killed_at + 0.001] == []
    history.assert_steady()
    assert await assert_events_posted_once(kube, name) == events_before


async def test_sigterm_hands_the_lease_over_at_once(replicas: Replicas, kube: Kube, audit: AuditLog) -> None:
    active, standby = await replicas.pair()
    name = await create_config(kube)
    # A change the active replica has just applied leaves work pending in it: the slices are
    # matched against the new classes after a debounce (devicecount.RECLASSIFY_AFTER, 2 s), then
    # status is refreshed. A graceful stop must drop it, not wait for it.
    await change(kube, name, "80Gi")
    await wait_for(converged(kube, name, "80Gi"), timeout=30, what="the change applied before SIGTERM")
    events_before = await assert_events_posted_once(kube, name)
    async with StatusHistory(kube, name) as history:
        audit.mark()
        stopped = time.monotonic()
        active.operator.process.send_signal(signal.SIGTERM)
        await change(kube, name, "96Gi")
        await replicas.wait_holder(standby, timeout=TIMING.lease_duration)
        handover = time.monotonic() - stopped
        await wait_for(converged(kube, name, "96Gi"), timeout=30, what="the change applied after the handover")
        converged_after = time.monotonic() - stopped
    assert active.operator.process.wait(timeout=10) == 0
    print(f"\n[ha] SIGTERM -> standby holds the Lease: {handover:.2f}s; -> change converged: {converged_after:.2f}s")
    assert handover < HANDOVER_TARGET, f"handover took {handover:.2f}s"
    # The work pending in the stopping replica was dropped, not left to run past its client's
    # close (it would fail there, after holding up the release for the rest of the debounce).
    assert "Session is closed" not in active.operator.log(), active.operator.log_tail()
    assert leader_metric(standby) == 1
    # Whoever applied the change (the stopping replica may have begun), each class was written once.
    written = audit.writes(user=standby.user) + audit.writes(user=active.user)
    assert writes_to(written, "deviceclasses") == {c: 1 for c in classes_of(name)}, written
    history.assert_steady()
    assert await assert_events_posted_once(kube, name) == events_before


async def test_a_partitioned_active_replica_exits_before_the_standby_takes_over(
        replicas: Replicas, kube: Kube, plane: ControlPlane, audit: AuditLog) -> None:
    proxy = TcpProxy(HOST, plane.apiserver_port)
    await proxy.start()
    try:
        active, standby = await replicas.pair(proxy=proxy)
        name = await create_config(kube)
        audit.mark()
        cut_at, cut = time.time(), time.monotonic()
        proxy.partition()

        async def exited() -> bool:
            return active.operator.process.poll() is not None

        await wait_for(exited, timeout=TIMING.renew_deadline + 5, what="the cut-off replica to fence itself")
        fenced = time.monotonic() - cut
        took_over = await replicas.wait_holder(standby, timeout=TIMING.lease_duration + 10) + fenced
        assert active.operator.process.returncode == LOST_LEASE_EXIT
        assert "could not be renewed in time" in active.operator.log()
        print(f"\n[ha] partition -> isolated replica exited: {fenced:.2f}s; -> standby holds the Lease: {took_over:.2f}s")
        # It stops within the renew deadline of its last renewal (which began before the cut),
        # before the standby may take over.
        assert fenced <= TIMING.renew_deadline + 1
        assert fenced < took_over
        await change(kube, name, "80Gi")
        await wait_for(converged(kube, name, "80Gi"), timeout=30, what="the change applied by the new holder")
    finally:
        await proxy.close()  # what the isolated replica had sent is dropped, as a partition drops it
    assert [e for e in audit.entries(user=active.user) if received(e) > cut_at] == []
    assert writes_to(audit.writes(user=standby.user), "deviceclasses") == {c: 1 for c in classes_of(name)}
