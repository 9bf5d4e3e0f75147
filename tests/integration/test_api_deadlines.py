"""Every API call has a deadline: real components (the agent's publisher, a reconcile, a GC pass,
the leader election), in process, reach the session's real API server through a loopback proxy
(localcluster.tcpproxy) that is switched to a black hole: what a load balancer that forgot its
connections does. Every open connection goes silent for good, new ones are accepted and never
answered; after ``restore()`` only new connections get through, so a component recovers only once
its deadlines have made it give the silent ones up.

Each test black-holes the API server while a call is in flight, sees the call fail at its deadline
(without one it waits forever: the test fails at its own deadline), restores the network, and
sees the next change reach the API server within the deadline plus a margin. The deadlines are
shortened (kubeapi.Deadlines: 1 s connect, 2 s per request, 5 s per watch); the product's are
10 s, 30 s and 300 s. Printed: the measured recovery times."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_core.kubeapi import NETWORK_ERRORS, Deadlines, Kube, Obj, connect, resource_type
from gpudra_driver.publishing.apply import SlicePublisher
from gpudra_operator.events import EventRecorder
from gpudra_operator.leaderelection import LEASE, Fence, LeaseElector, Timing
from gpudra_dev.localcluster.controlplane import HOST, ControlPlane
from gpudra_dev.localcluster.objects import fake_slice
from gpudra_dev.localcluster.tcpproxy import TcpProxy
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.slicegc.apply import SliceCollector

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DEADLINES = Deadlines(connect=1.0, request=2.0, watch=5, watch_silence=1.0)
MARGIN = 3.0  # seconds for retries' backoff and the work itself, on a busy 2-core machine
T = TypeVar("T")


@pytest_asyncio.fixture(loop_scope="session")
async def proxy(cluster: ControlPlane) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(HOST, cluster.apiserver_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@pytest_asyncio.fixture(loop_scope="session")
async def through_proxy(cluster: ControlPlane, proxy: TcpProxy, tmp_path: Path) -> AsyncIterator[Callable[[str], Kube]]:
    """Clients (one per field manager) that reach the API server only through the proxy."""
    kubeconfig = cluster.user_kubeconfig(tmp_path / "proxied.kubeconfig", "gpudra-deadlines",
                                         server=f"https://{HOST}:{proxy.port}")
    api = await connect(str(kubeconfig))
    try:
        yield lambda field_manager: Kube(api, field_manager, DEADLINES)
    finally:
        await api.close()


async def fails_within(seconds: float, call: Awaitable[Any], what: str) -> float:
    """Seconds until ``call`` failed with a network error; a test failure if it had not by ``seconds``."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(seconds):
            await call
    except TimeoutError as error:
        if time.monotonic() - started >= seconds:
            raise AssertionError(f"{what} still waiting after {seconds:.1f}s: no deadline") from error
    except NETWORK_ERRORS:
        pass
    else:
        raise AssertionError(f"{what} succeeded through a black hole")
    return time.monotonic() - started


async def until_it_succeeds(call: Callable[[], Awaitable[T]], timeout: float, what: str) -> T:
    """``call()`` again after each network error (what kopf's retry of a failed handler does),
    until it succeeds; a test failure after ``timeout``."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await call()
            except NETWORK_ERRORS:
                continue
    raise AssertionError(f"{what}: unreachable")  # pragma: no cover


def gpu(index: int, memory_gib: int) -> Device:
    return Device(f"gpu-{index}", {"type": AttrValue.of_string("gpu"), "index": AttrValue.of_int(index)},
                  {"memory": memory_gib * 2**30})


async def test_the_publisher_gives_up_a_silent_connection_and_publishes_the_next_change(
        kube: Kube, through_proxy: Callable[[str], Kube], proxy: TcpProxy, fake_nodes: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpudra_driver.publishing.apply")
    node = (await fake_nodes("deadline"))["metadata"]["name"]
    driver = f"dl{secrets.token_hex(3)}.gpudra.io"
    selector = f"spec.driver={driver},spec.nodeName={node}"
    publisher = SlicePublisher(through_proxy("gpudra-agent"), driver, node)
    running = asyncio.create_task(publisher.run())

    async def published(memory: int) -> Obj | None:
        slices = [s async for s in kube.list(SLICE, field_selector=selector)]
        return next((s for s in slices if s["spec"]["devices"][0]["capacity"]["memory"]["value"] == f"{memory}Gi"),
                    None)

    try:
        publisher.set_devices([gpu(0, 80)])
        await wait_for(lambda: published(80), timeout=30, what="the first publish")

        proxy.black_hole()
        publisher.set_devices([gpu(0, 40)])  # a change while the API server is out of reach

        async def gave_up() -> bool:
            return "publishing ResourceSlices failed (" in caplog.text

        await wait_for(gave_up, timeout=DEADLINES.request + MARGIN, what="the publisher's write to time out")
        proxy.restore()
        restored = time.monotonic()
        await wait_for(lambda: published(40), timeout=DEADLINES.request + MARGIN,
                       what="the change made in the black hole to be published")
        write_recovered = time.monotonic() - restored

        # Its watch was silent too: gone past timeoutSeconds + the silence allowed, it lists
        # and watches again, and a slice deleted behind its back is restored.
        stale = await published(40)
        assert stale is not None
        await kube.delete(SLICE, stale["metadata"]["name"])

        async def restored_slice() -> Obj | None:
            again = await published(40)
            return again if again and again["metadata"]["uid"] != stale["metadata"]["uid"] else None

        await wait_for(restored_slice, timeout=DEADLINES.watch + DEADLINES.watch_silence + MARGIN,
                       what="the deleted slice to be restored by a watch on a new connection")
        watch_recovered = time.monotonic() - restored
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        async for s in kube.list(SLICE, field_selector=selector):
            await kube.delete(SLICE, s["metadata"]["name"])
    print(f"\n[deadlines] publisher: change published {write_recovered:.2f}s after the network came back; "
          f"watch restored a deleted slice {watch_recovered:.2f}s after")


def config_body(name: str, agent_namespace: str, memory: str) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
            "spec": {"driverName": f"{name}.gpudra.io",
                     "agent": {"namespace": agent_namespace, "nodeSelector": {"gpudra-deadlines": "none"}},
                     "deviceClasses": [{"name": f"{name}.gpudra.io", "template": "min-memory",
                                        "parameters": {"memory": memory}}],
                     "resourceSliceGC": {"interval": "1h", "gracePeriod": "30s"}}}


@pytest_asyncio.fixture(loop_scope="session")
async def config(kube: Kube, crd_installed: Obj, namespace: str) -> AsyncIterator[str]:
    name = f"dl-{secrets.token_hex(3)}"
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    await kube.create(config_body(name, namespace, "64Gi"))
    try:
        yield name
    finally:
        await kube.delete(CONFIG, name)
        await kube.delete(DEVICE_CLASS, f"{name}.gpudra.io")


async def test_a_reconcile_in_a_black_hole_fails_at_its_deadline_and_releases_its_lock(
        kube: Kube, through_proxy: Callable[[str], Kube], proxy: TcpProxy, config: str, namespace: str) -> None:
    operator = through_proxy("gpudra-operator")
    reconciler = Reconciler(operator, EventRecorder(operator))
    await reconciler.reconcile(await kube.get(CONFIG, config))

    async def class_memory(memory: str) -> bool:
        live = await kube.get(DEVICE_CLASS, f"{config}.gpudra.io")
        return bool(live) and f'quantity("{memory}")' in live["spec"]["selectors"][0]["cel"]["expression"]

    assert await class_memory("64Gi")
    proxy.black_hole()
    await kube.patch(CONFIG, config, {"spec": config_body(config, namespace, "80Gi")["spec"]})
    body = await kube.get(CONFIG, config)
    failed = await fails_within(DEADLINES.request + MARGIN, reconciler.reconcile(body), "the reconcile")
    assert not reconciler.locks.lock(config).locked()  # the next trigger is not stuck behind it
    proxy.restore()
    restored = time.monotonic()
    await until_it_succeeds(lambda: reconciler.reconcile(body), timeout=DEADLINES.request + MARGIN,
                            what="the reconcile after the network came back")
    recovered = time.monotonic() - restored
    assert await class_memory("80Gi")
    print(f"\n[deadlines] reconcile: failed {failed:.2f}s into the black hole; the change applied "
          f"{recovered:.2f}s after the network came back")


async def test_a_gc_pass_in_a_black_hole_ends_at_its_deadline_and_the_next_one_collects(
        kube: Kube, through_proxy: Callable[[str], Kube], proxy: TcpProxy, config: str) -> None:
    created = await kube.get(CONFIG, config)
    assert created is not None
    await kube.patch(CONFIG, config, {"status": {"observedGeneration": created["metadata"]["generation"]}},
                     subresource="status")
    driver = f"{config}.gpudra.io"
    operator = through_proxy("gpudra-operator")
    collector = SliceCollector(operator, EventRecorder(operator))
    first = await collector.run_pass(await kube.get(CONFIG, config))  # nothing to collect yet
    assert first is not None and not first.condemned and not first.errors
    # A slice of a Node that is gone: the GC deletes it at the first pass that sees it.
    stale = await kube.create(fake_slice(f"gone-{secrets.token_hex(3)}", driver, f"gone-{secrets.token_hex(3)}"))
    try:
        proxy.black_hole()
        body = await kube.get(CONFIG, config)
        # Its lists fail at their deadline; then its status write too (still a black hole).
        failed = await fails_within(2 * DEADLINES.request + MARGIN, collector.run_pass(body), "the GC pass")
        proxy.restore()
        restored = time.monotonic()

        async def a_clean_pass() -> Any:
            result = await collector.run_pass(body)
            if result is None or result.errors:  # a list failed: the daemon runs another pass
                raise TimeoutError(result.errors if result else "no pass")
            return result

        result = await until_it_succeeds(a_clean_pass, timeout=DEADLINES.request + MARGIN,
                                         what="a GC pass after the network came back")
        recovered = time.monotonic() - restored
    finally:
        await kube.delete(SLICE, stale["metadata"]["name"])
    assert [v.slice.name for v in result.deleted] == [stale["metadata"]["name"]]
    print(f"\n[deadlines] GC: pass ended {failed:.2f}s into the black hole; the stale slice deleted "
          f"{recovered:.2f}s after the network came back")


async def test_the_lease_holder_rides_out_a_black_hole_shorter_than_its_renew_deadline(
        kube: Kube, through_proxy: Callable[[str], Kube], proxy: TcpProxy, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpudra.operator.election")
    timing = Timing()  # the product's: renew every 2 s, fenced 7 s after the last renewal began
    holder = LeaseElector(through_proxy("gpudra-operator"), namespace, "holder", timing)
    assert await holder.try_acquire_or_renew()
    fenced = threading.Event()
    fence = Fence(on_expiry=fenced.set)
    fence.start(holder.valid_until)
    renewing = asyncio.create_task(holder.keep_renewing(fence))

    async def renew_time() -> str:
        lease = await kube.get(LEASE, holder.name, namespace)
        assert lease is not None
        return str(lease["spec"]["renewTime"])

    try:
        renewed = await renew_time()

        async def renewed_again() -> str | None:
            now = await renew_time()
            return now if now != renewed else None

        renewed = await wait_for(renewed_again, timeout=timing.retry_period + MARGIN, what="a renewal")
        proxy.black_hole()  # just after a renewal: the next one, 2 s on, goes into the black hole
        cut = time.monotonic()

        async def a_renewal_failed() -> bool:
            return "attempt failed" in caplog.text

        await wait_for(a_renewal_failed, timeout=timing.retry_period + DEADLINES.request + MARGIN,
                       what="a renewal to fail at its deadline")
        assert await renew_time() == renewed  # nothing got through
        proxy.restore()
        restored = time.monotonic()
        await wait_for(renewed_again, timeout=timing.retry_period + MARGIN, what="a renewal after the black hole")
        recovered = time.monotonic() - restored
        assert not fenced.is_set()
        assert holder.leading and holder.holder == "holder"
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        fence.stop()
    print(f"\n[deadlines] leader election: renewed {recovered:.2f}s after a {restored - cut:.2f}s black hole "
          f"(renew deadline {timing.renew_deadline:g}s, not fenced)")


async def test_a_standby_in_a_black_hole_takes_a_released_lease_once_the_network_is_back(
        kube: Kube, through_proxy: Callable[[str], Kube], proxy: TcpProxy, namespace: str) -> None:
    timing = Timing()
    holder = LeaseElector(kube, namespace, "holder", timing)
    standby = LeaseElector(through_proxy("gpudra-operator"), namespace, "standby", timing)
    assert await holder.try_acquire_or_renew()
    stop = asyncio.Event()
    proxy.black_hole()
    standing_by = asyncio.create_task(standby.acquire_or_stop(stop))
    try:
        assert await holder.release()
        proxy.restore()
        restored = time.monotonic()
        async with asyncio.timeout(timing.renew_deadline + timing.retry_period + MARGIN):
            assert await standing_by
        took_over = time.monotonic() - restored
    finally:
        stop.set()
        await asyncio.gather(standing_by, return_exceptions=True)
    lease = await kube.get(LEASE, holder.name, namespace)
    assert lease is not None and lease["spec"]["holderIdentity"] == "standby"
    assert standby.leading
    print(f"\n[deadlines] leader election: the standby took the released Lease {took_over:.2f}s after the "
          "network came back")
