"""No GPU handed out twice: the agent publishes nothing on a node where NVIDIA's device plugin
advertises ``nvidia.com/gpu``.

The device plugin (the GPU Operator's default) hands GPUs to pods that ask for ``nvidia.com/gpu``
in their resources; the kubelet does not know those are the same GPUs a DRA driver publishes in
its ResourceSlices, so both could give one GPU to two pods. While the Node's
``status.allocatable`` has ``nvidia.com/gpu`` > 0, the agent keeps its devices out of its slices
(claims it already prepared keep working) and says so: an ERROR line, and a Warning
``DevicePluginConflict`` event on the Node, which the operator turns into the GpuDraConfig's
``Degraded`` condition. A Normal ``DevicePluginConflictResolved`` event follows when the resource
is gone. ``--allow-device-plugin`` (``spec.agent.allowDevicePlugin``) turns the check off, for
clusters that split GPUs between the two by other means (e.g. the device plugin's own
per-node configuration).

The Node is read once at start and then every ``interval`` seconds (one GET; the agent may read
its Node already), not watched: a Node watch per agent would cost the API server more than the
rare change it would catch sooner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from gpudra_driver.kubeapi import Kube, error_message, resource_type

log = logging.getLogger("gpudra.agent")

NODE = resource_type("v1", "Node")
DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
CONFLICT = "DevicePluginConflict"
RESOLVED = "DevicePluginConflictResolved"
Report = Callable[[str, str, str], Awaitable[None]]


def advertised_gpus(node: dict | None) -> int:  # type: ignore[type-arg]
    """``nvidia.com/gpu`` in the Node's allocatable (0 when absent or unparsable)."""
    value = (((node or {}).get("status") or {}).get("allocatable") or {}).get(DEVICE_PLUGIN_RESOURCE, "0")
    try:
        return int(str(value))
    except ValueError:
        return 0


class DevicePluginGuard:
    def __init__(self, kube: Kube, node: str, *, allow: bool = False, report: Report | None = None,
                 interval: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.node, self.allow, self.report = kube, node, allow, report
        self.interval, self.clock = interval, clock
        self.blocked: str | None = None  # why nothing is published, while it is so
        self._checked: float | None = None

    async def check(self) -> str | None:
        """Refresh from the Node when due; returns the reason to publish nothing, or None."""
        if self.allow:
            return None
        now = self.clock()
        if self._checked is not None and now - self._checked < self.interval:
            return self.blocked
        try:
            node = await self.kube.get(NODE, self.node)
        except Exception as error:  # noqa: BLE001 - the last answer stands until the API server answers
            log.debug("reading node %s for the device plugin check failed: %s", self.node, error_message(error))
            return self.blocked
        self._checked = now
        count = advertised_gpus(node)
        if count and self.blocked is None:
            self.blocked = (f"node {self.node} advertises {DEVICE_PLUGIN_RESOURCE}: {count} from NVIDIA's device "
                            "plugin; gpudra publishes none of its GPUs there, so none is handed out twice. Disable "
                            "the device plugin on this node (docs/deploy.md), or set "
                            "spec.agent.allowDevicePlugin: true")
            log.error("%s", self.blocked)
            if self.report is not None:
                await self.report("Warning", CONFLICT, self.blocked)
        elif not count and self.blocked is not None:
            self.blocked = None
            message = f"node {self.node} no longer advertises {DEVICE_PLUGIN_RESOURCE}; gpudra publishes its GPUs"
            log.info("%s", message)
            if self.report is not None:
                await self.report("Normal", RESOLVED, message)
        return self.blocked
