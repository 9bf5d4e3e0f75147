"""What a node tells the cluster about the claims it prepared (pure).

Two views of the same fact, "this claim's request got this physical device on this node":

* the claim's ``status.devices[]`` (KEP-4817, written by the driver): one entry per device of ours,
  keyed like the API's list map (driver, pool, device, shareID), with a ``Ready`` condition and
  ``data`` that lets a person find the device on the node (UUIDs, PCI bus ID, device nodes) and see
  it in ``kubectl describe resourceclaim``; written by server-side apply as the agent's field
  manager, so the scheduler's allocation and other drivers' entries are never touched;
* the ``gpudra_agent_claim_device_info`` series: one per pod, request and device, labelled with the
  physical GPU's UUID and MIG GPU instance ID as dcgm-exporter labels its series (``UUID``,
  ``GPU_I_ID``), so Prometheus joins per-GPU metrics to pods in one query.

Everything taken from a live claim (its consumers) is tenant-reachable and bounded here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_core import limits
from gpudra_core.devicemodel import Device
from gpudra_core.kubeapi import Obj, rfc3339
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim, PreparedDevice

READY = "Ready"
MAX_CONSUMERS = 256  # status.reservedFor's own maximum (ResourceClaimReservedForMaxSize)
INFO_LABELS = ("namespace", "pod", "claim", "request", "device", "UUID", "GPU_I_ID", "mig_uuid")
# Published attributes a person uses to find a device on the node, copied into status data.
_LOCATING_ATTRIBUTES = (("productName", "productName"), ("index", "index"), ("minor", "minor"),
                        ("resource.kubernetes.io/pciBusID", "pciBusID"), ("profile", "migProfile"),
                        ("parentUUID", "parentUUID"), ("parentIndex", "parentIndex"))


@dataclass(frozen=True)
class Located:
    """One prepared device as the node knows it: the physical GPU's UUID, and for a MIG device its
    own UUID and GPU instance ID (dcgm-exporter's ``GPU_I_ID``)."""

    gpu_uuid: str
    mig_uuid: str = ""
    gpu_instance: str = ""


def locate(device: PreparedDevice, published: Device | None) -> Located:
    """Where ``device`` is: from the prepared claim (a dynamic MIG instance's IDs are only there)
    and from the device as discovery published it (a static MIG device's parent)."""
    if device.mig is not None:  # dynamic MIG: the instance prepare created
        return Located(device.mig.parent_uuid, device.uuid if device.mig.created else "",
                       "" if device.mig.gi is None else str(device.mig.gi))
    if published is not None and published.type == "mig":
        gi = published.attr("gpuInstanceId")
        return Located(str(published.attr("parentUUID") or ""), device.uuid, "" if gi is None else str(gi))
    return Located(device.uuid)


def device_status_entries(claim: PreparedClaim, *, driver: str, node: str, generation: int | None,
                          published: Mapping[str, Device], now: float) -> list[Obj]:
    """The claim's ``status.devices`` entries of this driver: one per prepared device (an
    adminAccess device too: the claim holds it, to monitor)."""
    entries = []
    for device in claim.devices:
        where = locate(device, published.get(device.device))
        data: dict[str, Any] = {"node": node, "uuid": device.uuid or where.gpu_uuid}
        if where.mig_uuid:
            data |= {"gpuUUID": where.gpu_uuid, "gpuInstanceID": int(where.gpu_instance)}
        if (found := published.get(device.device)) is not None:
            for attribute, key in _LOCATING_ATTRIBUTES:
                if (value := found.attr(attribute)) is not None and key not in data:
                    data[key] = value
        if device.mig is not None:
            data.setdefault("migProfile", device.mig.profile)
        data["deviceNodes"] = list(device.device_nodes)
        data["cdiDevice"] = device.cdi_device_id
        if device.sharing.strategy != "Exclusive":
            data["sharing"] = device.sharing.strategy
        if device.consumed:
            data["consumedCapacity"] = dict(device.consumed)
        condition: Obj = {"type": READY, "status": "True", "reason": "Prepared",
                          "message": f"prepared on node {node} for the claim's containers"
                                     + (" (adminAccess: monitoring only)" if device.admin_access else ""),
                          "lastTransitionTime": rfc3339(now)}
        if generation is not None:
            condition["observedGeneration"] = generation
        entry: Obj = {"driver": driver, "pool": device.pool, "device": device.device,
                      "conditions": [condition], "data": data}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        entries.append(entry)
    return entries


def status_apply(ref: ClaimRef, entries: Sequence[Obj]) -> Obj:
    """The server-side apply of the claim's status subresource with ``entries`` (none: removes every
    entry this field manager wrote). The UID makes the API server refuse it for a re-created claim."""
    status: Obj = {"devices": list(entries)} if entries else {}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": status}


# The API server's answer to a status write of a claim whose stored opaque config parameters are
# not byte for byte what it re-encodes them to. The allocation's parameters are the RawExtension
# bytes the client sent at create, copied by kube-scheduler over protobuf; a JSON patch or apply is
# decoded into a re-encoded (compacted; for an apply also key-sorted) copy, and the immutability
# check of status.allocation (ValidateResourceClaimStatusUpdate: apiequality.Semantic.DeepEqual,
# byte-wise for RawExtension.Raw) sees a change that is not one. Kubernetes 1.35 to 1.37; 1.35
# and 1.36 word it as ValidateImmutableField does, 1.37's declarative validation (+k8s:update=NoModify)
# as "field cannot be modified once set".
ALLOCATION_IMMUTABLE = ("field is immutable", "field cannot be modified once set")


def allocation_refused(status: int, message: str) -> bool:
    """Whether an answer is that immutability check of ``status.allocation`` refusing a write that
    left the allocation alone (pure)."""
    return status == 422 and "status.allocation" in message and any(words in message for words in ALLOCATION_IMMUTABLE)


def status_merge_patch(live: Mapping[str, Any], driver: str, entries: Sequence[Obj]) -> Obj:
    """The JSON merge patch that makes ``live``'s ``status.devices`` carry ``entries`` as this
    driver's, other drivers' entries kept as read. A merge patch replaces the list whole, so it is
    tied to what was read: the resourceVersion (a write in between: 409) and the UID."""
    others = [e for e in ((live.get("status") or {}).get("devices") or []) if e.get("driver") != driver]
    devices = others + list(entries)
    meta = live["metadata"]
    return {"metadata": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
            "status": {"devices": devices or None}}


def entries_of(body: Mapping[str, Any]) -> list[Obj]:
    """The entries a :func:`status_apply` body writes (pure)."""
    return list((body.get("status") or {}).get("devices") or [])


def refusal_message(ref_name: str) -> str:
    """What the claim's Event and the agent's log say when the API server refuses every status
    write to a claim (pure)."""
    return (f"status.devices of claim {ref_name} not written: the API server refuses any change to "
            "this claim's status (status.allocation: field is immutable) because its opaque config "
            "parameters were created as JSON that the API server re-encodes differently (whitespace, "
            "key order). The devices are prepared and the pod runs; only the status is missing. "
            "Create claims (and claim templates) with compact JSON parameters, as kubectl does.")


def same_entries(live: Sequence[Any], wanted: Sequence[Obj]) -> bool:
    """Whether the live claim's status already carries ``wanted`` (times aside: a restarted agent
    does not rewrite what an earlier one wrote)."""
    def key(entry: Any) -> tuple[Any, ...]:
        return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))

    def comparable(entry: Any) -> Any:
        conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                      for c in entry.get("conditions") or [] if isinstance(c, Mapping)]
        return {**entry, "conditions": conditions}

    have = {key(e): e for e in live if isinstance(e, Mapping)}
    return all(key(w) in have and comparable(have[key(w)]) == comparable(w) for w in wanted)


def carries_exactly(live: Mapping[str, Any] | None, driver: str, wanted: Sequence[Obj]) -> bool:
    """Whether ``live`` carries ``wanted`` as this driver's entries and no others (times aside)
    (pure). An apply answered 200 may not: entries a merge patch wrote belong to an Update
    operation, and an apply that leaves them out does not remove them."""
    have = live_entries(live, driver)
    return len(have) == len(wanted) and same_entries(have, wanted)


def live_entries(live: Mapping[str, Any] | None, driver: str) -> list[Any]:
    """This driver's entries of a live claim's ``status.devices``."""
    devices = ((live or {}).get("status") or {}).get("devices") or []
    return [e for e in devices[:limits.MAX_ALLOCATION_RESULTS] if isinstance(e, Mapping) and e.get("driver") == driver] \
        if isinstance(devices, list) else []


def generation_of(live: Mapping[str, Any] | None) -> int | None:
    generation = ((live or {}).get("metadata") or {}).get("generation")
    return generation if type(generation) is int else None


def consumer_pods(live: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The pods a live claim is reserved for (``status.reservedFor``), bounded as the API bounds it."""
    reserved = ((live or {}).get("status") or {}).get("reservedFor") or []
    if not isinstance(reserved, list):
        return ()
    pods = []
    for consumer in reserved[:MAX_CONSUMERS]:
        if isinstance(consumer, Mapping) and consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
            name = consumer.get("name")
            if isinstance(name, str) and limits.is_dns_subdomain(name):
                pods.append(name)
    return tuple(sorted(set(pods)))


def info_series(claim: PreparedClaim, pods: Sequence[str], published: Mapping[str, Device]) -> list[tuple[str, ...]]:
    """The claim's ``gpudra_agent_claim_device_info`` label values (in :data:`INFO_LABELS` order):
    one per pod (an empty pod while none is known), request and device."""
    series: list[tuple[str, ...]] = []
    for device in claim.devices:
        where = locate(device, published.get(device.device))
        for pod in pods or ("",):
            for request in device.requests:
                series.append((claim.ref.namespace, pod, claim.ref.name, request, device.device,
                               where.gpu_uuid, where.gpu_instance, where.mig_uuid))
    return series
