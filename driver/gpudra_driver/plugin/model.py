"""The plugin's value types: what the kubelet names, and what a prepared claim is.

A :class:`PreparedClaim` is everything needed to answer the kubelet and to (re)write the claim's
CDI spec; the checkpoint stores it, so an answer never depends on re-discovery."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Literal, TypeAlias

from gpudra_core import limits
from gpudra_core.devicemodel import ATTR_TYPES, AttrValue

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


EXCLUSIVE, TIME_SLICING, MPS = "Exclusive", "TimeSlicing", "MPS"


@dataclass(frozen=True)
class DeviceSharing:
    """How the containers of a claim share one of its devices (the claim's GpuConfig, resolved
    for the device's request). Exclusive changes nothing on the GPU."""

    strategy: str = EXCLUSIVE
    timeslice: int | None = None  # TimeSlicing: nvidia-smi's --set-timeslice level, 0..3
    active_thread_percentage: int | None = None  # MPS
    pinned_memory_limit: int | None = None  # MPS, bytes
    shm_size: int | None = None  # MPS, bytes: the claim's /dev/shm as its config asks (None: the platform's)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"strategy": self.strategy}
        for key, value in (("timeslice", self.timeslice), ("activeThreadPercentage", self.active_thread_percentage),
                           ("pinnedMemoryLimit", self.pinned_memory_limit), ("shmSize", self.shm_size)):
            if value is not None:
                data[key] = value
        return data

    @classmethod
    def from_json(cls, data: Any) -> DeviceSharing:
        if not isinstance(data, dict) or data.get("strategy") not in (EXCLUSIVE, TIME_SLICING, MPS):
            raise ValueError(f"sharing: {data!r} is not a device sharing setting")
        values = [data.get(k) for k in ("timeslice", "activeThreadPercentage", "pinnedMemoryLimit", "shmSize")]
        if not all(v is None or type(v) is int for v in values):
            raise ValueError(f"sharing: {data!r} has a non-integer setting")
        return cls(data["strategy"], *values)


NOT_SHARED = DeviceSharing()


@dataclass(frozen=True)
class MigPlacement:
    """A dynamic MIG device's instance: the placement the scheduler allocated (parent GPU, profile,
    first memory slice and how many), recorded before NVML is asked to create it; then the GPU and
    compute instance IDs NVML gave it."""

    parent_uuid: str
    profile: str  # "1g.10gb": the profile ID is looked up by name on the GPU itself
    start: int
    size: int
    parent_minor: int
    gi: int | None = None
    ci: int | None = None

    @property
    def created(self) -> bool:
        return self.gi is not None and self.ci is not None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"parentUUID": self.parent_uuid, "profile": self.profile, "start": self.start,
                                "size": self.size, "parentMinor": self.parent_minor}
        if self.gi is not None:
            data["gi"] = self.gi
        if self.ci is not None:
            data["ci"] = self.ci
        return data

    @classmethod
    def from_json(cls, data: Any) -> MigPlacement:
        if not isinstance(data, dict):
            raise ValueError(f"mig: {data!r} is not a MIG placement")
        ints = [data.get(k) for k in ("start", "size", "parentMinor")]
        ids = [data.get(k) for k in ("gi", "ci")]
        if not all(type(v) is int for v in ints) or not all(v is None or type(v) is int for v in ids) \
                or not isinstance(data.get("parentUUID"), str) or not isinstance(data.get("profile"), str):
            raise ValueError(f"mig: {data!r} is not a MIG placement")
        return cls(data["parentUUID"], data["profile"], int(data["start"]), int(data["size"]),
                   int(data["parentMinor"]), data.get("gi"), data.get("ci"))


@dataclass(frozen=True)
class MigModeOff:
    """The whole GPU of a dynamic MIG GPU, held by one claim: recorded (PrepareStarted) before its
    MIG mode is turned off for the claim, so whoever finds the record of a prepare that did not
    complete, or unprepares the claim, turns it on again. ``geometry``: the GPU's MIG profiles and
    placements (:func:`gpudra_core.migpartitions.geometry_to_json`) read before the switch, which
    discovery publishes the GPU from while MIG mode is off; None until then."""

    geometry: tuple[Any, ...] | None = None  # JSON, as a tuple so that the record stays hashable

    def to_json(self) -> dict[str, Any]:
        return {} if self.geometry is None else {"geometry": list(self.geometry)}

    @classmethod
    def from_json(cls, data: Any) -> MigModeOff:
        if not isinstance(data, dict) or not isinstance(data.get("geometry", []), list):
            raise ValueError(f"migModeOff: {data!r} is not a MIG mode record")
        return cls(tuple(data["geometry"]) if "geometry" in data else None)


@lru_cache(maxsize=1024)
def _attributes_json(attributes: tuple[tuple[str, AttrValue], ...]) -> str:
    """A device's recorded attributes as canonical JSON, once per device: every claim prepared on
    it records discovery's same tuple."""
    return json.dumps({name: value.to_api() for name, value in attributes}, sort_keys=True, separators=(",", ":"))


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
    # Consumable capacity (KEP-5075): the allocation's share of a device that several claims may
    # hold at once, and what it consumes of the device's capacity (name -> base units).
    share_id: str | None = None
    consumed: tuple[tuple[str, int], ...] = ()
    sharing: DeviceSharing = NOT_SHARED
    mig: MigPlacement | None = None  # a dynamic MIG device: its placement and, once created, its instance
    mig_mode_off: MigModeOff | None = None  # the whole GPU of a dynamic MIG GPU: its MIG mode off for the claim
    # Device metadata (KEP-5304, :mod:`.devicemetadata`): the device's attributes and capacities as
    # discovery published them when it was prepared, sorted by name; empty when the claim has no metadata.
    attributes: tuple[tuple[str, AttrValue], ...] = ()

    @property
    def consumed_memory(self) -> int:
        return dict(self.consumed).get("memory", 0)

    def to_json(self) -> dict[str, Any]:
        data = self._json_without_attributes()
        if self.attributes:
            data["attributes"] = {name: value.to_api() for name, value in self.attributes}
        return data

    def _json_without_attributes(self) -> dict[str, Any]:
        data: dict[str, Any] = {"requests": list(self.requests), "pool": self.pool, "device": self.device,
                                "uuid": self.uuid, "deviceNodes": list(self.device_nodes),
                                "cdiDeviceID": self.cdi_device_id}
        # Newer fields only when set: entries without them stay byte-identical to older agents'.
        if self.admin_access:
            data["adminAccess"] = True
        if self.share_id is not None:
            data["shareID"] = self.share_id
        if self.consumed:
            data["consumed"] = dict(self.consumed)
        if self.sharing != NOT_SHARED:
            data["sharing"] = self.sharing.to_json()
        if self.mig is not None:
            data["mig"] = self.mig.to_json()
        if self.mig_mode_off is not None:
            data["migModeOff"] = self.mig_mode_off.to_json()
        return data

    def canonical_json(self) -> str:
        """:meth:`to_json` as canonical JSON (sorted keys, compact). The attributes, most of an
        entry, are encoded once per device (:func:`_attributes_json`) and spliced in where
        ``sort_keys`` puts them: after ``adminAccess``, before ``cdiDeviceID`` (always there)."""
        if not self.attributes:
            return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        body = json.dumps(self._json_without_attributes(), sort_keys=True, separators=(",", ":"))
        head = '{"adminAccess":true,' if self.admin_access else "{"
        assert body.startswith(head + '"cdiDeviceID":'), body
        return f'{head}"attributes":{_attributes_json(self.attributes)},{body[len(head):]}'

    @property
    def needs_version_3(self) -> bool:
        """Fields an agent reading checkpoint versions up to 2 would drop (and then hand the device
        to a claim it would not share with)."""
        return self.share_id is not None or bool(self.consumed) or self.sharing != NOT_SHARED

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedDevice:
        consumed = data.get("consumed") or {}
        if not isinstance(consumed, dict) or not all(type(v) is int for v in consumed.values()):
            raise ValueError(f"consumed: {consumed!r} is not a map of capacity name to integer")
        share_id = data.get("shareID")
        return cls(tuple(data["requests"]), data["pool"], data["device"], data["uuid"],
                   tuple(data["deviceNodes"]), data["cdiDeviceID"], bool(data.get("adminAccess", False)),
                   None if share_id is None else str(share_id), tuple(sorted(consumed.items())),
                   DeviceSharing.from_json(data["sharing"]) if "sharing" in data else NOT_SHARED,
                   MigPlacement.from_json(data["mig"]) if "mig" in data else None,
                   MigModeOff.from_json(data["migModeOff"]) if "migModeOff" in data else None,
                   _attributes_from_json(data.get("attributes") or {}))


def _attributes_from_json(data: Any) -> tuple[tuple[str, AttrValue], ...]:
    if not isinstance(data, dict):
        raise ValueError(f"attributes: {data!r} is not a map of attribute name to value")
    attributes = []
    for name, value in data.items():
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ATTR_TYPES:
            raise ValueError(f"attributes: {name}: {value!r} is not an attribute value")
        (kind, raw), = value.items()
        try:
            attributes.append((name, AttrValue(kind, raw)))
        except TypeError as error:
            raise ValueError(f"attributes: {name}: {error}") from None
    return tuple(attributes)


@dataclass(frozen=True)
class ClaimMetadata:
    """The claim was prepared with device metadata (KEP-5304, :mod:`.devicemetadata`): its CDI spec
    mounts one metadata file per request into the containers. Recorded so that the spec and the
    files stay what the kubelet was answered, whatever the agent's flag says after a restart."""

    requests: tuple[str, ...]  # the claim's requests of ours as allocated: "<request>" or "<request>/<sub>"
    # the claim's pod-local name (annotation resource.kubernetes.io/pod-claim-name, a DNS label) for a
    # claim made from a template; None for a claim the pod names directly
    pod_claim_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"requests": list(self.requests)}
        if self.pod_claim_name is not None:
            data["podClaimName"] = self.pod_claim_name
        return data

    @classmethod
    def from_json(cls, data: Any) -> ClaimMetadata:
        requests = data.get("requests") if isinstance(data, dict) else None
        pod_claim_name = data.get("podClaimName") if isinstance(data, dict) else None
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests) \
                or not (pod_claim_name is None or limits.is_dns_label(pod_claim_name)):
            raise ValueError(f"metadata: {data!r} is not a device metadata record")
        return cls(tuple(requests), pod_claim_name)


@dataclass(frozen=True)
class PreparedClaim:
    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    metadata: ClaimMetadata | None = None  # None: prepared without device metadata

    @property
    def uid(self) -> str:
        return self.ref.uid

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"namespace": self.ref.namespace, "name": self.ref.name,
                                "devices": [d.to_json() for d in self.devices]}
        if self.metadata is not None:
            data["metadata"] = self.metadata.to_json()
        return data

    @cached_property
    def canonical_json(self) -> str:
        """:meth:`to_json` as canonical JSON (sorted keys, no spaces), encoded once per claim, from
        its devices' (``devices`` sorts first, before ``metadata``, ``name``, ``namespace``)."""
        rest: dict[str, Any] = {"namespace": self.ref.namespace, "name": self.ref.name}
        if self.metadata is not None:
            rest["metadata"] = self.metadata.to_json()
        devices = ",".join(device.canonical_json() for device in self.devices)
        return f'{{"devices":[{devices}],{json.dumps(rest, sort_keys=True, separators=(",", ":"))[1:]}'

    @classmethod
    def from_json(cls, uid: str, data: dict[str, Any]) -> PreparedClaim:
        return cls(ClaimRef(data["namespace"], data["name"], uid),
                   tuple(PreparedDevice.from_json(d) for d in data["devices"]),
                   ClaimMetadata.from_json(data["metadata"]) if "metadata" in data else None)


@dataclass(frozen=True)
class PrepareResult:
    """One claim's answer to the kubelet: the prepared claim, or why it is not."""

    claim: PreparedClaim | None = None
    error: str | None = None


Health: TypeAlias = Literal["HEALTHY", "UNHEALTHY", "UNKNOWN"]  # the kubelet API's HealthStatus names


@dataclass(frozen=True)
class DeviceHealth:
    """One device's health as DRAResourceHealth streams it to the kubelet (KEP-4680); the agent's
    device health (gpudra_driver.devicehealth.feed) fills it."""

    pool: str
    device: str
    health: Health
    updated: float  # unix seconds: when this health was last determined
    message: str = ""
