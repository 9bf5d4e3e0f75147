"""Events about this agent's Node: what ``kubectl describe node`` shows when GPU discovery fails.

The kubelet reports Node events in the ``default`` namespace, and so does the agent: one Warning
``GpuDiscoveryFailed`` each time the reason changes (a missing ``libnvidia-ml.so.1`` in the driver
root, a driver not loaded, a version mismatch), one Normal ``GpuDiscoveryRecovered`` when it works
again. Posting is best effort: an Event the API server refuses is logged, never retried, and never
stops discovery.
"""

from __future__ import annotations

import logging

from gpudra_core.agentcontract import event_source
from gpudra_core.kubeapi import Kube, core_event, error_message

log = logging.getLogger("gpudra.agent")

class NodeEvents:
    def __init__(self, kube: Kube, node: str, *, driver: str, host: str | None = None) -> None:
        self.kube, self.node, self.host = kube, node, host
        self.component = event_source(driver)

    async def post_on_pod(self, namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
        """An Event on a pod (in its namespace, where ``kubectl describe pod`` finds it)."""
        pod = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name, "uid": uid}
        event = core_event(pod, kind, reason, message, component=self.component, host=self.host or self.node)
        event["metadata"]["namespace"] = namespace
        try:
            await self.kube.create(event)
        except Exception as error:  # noqa: BLE001 - best effort; the Node event and the log say it too
            log.warning("could not post the %s event on pod %s/%s: %s", reason, namespace, name, error_message(error))

    async def post(self, kind: str, reason: str, message: str) -> None:
        # the kubelet's node reference too: the UID is the node's name
        node = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node}
        event = core_event(node, kind, reason, message, component=self.component, host=self.host or self.node)
        try:
            await self.kube.create(event)
        except Exception as error:  # noqa: BLE001 - best effort; the log has the same line
            log.warning("could not post the %s event on node %s: %s", reason, self.node, error_message(error))
