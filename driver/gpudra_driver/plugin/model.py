"""The plugin's value types: what the kubelet names, and what a prepared claim is.

A :class:`PreparedClaim` is everything needed to answer the kubelet and to (re)write the claim's
CDI spec; the checkpoint stores it, so an answer never depends on re-discovery."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpudra_driver import limits

# Kubernetes UIDs are RFC 4122 UUIDs; accept any short alphanumeric/dash string, which is all a UID
# can be without breaking CDI device names and file names.
_UID = re.compile(r"^[0-9A-Za-z]([0-9A-Za-z-]{0,62}[0-9A-Za-z])?$")


def is_uid(value: str) -> bool:
    """A Kubernetes UID, or anything as safe in a file or socket name and a CDI device name."""
    return bool(_UID.fullmatch(value))


class ClaimError(Exception):
    """Preparing or unpreparing one claim failed; the message goes into the kubelet's response."""


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it (the proto's Claim message)."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} (UID {self.uid})"

    def check(self) -> None:
        """Reject malformed names before they reach an API path or a file name."""
        if not self.uid:
            raise ClaimError("malformed claim: uid is required")
        if not is_uid(self.uid):
            raise ClaimError(f"malformed claim: uid {self.uid!r} is not a Kubernetes UID")
        if not limits.is_dns_label(self.namespace):
            raise ClaimError(f"malformed claim {self.uid}: namespace {self.namespace!r} is not a DNS label")
        if not limits.is_dns_subdomain(self.name):
            raise ClaimError(f"malformed claim {self.uid}: name {self.name!r} is not a DNS subdomain")


@dataclass(frozen=True)
class PreparedDevice:
    requests: tuple[str, ...]  # request names (subrequests stripped), as the kubelet wants them
    pool: str
    device: str
    uuid: str
    device_nodes: tuple[str, ...]  # device-specific container paths
    cdi_device_id: str
    # Allocated with adminAccess only (monitoring): it does not hold the device for this claim.
    admin_access: bool = False

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"requests": list(self.requests), "pool": self.pool, "device": self.device,
                                "uuid": self.uuid, "deviceNodes": list(self.device_nodes),
                                "cdiDeviceID": self.cdi_device_id}
        if self.admin_access:  # absent otherwise: entries written before it stay byte-identical
            data["adminAccess"] = True
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedDevice:
        return cls(tuple(data["requests"]), data["pool"], data["device"], data["uuid"],
                   tuple(data["deviceNodes"]), data["cdiDeviceID"], bool(data.get("adminAccess", False)))


@dataclass(frozen=True)
class PreparedClaim:
    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]

    @property
    def uid(self) -> str:
        return self.ref.uid

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.ref.namespace, "name": self.ref.name,
                "devices": [d.to_json() for d in self.devices]}

    @cached_property
    def canonical_json(self) -> str:
        """:meth:`to_json` as canonical JSON (sorted keys, no spaces), encoded once per claim."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, uid: str, data: dict[str, Any]) -> PreparedClaim:
        return cls(ClaimRef(data["namespace"], data["name"], uid),
                   tuple(PreparedDevice.from_json(d) for d in data["devices"]))
