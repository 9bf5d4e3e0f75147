"""What the agents report about their nodes in Node Events, read back for the config's Degraded
condition: NVIDIA's device plugin on the node (the agent publishes nothing there), an API server
that drops counters (dynamic MIG falls back to static), GPUs that do not match their MIG mode.

Each report is a Warning and its all-clear (:mod:`gpudra_core.agentcontract`); a node has the
problem while its latest event of the pair is the Warning. The agents post on changes, and again
every 15 minutes while a problem lasts (Events expire after an hour), so one filtered LIST of a
driver's events is small; it is still reused for a while, because reconciles and status refreshes
come in bursts (a rollout) that would each repeat it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_core.agentcontract import (
    DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED, DYNAMIC_MIG_SUPPORTED, DYNAMIC_MIG_UNSUPPORTED, MIG_NOT_READY,
    MIG_READY, event_source)
from gpudra_core.kubeapi import EVENT_NAMESPACE, Kube, resource_type

from gpudra_operator.conditions import NodeProblem, named_nodes

EVENT = resource_type("v1", "Event")
REUSE_TTL = 10.0  # seconds a LIST that reconciles in a row would repeat is reused
MAX_MESSAGE_QUOTED = 600  # characters of one node's own message quoted in the condition


def nodes_with(events: Iterable[Mapping[str, Any]], warning: str, all_clear: str) -> dict[str, str]:
    """Node -> the message of its latest ``warning``, for the nodes whose latest event of the pair
    is ``warning`` (pure; the order of ``events`` does not matter)."""
    latest: dict[str, tuple[str, str, str]] = {}
    for event in events:
        reason = event.get("reason")
        if reason not in (warning, all_clear):
            continue
        node = (event.get("involvedObject") or {}).get("name") or ""
        when = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp") or ""
        if node and (node not in latest or when >= latest[node][0]):
            latest[node] = (when, reason, str(event.get("message") or ""))
    return {n: message for n, (_, reason, message) in sorted(latest.items()) if reason == warning}


@dataclass(frozen=True)
class AgentReports:
    device_plugin: Mapping[str, str]  # node -> message, for each report
    dynamic_mig_unsupported: Mapping[str, str]
    mig_not_ready: Mapping[str, str]

    @classmethod
    def of(cls, events: Sequence[Mapping[str, Any]]) -> AgentReports:
        return cls(device_plugin=nodes_with(events, DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED),
                   dynamic_mig_unsupported=nodes_with(events, DYNAMIC_MIG_UNSUPPORTED, DYNAMIC_MIG_SUPPORTED),
                   mig_not_ready=nodes_with(events, MIG_NOT_READY, MIG_READY))

    def mig_problems(self) -> list[NodeProblem]:
        """The MIG reports as Degraded's problems: the nodes, and the first one's own words (pure)."""
        problems = []
        for reason, nodes, what in (
                (DYNAMIC_MIG_UNSUPPORTED, self.dynamic_mig_unsupported,
                 "publish static MIG instead of dynamic: the API server drops counter sets (partitionable devices, "
                 "Kubernetes 1.36+)"),
                (MIG_NOT_READY, self.mig_not_ready, "have GPUs that do not match their MIG mode (docs/mig.md)")):
            if not nodes:
                continue
            first, message = next(iter(nodes.items()))
            if len(message) > MAX_MESSAGE_QUOTED:
                message = message[:MAX_MESSAGE_QUOTED] + "..."
            problems.append(NodeProblem(reason, f"{len(nodes)} node(s) ({named_nodes(list(nodes))}) {what}; "
                                                f"{first}: {message}"))
        return problems


class AgentEvents:
    """Each driver's :class:`AgentReports`, listed at most once per :data:`REUSE_TTL` seconds."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._listed: dict[str, tuple[float, AgentReports]] = {}  # driver -> (when, reports)

    async def reports(self, driver: str) -> AgentReports:
        listed, now = self._listed.get(driver), time.monotonic()
        if listed and now - listed[0] < REUSE_TTL:
            return listed[1]
        selector = f"source={event_source(driver)}"
        reports = AgentReports.of([e async for e in self.kube.list(EVENT, EVENT_NAMESPACE, field_selector=selector)])
        self._listed[driver] = (now, reports)
        return reports
