"""kopf handlers: thin triggers for the one reconcile in :mod:`gpudra_operator.reconcile`.

create, update and resume run the same idempotent reconcile; every event on a config feeds its
periodic loops (drift repair, slice GC) and, once it is deleted, its teardown (configloops), which
need no finalizer; events on our own DaemonSets and DeviceClasses (selected by our managed-by
label) repair a hand edit or a deletion at once and refresh agent status."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import NETWORK_ERRORS, Deadlines, Kube, connect, error_message

from gpudra_operator.childevents import ChildEvents
from gpudra_operator.events import EventRecorder
from gpudra_operator.classcounts import ClaimWatch
from gpudra_operator.configloops import ConfigLoops
from gpudra_operator.devicecount import DeviceCounts
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.statusrefresh import StatusRefresh
from gpudra_operator.slicegc.apply import DEFAULT_DELETE_RATE, SliceCollector, gc_tick
from gpudra_operator.teardown import Teardown
from gpudra_operator.render import LABEL_CONFIG, LABEL_MANAGED_BY, MANAGED_BY, configured_agent_image

GROUP, VERSION, PLURAL = "gpudra.io", "v1alpha1", "gpudraconfigs"
FINALIZER = "gpudra.io/cleanup"
FIELD_MANAGER = "gpudra-operator"
DRIFT_INTERVAL = float(os.environ.get("GPUDRA_DRIFT_INTERVAL", "60"))
GC_DELETE_RATE = float(os.environ.get("GPUDRA_GC_DELETE_RATE", str(DEFAULT_DELETE_RATE)))
OWNED = {LABEL_MANAGED_BY: MANAGED_BY}
log = logging.getLogger("gpudra.operator")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # No handler needs a finalizer (configloops says why). kopf removes this one, which earlier
    # releases added, from the configs that still carry it.
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
    teardown = Teardown(memo.kube, memo.reconciler.locks, memo.slice_gc, forget_driver=memo.device_counts.forget)
    memo.config_loops = ConfigLoops(memo.reconciler, memo.slice_gc, teardown, drift_interval=DRIFT_INTERVAL,
                                    gc_tick=gc_tick(), stopping=memo.stopping)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    # Background work first (a pending status refresh, a child event being judged): it would
    # only fail on the closed client, and kopf would hold the Lease's release until it had.
    await memo.config_loops.close()
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


@kopf.on.event(GROUP, VERSION, PLURAL)
async def config_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    """Every event on a config (and each of the initial listing) keeps its periodic loops going
    with its newest body, and starts the teardown of one deleted (configloops; no finalizer)."""
    memo.config_loops.observe(type, dict(body))


@kopf.on.event("apps", "v1", "daemonsets", labels=OWNED)
@kopf.on.event("resource.k8s.io", "v1", "deviceclasses", labels=OWNED)
async def child_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    """A child was edited or deleted (its owner is reconciled now), or its status moved (the
    owner's status follows); judged in the background, so that kopf's queue of events never
    backs up behind status refreshes (ChildEvents.on_event_soon)."""
    owner = (body.get("metadata", {}).get("labels") or {}).get(LABEL_CONFIG)
    if owner:
        memo.child_events.on_event_soon(owner, type, dict(body))
