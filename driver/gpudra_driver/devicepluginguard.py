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

from gpudra_core.agentcontract import DEVICE_PLUGIN_CONFLICT as CONFLICT  # the operator reads them
from gpudra_core.agentcontract import DEVICE_PLUGIN_RESOLVED as RESOLVED
from gpudra_core.kubeapi import Kube, error_message, resource_type

log = logging.getLogger("gpudra.agent")

NODE = resource_type("v1", "Node")
DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
Report = Callable[[str, str, str], Awaitable[None]]
REPOST_INTERVAL = 900.0  # a conflict's event again every 15 minutes while it lasts (Events live an hour)


def advertised_gpus(node: dict | None) -> dict[str, int]:  # type: ignore[type-arg]
    """The device plugin's resources in the Node's allocatable, with a count above 0:
    ``nvidia.com/gpu``, renamed or shared ones (``nvidia.com/gpu.shared``) and the MIG strategy
    ``mixed``'s ``nvidia.com/mig-<profile>``."""
    found = {}
    for name, value in ((((node or {}).get("status") or {}).get("allocatable") or {}).items()):
        if not (name.startswith(DEVICE_PLUGIN_RESOURCE) or name.startswith("nvidia.com/mig-")):
            continue
        try:
            count = int(str(value))
        except ValueError:
            continue
        if count > 0:
            found[name] = count
    return found


class DevicePluginGuard:
    def __init__(self, kube: Kube, node: str, *, allow: bool = False, report: Report | None = None,
                 interval: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.node, self.allow, self.report = kube, node, allow, report
        self.interval, self.clock = interval, clock
        self.blocked: str | None = None  # why nothing is published, while it is so
        self._checked: float | None = None
        self._posted: float | None = None  # when the conflict was last posted as a Node event

    def _repost_due(self, now: float) -> bool:
        return self._posted is None or now - self._posted >= REPOST_INTERVAL

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
        resources = advertised_gpus(node)
        if resources and (self.blocked is None or self._repost_due(now)):
            named = ", ".join(f"{name}: {count}" for name, count in sorted(resources.items()))
            self.blocked = (f"node {self.node} advertises {named} from NVIDIA's device plugin; gpudra publishes "
                            "none of its GPUs there, so none is handed out twice. Disable the device plugin on "
                            "this node (docs/deploy.md), or set spec.agent.allowDevicePlugin: true")
            if self._posted is None:
                log.error("%s", self.blocked)
            self._posted = now
            if self.report is not None:  # again while it lasts: Events expire (an hour by default)
                await self.report("Warning", CONFLICT, self.blocked)
        elif not resources and self.blocked is not None:
            self.blocked, self._posted = None, None
            message = f"node {self.node} no longer advertises NVIDIA's device plugin resources; gpudra publishes its GPUs"
            log.info("%s", message)
            if self.report is not None:
                await self.report("Normal", RESOLVED, message)
        return self.blocked
