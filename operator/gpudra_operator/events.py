"""Kubernetes Events for GpuDraConfigs, posted when a condition flips or its message changes.

A cluster-scoped object's Events go to the ``default`` namespace (as the kubelet does for Nodes),
which is where ``kubectl describe gdc`` looks; kopf would post them into the operator's namespace
instead (nolar/kopf#949). Status conditions stay the durable record: Events expire after an hour."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from gpudra_core.kubeapi import EVENT_NAMESPACE, Kube, core_event

from gpudra_operator.conditions import CLASS_MATCHES_NO_DEVICE, DEGRADED, READY, find_condition

COMPONENT = "gpudra-operator"
log = logging.getLogger("gpudra.operator")


class EventRecorder:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    async def post(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        event = core_event({"apiVersion": body.get("apiVersion", "gpudra.io/v1alpha1"),
                            "kind": body.get("kind", "GpuDraConfig"), "name": meta["name"],
                            "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
                           type_, reason, message, component=COMPONENT)
        try:
            await self.kube.create(event)
        except Exception as error:  # an Event is a courtesy; never fail a reconcile over it
            log.warning("could not post Event %s for GpuDraConfig %s: %s", reason, meta["name"], error)

    async def on_transition(self, body: Mapping[str, Any], old: Sequence[Mapping[str, Any]],
                            new: Sequence[Mapping[str, Any]]) -> None:
        before, after = find_condition(old, DEGRADED), find_condition(new, DEGRADED)
        if after and after["status"] == "True" and (
                not before or before["status"] != "True" or before.get("message") != after.get("message")):
            await self.post(body, "Warning", after["reason"], after["message"])
        empty_before = find_condition(old, CLASS_MATCHES_NO_DEVICE)
        empty_after = find_condition(new, CLASS_MATCHES_NO_DEVICE)
        if empty_after and empty_after["status"] == "True" and (not empty_before or empty_before["status"] != "True"
                                                                or empty_before.get("message") != empty_after.get("message")):
            await self.post(body, "Warning", empty_after["reason"], empty_after["message"])
        ready_before, ready_after = find_condition(old, READY), find_condition(new, READY)
        if ready_after and ready_after["status"] == "True" and (not ready_before or ready_before["status"] != "True"):
            await self.post(body, "Normal", "Ready", ready_after["message"])
