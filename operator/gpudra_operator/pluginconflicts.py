"""The nodes where a driver's agent publishes nothing because NVIDIA's device plugin advertises
nvidia.com/gpu there, as the agents' DevicePluginConflict[Resolved] Node events say.

The agents post those events on changes only, so one filtered LIST of a driver's is small; it is
still reused for a while, because reconciles and status refreshes come in bursts (a rollout) that
would each repeat it. Events expire after an hour, and an agent that still conflicts posts again
when it restarts."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from gpudra_core.agentcontract import DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED, event_source
from gpudra_core.kubeapi import EVENT_NAMESPACE, Kube, resource_type

EVENT = resource_type("v1", "Event")
REUSE_TTL = 10.0  # seconds a LIST that reconciles in a row would repeat is reused


def conflicting_nodes(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """The nodes whose latest DevicePluginConflict[Resolved] event is a conflict (pure)."""
    latest: dict[str, tuple[str, str]] = {}
    for event in events:
        if event.get("reason") not in (DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED):
            continue
        node = (event.get("involvedObject") or {}).get("name") or ""
        when = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp") or ""
        if node and (node not in latest or when >= latest[node][0]):
            latest[node] = (when, event["reason"])
    return sorted(n for n, (_, reason) in latest.items() if reason == DEVICE_PLUGIN_CONFLICT)


class PluginConflicts:
    """Each driver's conflicting nodes, listed at most once per :data:`REUSE_TTL` seconds."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._listed: dict[str, tuple[float, list[str]]] = {}  # driver -> (when, nodes)

    async def nodes(self, driver: str) -> list[str]:
        listed, now = self._listed.get(driver), time.monotonic()
        if listed and now - listed[0] < REUSE_TTL:
            return listed[1]
        selector = f"source={event_source(driver)}"
        nodes = conflicting_nodes([e async for e in self.kube.list(EVENT, EVENT_NAMESPACE, field_selector=selector)])
        self._listed[driver] = (now, nodes)
        return nodes
