"""kopf handlers: thin triggers for the one reconcile in :mod:`gpudra_operator.reconcile`.

create, update and resume run the same idempotent reconcile; a timer repairs drift; events on
our own DaemonSets and DeviceClasses (selected by our managed-by label) repair a hand edit or a
deletion at once and refresh agent status; the finalizer removes children in a safe order."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_driver.kubeapi import Kube, connect, error_message, resource_type

from . import metrics
from .events import EventRecorder
from .reconcile import CONFIG, DAEMONSET, DEVICE_CLASS, SLICE, Reconciler
from .slicegc import DEFAULT_DELETE_RATE, SliceCollector, gc_tick
from .render import (AGENT_NAME, LABEL_CONFIG, LABEL_MANAGED_BY, MANAGED_BY, agent_selector, child_selector,
                     configured_agent_image)
from .spec import GpuDraConfig

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
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    # HTTPS_PROXY/NO_PROXY for kopf's own client too, as for ours (kubeapi.read_environment_once)
    # and client-go; kopf's few requests can afford aiohttp's per-request lookups.
    settings.networking.trust_env = True
    settings.execution.max_workers = 4
    api = await connect(os.environ.get("KUBECONFIG"))
    memo.api = api
    memo.kube = Kube(api, FIELD_MANAGER)
    memo.reconciler = Reconciler(memo.kube, EventRecorder(memo.kube), agent_image=configured_agent_image())
    logging.getLogger(__name__).info("agent image where spec.agent.image is unset: %s",
                                     memo.reconciler.agent_image)
    memo.slice_gc = SliceCollector(memo.kube, memo.reconciler.events, delete_rate=GC_DELETE_RATE)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.api.close()


async def _reconcile(memo: kopf.Memo, body: kopf.Body) -> None:
    try:
        await memo.reconciler.reconcile(dict(body))
    except ApiException as error:  # transient API trouble: kopf retries with backoff
        raise kopf.TemporaryError(f"API error: {error_message(error)}", delay=5) from error


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, body)  # returns None: nothing leaks into status


@kopf.timer(GROUP, VERSION, PLURAL, interval=DRIFT_INTERVAL, initial_delay=DRIFT_INTERVAL)
async def repair_drift(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, body)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def collect_stale_slices(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """The ResourceSlice GC of one config (docs/gc.md). A daemon per config, because the interval
    lives in the spec: it wakes every tick, reads the live body, and runs a pass once
    spec.resourceSliceGC.interval has passed since the last one. kopf stops it when the config is
    being deleted; from there the finalizer (``cleanup``) owns the driver's slices."""
    gc: SliceCollector = memo.slice_gc
    tick = gc_tick()
    try:
        while not stopped:
            due_in = gc.seconds_until_due(body)
            if due_in > 0:
                await stopped.wait(min(due_in, tick))
                continue
            try:
                result = await gc.run_pass(dict(body))
                if result is None:  # disabled or not ready: look again next tick
                    await stopped.wait(tick)
                else:
                    metrics.record_gc_pass(result.found, len(result.deleted))
            except Exception as error:  # never let one bad pass end the loop; the next interval retries
                log.exception("ResourceSlice GC pass of GpuDraConfig %s failed: %s", body["metadata"]["name"], error)
                await stopped.wait(tick)
    finally:
        gc.forget(body["metadata"]["name"])


@kopf.on.event("apps", "v1", "daemonsets", labels=OWNED)
@kopf.on.event("resource.k8s.io", "v1", "deviceclasses", labels=OWNED)
async def child_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    """A child was edited or deleted (its owner is reconciled now), or its status moved (the
    owner's status follows)."""
    owner = (body.get("metadata", {}).get("labels") or {}).get(LABEL_CONFIG)
    if owner:
        try:
            await memo.reconciler.on_child_event(owner, type, dict(body))
        except ApiException as error:
            log.warning("reconcile of GpuDraConfig %s after a child event failed: %s", owner, error_message(error))


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def cleanup(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Remove children in a safe order: DeviceClasses (no new allocations), then the agents,
    then — once no agent can republish them — the driver's ResourceSlices."""
    kube: Kube = memo.kube
    config = GpuDraConfig.from_body(body)
    metrics.forget_config(config.name)
    async with memo.reconciler.lock(config.name):
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
