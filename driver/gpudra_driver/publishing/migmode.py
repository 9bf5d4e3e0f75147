"""The MIG mode this node's agent publishes by, kept current (I/O around :mod:`gpudra_core.migpolicy`).

* **The node's group.** Where the config has node groups with modes of their own, the agent reads
  its Node's labels, at start and again every ``node_recheck`` seconds, so a relabelled node changes
  mode without a restart. A failed read keeps the last answer.
* **Whether dynamic MIG can work here.** Dynamic mode needs an API server that keeps counter sets
  (partitionable devices; dropped without an error on 1.35). The agent asks it with one server-side
  dry run before the first dynamic scan, retried until the server answers. Where counters are
  dropped it publishes static MIG and posts ``DynamicMigUnsupported`` on its Node; it asks again
  every ``recheck`` seconds (a control plane upgraded to 1.36 needs no agent restart), reposting the
  Warning while it lasts, because Events expire and the config's Degraded condition reads them.
  Once counters are kept it says so with ``DynamicMigSupported``.
* **What a GPU's claims were given stays.** A GPU whose prepared claims hold instances the agent
  made keeps its dynamic placements whatever the mode now says (discovery's ``owned``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gpudra_core.agentcontract import DYNAMIC_MIG_SUPPORTED, DYNAMIC_MIG_UNSUPPORTED
from gpudra_core.kubeapi import error_message, resource_type
from gpudra_core.migpolicy import MigMode, MigPolicy, Resolved
from gpudra_driver.retrying import retrying

log = logging.getLogger("gpudra.agent")

NODE = resource_type("v1", "Node")
Report = Callable[[str, str, str], Awaitable[None]]
# (kept, why not) from the API server: gpudra_core.migpartitions.api_server_keeps_counters
CountersProbe = Callable[[], Awaitable[tuple[bool, str]]]
NODE_RECHECK = 300.0  # seconds between reads of the Node's labels, where a node group could apply (the agent: 5 rescans)
SUPPORT_RECHECK = 900.0  # seconds between asking again whether counters are kept, while they are not


class MigModeSource:
    def __init__(self, policy: MigPolicy, *, node_labels: Callable[[], Awaitable[Mapping[str, str] | None]],
                 counters_kept: CountersProbe, report: Report | None = None,
                 node_recheck: float = NODE_RECHECK, recheck: float = SUPPORT_RECHECK,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``node_labels``: the Node's labels (None: not readable now); ``counters_kept``: the
        dry-run probe, raising while the API server does not answer."""
        self.policy, self.node_labels, self.counters_kept, self.report = policy, node_labels, counters_kept, report
        self.node_recheck, self.recheck, self.clock = node_recheck, recheck, clock
        self.resolved: Resolved | None = None  # what the policy says for this node
        self._labels_read: float | None = None
        self.unsupported: str | None = None  # why the API server cannot take dynamic MIG, while so
        self._support_checked: float | None = None
        self.mode: MigMode | None = None  # what the last call answered

    async def current(self) -> MigMode:
        """The mode to scan with now."""
        resolved = await self._resolve()
        mode: MigMode = "static" if resolved.mode == "dynamic" and await self._counters_dropped() else resolved.mode
        if mode != self.mode:
            log.info("publishing MIG-capable GPUs by MIG mode %s (the config says %s)", mode, resolved)
            self.mode = mode
        return mode

    async def _resolve(self) -> Resolved:
        now = self.clock()
        if not self.policy.needs_node_labels:
            self.resolved = self.policy.for_labels({})
        elif self._labels_read is None or now - self._labels_read >= self.node_recheck:
            labels = await self.node_labels()
            if labels is not None:
                self._labels_read = now
                resolved = self.policy.for_labels(labels)
                if resolved != self.resolved:
                    log.info("MIG mode by node labels: %s", resolved)
                self.resolved = resolved
        return self.resolved or Resolved(self.policy.default)

    async def _counters_dropped(self) -> bool:
        """Whether the API server drops counter sets, asked when due. The first answer is waited
        for (retried until the server gives one): placements published to a server that drops
        counters would be plain devices the scheduler could allocate overlapping."""
        now = self.clock()
        first = self._support_checked is None
        if not first and (self.unsupported is None or now - self._support_checked < self.recheck):  # type: ignore[operator]
            return self.unsupported is not None
        answer: tuple[bool, str]
        try:
            if first:
                answer = await retrying(_say_retry)(self.counters_kept)
            else:
                answer = await self.counters_kept()
        except Exception as error:  # noqa: BLE001 - the last answer stands until the server gives another
            log.warning("checking partitionable devices again failed: %s", error_message(error))
            return self.unsupported is not None
        self._support_checked = now
        kept, why = answer
        if kept:
            if self.unsupported is not None:
                self.unsupported = None
                await self._post("Normal", DYNAMIC_MIG_SUPPORTED,
                                 "dynamic MIG: the API server keeps counter sets now; MIG-enabled GPUs are published "
                                 "as their placements")
            return False
        self.unsupported = (f"dynamic MIG is not used: {why}. MIG-enabled GPUs are published as the MIG devices that "
                            "exist (static MIG); upgrade to Kubernetes 1.36 or enable the gate on the API server and "
                            "scheduler")
        if first:
            log.error("%s", self.unsupported)
        await self._post("Warning", DYNAMIC_MIG_UNSUPPORTED, self.unsupported)  # again while it lasts: Events expire
        return True

    async def _post(self, kind: str, reason: str, message: str) -> None:
        if self.report is not None:
            await self.report(kind, reason, message)


def _say_retry(state: Any) -> None:
    log.warning("checking partitionable devices failed (%r); retrying", state.outcome.exception())


def node_labels_reader(kube: Any, node: str) -> Callable[[], Awaitable[Mapping[str, str] | None]]:
    async def read() -> Mapping[str, str] | None:
        try:
            found = await kube.get(NODE, node)
        except Exception as error:  # noqa: BLE001 - the last answer stands until the API server answers
            log.warning("reading node %s's labels for its MIG mode failed: %s", node, error_message(error))
            return None
        if found is None:
            return None
        return found["metadata"].get("labels") or {}
    return read
