"""A ResourceClaim's requests as explain reads them, and whether a request tolerates a device's
taints. Plain reading of API objects: whether a claim is allocated, and where, is the allocator's
answer (gpudra-allocator), never decided here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpudra_operator.explain.inventory import Device, Obj

# The taint effects that keep the allocator from picking a device (k8s.io/dynamic-resource-allocation
# structured: taintPreventsAllocation); other effects only inform.
PREVENTING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Request:
    """One request, or one subrequest of a ``firstAvailable`` request, as the API server stores it."""

    name: str  # the request's name
    subrequest: str | None
    class_name: str
    selectors: tuple[str, ...]
    all_devices: bool
    count: int
    admin_access: bool
    tolerations: tuple[Obj, ...]
    # capacity.requests (consumable capacity): what the request asks of each of a device's capacities
    capacity: Mapping[str, str] = field(default_factory=dict)

    @property
    def result_name(self) -> str:
        """The name an allocation result carries: ``request`` or ``request/subrequest``."""
        return f"{self.name}/{self.subrequest}" if self.subrequest else self.name


def _request(name: str, sub: str | None, body: Obj) -> Request:
    asked = (body.get("capacity") or {}).get("requests") or {}
    return Request(
        name=name, subrequest=sub, class_name=str(body.get("deviceClassName") or ""),
        selectors=tuple(str((s.get("cel") or {}).get("expression", "")) for s in body.get("selectors") or []),
        all_devices=body.get("allocationMode") == "All", count=int(body.get("count") or 1),
        admin_access=bool(body.get("adminAccess")), tolerations=tuple(body.get("tolerations") or []),
        capacity={str(k): str(v) for k, v in asked.items()})


def claim_requests(claim: Obj) -> list[list[Request]]:
    """Per request of ``claim``: ``[exactly]``, or its ``firstAvailable`` subrequests in order."""
    out: list[list[Request]] = []
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        if entry.get("firstAvailable"):
            out.append([_request(entry["name"], sub["name"], sub) for sub in entry["firstAvailable"]])
        else:
            out.append([_request(entry["name"], None, entry.get("exactly") or {})])
    return out


def claim_label(claim: Obj) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def allocation(claim: Obj) -> Obj | None:
    return (claim.get("status") or {}).get("allocation")


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """k8s.io/dynamic-resource-allocation/resourceclaim ``ToleratesTaint``."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taints(device: Device, request: Request) -> list[Obj]:
    """The device's taints that keep the allocator from picking it for ``request``. A slice carries
    taints only where the API server's DRADeviceTaints gate is on, and the scheduler heeds them only
    where its own is."""
    return [t for t in device.spec.get("taints") or [] if t.get("effect") in PREVENTING_EFFECTS
            and not any(tolerates(x, t) for x in request.tolerations)]
