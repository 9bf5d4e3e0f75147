"""kopf handlers: thin triggers for the one reconcile in :mod:`gpudra_operator.reconcile`.

create, update and resume run the same idempotent reconcile; a daemon repairs drift; events on
our own DaemonSets and DeviceClasses (selected by our managed-by label) repair a hand edit or a
deletion at once and refresh agent status; the finalizer removes children in a safe order."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import NETWORK_ERRORS, Deadlines, Kube, connect, error_message, resource_type

from . import metrics
from gpudra_operator.childevents import ChildEvents
from gpudra_operator.events import EventRecorder
from gpudra_operator.classcounts import ClaimWatch
from gpudra_operator.devicecount import SLICE, DeviceCounts
from gpudra_operator.reconcile import CONFIG, DAEMONSET, DEVICE_CLASS, Reconciler
from gpudra_operator.statusrefresh import StatusRefresh
from gpudra_operator.slicegc.apply import DEFAULT_DELETE_RATE, SliceCollector, gc_tick
from gpudra_operator.render import (AGENT_NAME, LABEL_CONFIG, LABEL_MANAGED_BY, MANAGED_BY, agent_selector, child_selector,
                     configured_agent_image)
from gpudra_operator.spec import GpuDraConfig

GROUP, VERSION, PLURAL = "gpudra.io", "v1alpha1", "gpudraconfigs"
FINALIZER = "gpudra.io/cleanup"
FIELD_MANAGER = "gpudra-operator"
DRIFT_INTERVAL = float(os.environ.get("GPUDRA_DRIFT_INTERVAL", "60"))
GC_DELETE_RATE = float(os.environ.get("GPUDRA_GC_DELETE_RATE", str(DEFAULT_DELETE_RATE)))
POD = resource_type("v1", "Pod")
OWNED = {LABEL_MANAGED_BY: MANAGED_BY}
log = logging.getLogger("gpudra.operator")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # Keep kopf's bookkeeping in our annotations, out of the schema'd status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="gpudra.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="gpudra.io", key="last-handled-configuration")
    settings.posting.enabled = False  # Events go where `kubectl describe gdc` sees them: events.py
    # kopf's own client under the same deadlines as ours (gpudra_core.kubeapi.Deadlines): each
    # request bounded, each watch ended by the server and, silent past that, by kopf.
    deadlines = Deadlines.from_environment()
    settings.networking.request_timeout = deadlines.request
    settings.networking.connect_timeout = deadlines.connect
    settings.watching.server_timeout = deadlines.watch
    settings.watching.client_timeout = deadlines.watch + deadlines.watch_silence
    settings.watching.connect_timeout = deadlines.connect
    # kopf's own bound on a watch without an event (bookmarks included; 70 s): kept, unless the
    # watch itself ends sooner (tests shorten it)
    settings.watching.inactivity_timeout = min(settings.watching.inactivity_timeout,
                                               deadlines.watch + deadlines.watch_silence)
    # HTTPS_PROXY/NO_PROXY for kopf's own client too, as for ours (kubeapi.read_environment_once)
    # and client-go; kopf's few requests can afford aiohttp's per-request lookups.
    settings.networking.trust_env = True
    settings.execution.max_workers = 4
    api = await connect(os.environ.get("KUBECONFIG"))
    # Set when the operator stops (operator_cmd passes it; a plain kopf run gets one never set).
    memo.setdefault("stopping", asyncio.Event())
    memo.api = api
    memo.kube = Kube(api, FIELD_MANAGER, deadlines)
    memo.device_counts = DeviceCounts(memo.kube, on_synced=lambda driver: memo.status_refresh.refresh_driver(driver))
    memo.claims = ClaimWatch(memo.kube)
    memo.reconciler = Reconciler(memo.kube, EventRecorder(memo.kube), agent_image=configured_agent_image(),
                                 device_counts=memo.device_counts, claims=memo.claims)
    memo.status_refresh = StatusRefresh(memo.reconciler)
    memo.child_events = ChildEvents(memo.reconciler, memo.status_refresh)
    logging.getLogger(__name__).info("agent image where spec.agent.image is unset: %s",
                                     memo.reconciler.agent_image)
    memo.slice_gc = SliceCollector(memo.kube, memo.reconciler.events, delete_rate=GC_DELETE_RATE)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    # Background work first (a pending status refresh, a child event being judged): it would
    # only fail on the closed client, and kopf would hold the Lease's release until it had.
    await memo.child_events.close()
    await memo.device_counts.close()
    await memo.claims.close()
    await memo.api.close()


async def _reconcile(memo: kopf.Memo, body: kopf.Body) -> None:
    try:
        await memo.reconciler.reconcile(dict(body))
    except ApiException as error:  # transient API trouble: kopf retries with backoff
        raise kopf.TemporaryError(f"API error: {error_message(error)}", delay=5) from error
    except NETWORK_ERRORS as error:  # a deadline passed, a connection dropped: the same, soon
        raise kopf.TemporaryError(f"API unreachable: {error!r}", delay=5) from error


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, body)  # returns None: nothing leaks into status


async def _idle(seconds: float, stopped: kopf.DaemonStopped, memo: kopf.Memo) -> bool:
    """Wait ``seconds``; False (the daemon returns) once kopf stops this daemon or the operator is
    stopping. kopf respawns a daemon on any event that arrives while the operator stops, and then
    waits for it before exiting; one that returns at once keeps the Lease's handover quick."""
    stopping: asyncio.Event = memo.stopping
    if not stopping.is_set():
        waits = {asyncio.ensure_future(stopped.wait(seconds)), asyncio.ensure_future(stopping.wait())}
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    return not stopped and not stopping.is_set()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def repair_drift(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Reconcile every DRIFT_INTERVAL seconds: what the child watches cannot see (a template
    whose output changed, a dropped field to try again)."""
    while await _idle(DRIFT_INTERVAL, stopped, memo):
        try:
            await memo.reconciler.reconcile(dict(body))
        except Exception as error:  # the next tick tries again
            log.warning("drift check of GpuDraConfig %s failed: %s", body["metadata"]["name"],
                        error_message(error) if isinstance(error, ApiException) else repr(error))
        else:
            log.info("GpuDraConfig %s: drift check done", body["metadata"]["name"])


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def collect_stale_slices(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """The ResourceSlice GC of one config (docs/gc.md). A daemon per config, because the interval
    lives in the spec: it wakes every tick, reads the live body, and runs a pass once
    spec.resourceSliceGC.interval has passed since the last one. kopf stops it when the config is
    being deleted; from there the finalizer (``cleanup``) owns the driver's slices."""
    gc: SliceCollector = memo.slice_gc
    tick = gc_tick()
    try:
        while not stopped and not memo.stopping.is_set():
            due_in = gc.seconds_until_due(body)
            if due_in > 0:
                await _idle(min(due_in, tick), stopped, memo)
                continue
            try:
                result = await gc.run_pass(dict(body))
                if result is None:  # disabled or not ready: look again next tick
                    await _idle(tick, stopped, memo)
                else:
                    metrics.record_gc_pass(result.found, len(result.deleted))
            except Exception as error:  # never let one bad pass end the loop; the next interval retries
                log.exception("ResourceSlice GC pass of GpuDraConfig %s failed: %s", body["metadata"]["name"], error)
                await _idle(tick, stopped, memo)
    finally:
        gc.forget(body["metadata"]["name"])


@kopf.on.event("apps", "v1", "daemonsets", labels=OWNED)
@kopf.on.event("resource.k8s.io", "v1", "deviceclasses", labels=OWNED)
async def child_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    """A child was edited or deleted (its owner is reconciled now), or its status moved (the
    owner's status follows); judged in the background, so that kopf's queue of events never
    backs up behind status refreshes (ChildEvents.on_event_soon)."""
    owner = (body.get("metadata", {}).get("labels") or {}).get(LABEL_CONFIG)
    if owner:
        memo.child_events.on_event_soon(owner, type, dict(body))


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def cleanup(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Remove children in a safe order: DeviceClasses (no new allocations), then the agents,
    then — once no agent can republish them — the driver's ResourceSlices."""
    kube: Kube = memo.kube
    config = GpuDraConfig.from_body(body)
    metrics.forget_config(config.name)
    memo.device_counts.forget(config.spec.driver_name)
    async with memo.reconciler.locks.lock(config.name):
        async for device_class in kube.list(DEVICE_CLASS, label_selector=child_selector(config.name)):
            await kube.delete(DEVICE_CLASS, device_class["metadata"]["name"])
        namespace = config.spec.agent.namespace
        daemonset = await kube.get(DAEMONSET, AGENT_NAME, namespace)
        if daemonset is not None and (daemonset["metadata"].get("labels") or {}).get(LABEL_CONFIG) == config.name:
            await kube.delete(DAEMONSET, AGENT_NAME, namespace, propagation="Foreground")
            raise kopf.TemporaryError("waiting for the agent DaemonSet and its pods to go", delay=2)
        selector = agent_selector(config.name)
        pods = [p async for p in kube.list(POD, namespace, label_selector=selector)]
        if pods:
            raise kopf.TemporaryError(f"waiting for {len(pods)} agent pod(s) to terminate", delay=2)
        others = [o async for o in kube.list(CONFIG)  # configs being deleted too do not keep the slices
                  if o["metadata"]["name"] != config.name and not o["metadata"].get("deletionTimestamp")]
        if any(GpuDraConfig.from_body(o).spec.driver_name == config.spec.driver_name for o in others):
            log.info("driver %s is still managed by another GpuDraConfig; its slices stay", config.spec.driver_name)
            return
        deleted = 0
        async for slice_ in kube.list(SLICE, field_selector=f"spec.driver={config.spec.driver_name}"):
            async with memo.slice_gc.limiter:  # the same delete rate limit as the GC's passes
                deleted += await kube.delete(SLICE, slice_["metadata"]["name"], uid=slice_["metadata"]["uid"])
        log.info("GpuDraConfig %s removed: its DeviceClasses, agents and %d ResourceSlice(s) are gone",
                 config.name, deleted)
