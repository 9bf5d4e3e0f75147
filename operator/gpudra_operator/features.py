"""What the cluster's API server supports of the spec's optional DRA features, asked of the server
itself: a release number does not say it, since an administrator may turn an alpha gate on (or a
beta one off).

Consumable capacity (KEP-5075, gate DRAConsumableCapacity: alpha and off in Kubernetes 1.35, beta
and on in 1.36 and 1.37). One gate in the API server governs both whether it keeps
``allowMultipleAllocations`` and ``requestPolicy`` in ResourceSlices (it drops them silently when
off) and whether its DRA CEL environment declares ``device.allowMultipleAllocations`` for new
expressions (k8s.io/dynamic-resource-allocation/cel, ``Features.EnableConsumableCapacity``). The
operator may create DeviceClasses but not ResourceSlices, so it asks through a DeviceClass: a
server-side dry-run create (nothing is stored) whose selector reads the field. Refused as an
undefined field: the gate is off. The answer is kept for :data:`RECHECK` seconds; asked only while
some config wants the feature.

The same gate must be on in the scheduler (it does the packing) and the kubelets; a server that has
it and a scheduler that does not cannot be told apart from here (docs/sharing.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.consumable import FEATURE_GATE
from gpudra_core.kubeapi import Kube, error_message, is_status

log = logging.getLogger("gpudra.operator")

RECHECK = 3600.0  # seconds an answer is reused (a gate changes with an API server restart)
CONSUMABLE_CAPACITY_UNSUPPORTED = "ConsumableCapacityUnsupported"
PROBE_FIELD = "allowMultipleAllocations"


def consumable_capacity_probe() -> dict[str, Any]:
    """The DeviceClass whose dry-run create tells whether the gate is on."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"generateName": "gpudra-consumable-capacity-probe-"},
            "spec": {"selectors": [{"cel": {"expression": f"device.{PROBE_FIELD}"}}]}}


def refused_for_the_field(status: int, message: str) -> bool:
    """Whether a refusal of the probe says the field is unknown (the gate is off) (pure)."""
    return status == 422 and PROBE_FIELD in message and "undefined field" in message


def unsupported_message(version: str) -> str:
    """The Degraded condition's message for a server without the gate (pure)."""
    on = f"Kubernetes {version}" if version else "this cluster"
    return (f"spec.sharing.consumableCapacity is not in effect: the API server ({on}) has the {FEATURE_GATE} "
            "feature gate off (alpha and off by default in 1.35; beta and on from 1.36), so it would drop "
            "allowMultipleAllocations and requestPolicy from ResourceSlices. The agents publish whole GPUs, one "
            f"claim each. Upgrade to 1.36 or later, or enable {FEATURE_GATE} on the API server, scheduler and "
            "kubelets, or remove spec.sharing.consumableCapacity")


@dataclass(frozen=True)
class Support:
    """An answer: ``supported``, and for a refusal the message that says why and what to do."""

    supported: bool
    message: str = ""


class FeatureProbe:
    """Asks the API server, keeps the answer for :data:`RECHECK` seconds."""

    def __init__(self, kube: Kube, *, recheck: float = RECHECK) -> None:
        self.kube = kube
        self.recheck = recheck
        self._consumable: tuple[float, Support] | None = None
        self._minor: tuple[float, int | None] | None = None

    async def server_minor(self) -> int | None:
        """The cluster's Kubernetes minor version (/version): the release of DRA CEL its scheduler
        runs, hence which gpudra-allocator answers the class counts. An error keeps the last
        answer, else None (the helper then runs the oldest supported release)."""
        now = time.monotonic()
        if self._minor is not None and now - self._minor[0] < self.recheck:
            return self._minor[1]
        try:
            minor = await self.kube.server_minor()
        except Exception as error:  # noqa: BLE001 - any failure: the counts are advisory
            log.warning("reading the API server's version failed (%s)", error_message(error))
            minor = self._minor[1] if self._minor is not None else None
        self._minor = (now, minor)
        return minor

    async def consumable_capacity(self) -> Support:
        """Whether consumable capacity's fields are kept. An error other than the refusal (the
        server unreachable) keeps the last answer if there is one (a flapping answer would roll the
        agents back and forth), else is raised: the reconcile is retried."""
        now = time.monotonic()
        if self._consumable is not None and now - self._consumable[0] < self.recheck:
            return self._consumable[1]
        try:
            answer = await self._ask_consumable_capacity()
        except Exception as error:
            if self._consumable is None:
                raise
            log.warning("checking whether the API server supports consumable capacity failed (%s); keeping "
                        "the last answer", error_message(error))
            return self._consumable[1]
        if self._consumable is None or self._consumable[1] != answer:
            log.info("consumable capacity (%s) is %s by the API server", FEATURE_GATE,
                     "supported" if answer.supported else "not supported")
        self._consumable = (now, answer)
        return answer

    async def _ask_consumable_capacity(self) -> Support:
        try:
            await self.kube.create(consumable_capacity_probe(), dry_run=True)
        except ApiException as error:
            if not is_status(error, 422) or not refused_for_the_field(422, error_message(error)):
                raise
            version: Mapping[str, Any] = await self.kube.request("GET", "/version")
            return Support(False, unsupported_message(str(version.get("gitVersion") or "")))
        return Support(True)
