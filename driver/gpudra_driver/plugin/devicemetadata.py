"""Device metadata (KEP-5304): each prepared claim's containers read, at a standard path, the
attributes of the devices they got.

The contract is upstream's, k8s.io/dynamic-resource-allocation ``api/metadata`` (doc.go, helpers.go,
the v1alpha1 and v1beta1 types) and ``devicemetadata/decode.go`` (the reader containers use):

* one file per request of the claim, bind-mounted read-only at
  ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claimName>/<request>/<driver>-metadata.json``
  for a claim the pod names, or at ``.../resourceclaimtemplates/<podClaimName>/<request>/...`` for a
  claim made from a template (``podClaimName``: the claim's annotation
  ``resource.kubernetes.io/pod-claim-name``, the pod's own name for it); ``<request>`` without the
  subrequest;
* the file is a JSON stream: the same ``DeviceMetadata`` object once per API version, newest first
  (``metadata.resource.k8s.io/v1beta1``, read by 1.37's decoder, then ``v1alpha1``, read by
  1.36's, which skips the version it does not know);
* each device: driver, pool, name and its attributes, in the ResourceSlice attribute format.

The mount is a CDI device of its own per request, ``<claimUID>_<request>`` in the claim's one spec
file (:mod:`.cdi`): device names are DNS labels, so no real device (``<claimUID>-<device>``) can
have that name. Its ID is answered with the first device of the request only (as upstream's
kubeletplugin does), so a container given the whole claim gets each file once.

The host file is ``<cdi-dir>/k8s.<driver>-device-metadata/<claimUID>_<request>.json``
(:func:`.cdi.metadata_dir`): beside the spec that mounts it, with the same lifetime, and on the
same tmpfs (``/var/run/cdi``), so a prepare makes no inode on the kubelet's disk for it (about
0.2 ms each on ext4, on the kubelet's critical path); CDI's scan of a spec directory skips
subdirectories. Releases before put the files in ``<plugin-dir>/dra-device-metadata``
(upstream's helper's place, its ``metadataSubDir``): a claim prepared there keeps its files and
its spec as they are until it is unprepared, when they are removed from either place, as orphans
are. Upstream's helper writes ``<namespace>_<name>/<request>/metadata.json``; the host path is the
driver's own (containers see only the mount), and the UID keeps a claim deleted and made again
under the same name from sharing, or removing, the other's files, and lets start-up find orphans
by UID, as for the specs. One flat directory: a prepare writes its files with no directory to make,
an unprepare removes none (``_`` is in no UID and no request name, so the name splits back into
both).

Attributes: what discovery published for the device when it was prepared (recorded in the
checkpoint, so a rewritten file says the same), its capacities as ints (``memory`` in bytes...),
the UUID and instance IDs of a dynamic MIG device once prepare created it, and a share's
``shareID`` and ``consumed<Capacity>`` (consumable capacity); at most 32, as the API allows.

Everything but :class:`MetadataFiles` is pure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from json.encoder import encode_basestring_ascii as json_string  # json.dumps(str), without its dispatch
from pathlib import Path
from typing import Any

from gpudra_core import limits
from gpudra_core.devicemodel import CAPACITIES, AttrValue
from gpudra_driver.plugin.fsutil import TEMP_MARK, write_atomic
from gpudra_driver.plugin.model import ClaimMetadata, PreparedClaim, PreparedDevice, is_uid

DIR_SUFFIX = "-device-metadata"  # in the CDI directory: <vendor>-device-metadata (:func:`.cdi.metadata_dir`)
LEGACY_SUBDIR = "dra-device-metadata"  # under the plugin directory (upstream's metadataSubDir): earlier releases
SUFFIX = ".json"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"  # metadata.ContainerDir
CLAIMS_SUBDIR, TEMPLATES_SUBDIR = "resourceclaims", "resourceclaimtemplates"
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"  # resourceapi.PodResourceClaimAnnotation
GROUP = "metadata.resource.k8s.io"
VERSIONS = ("v1beta1", "v1alpha1")  # newest first: each reader takes the first it knows
MAX_ATTRIBUTES = 32  # Device.attributes' maxProperties


def pod_claim_name(annotations: Any) -> str | None:
    """The claim's pod-local name, when its annotation is a DNS label (what the resourceclaim
    controller writes, and the schema's format for podClaimName); otherwise None, and the file
    goes under ``resourceclaims/<claimName>``: the annotation is tenant input, and anything else
    in a path could leave the metadata directory."""
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) and limits.is_dns_label(value) else None


def base_request(request: str) -> str:
    return request.split("/", 1)[0]


def container_path(driver: str, claim: PreparedClaim, request: str) -> str:
    """Where the containers read ``request``'s file (metadata.ResourceClaimFilePath and
    ResourceClaimTemplateFilePath)."""
    assert claim.metadata is not None
    pod_name = claim.metadata.pod_claim_name
    where = f"{TEMPLATES_SUBDIR}/{pod_name}" if pod_name else f"{CLAIMS_SUBDIR}/{claim.ref.name}"
    return f"{CONTAINER_DIR}/{where}/{base_request(request)}/{driver}-metadata.json"


def host_path(root: Path, claim_uid: str, request: str) -> Path:
    return Path(host_path_string(root, claim_uid, request))


def host_path_string(root: Path, claim_uid: str, request: str) -> str:
    """:func:`host_path` as a string (built per claim on the prepare path: no path object)."""
    return os.path.join(root, f"{claim_uid}_{base_request(request)}{SUFFIX}")


def claim_uid_of(file_name: str) -> str | None:
    """The claim UID if ``file_name`` is a metadata file's (``<claimUID>_<request>.json``), else None."""
    uid, sep, rest = file_name.partition("_")
    return uid if sep and rest.endswith(SUFFIX) and is_uid(uid) else None


def cdi_device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}_{base_request(request)}"


def cdi_devices(claim: PreparedClaim, driver: str, root: Path) -> list[dict[str, Any]]:
    """The claim spec's metadata devices, one per request: each mounts its file read-only."""
    if claim.metadata is None:
        return []
    return [{"name": cdi_device_name(claim.uid, request), "containerEdits": {"mounts": [
        {"hostPath": host_path_string(root, claim.uid, request),
         "containerPath": container_path(driver, claim, request), "options": ["ro", "bind"]}]}}
        for request in claim.metadata.requests]


def cdi_devices_json(claim: PreparedClaim, driver: str, root: Path) -> list[str]:
    """Each of :func:`cdi_devices` as compact JSON, exactly ``json.dumps``'s (on every prepare)."""
    if claim.metadata is None:
        return []
    return [f'{{"name":{json_string(cdi_device_name(claim.uid, request))},"containerEdits":{{"mounts":[{{'
            f'"hostPath":{json_string(host_path_string(root, claim.uid, request))},'
            f'"containerPath":{json_string(container_path(driver, claim, request))},"options":["ro","bind"]}}]}}}}'
            for request in claim.metadata.requests]


def answer_cdi_ids(claim: PreparedClaim) -> list[tuple[str, ...]]:
    """Each device's CDI IDs for the kubelet: its own, and the metadata device of each request it
    is the first device of (upstream's kubeletplugin does the same: one mount per request)."""
    served: set[str] = set()
    answers = []
    for device in claim.devices:
        ids = [device.cdi_device_id]
        if claim.metadata is not None:
            kind = device.cdi_device_id.partition("=")[0]
            for request in device.requests:
                if request not in served:
                    served.add(request)
                    ids.append(f"{kind}={cdi_device_name(claim.uid, request)}")
        answers.append(tuple(ids))
    return answers


def device_attributes(device: PreparedDevice) -> dict[str, dict[str, str | int | bool]]:
    """The device's attributes in the ResourceSlice format (see the module docstring). Past the
    API's 32, what goes first: capacities, then published attributes; the identity (UUID,
    instance IDs, share) stays."""
    return _attributes(device.attributes, device.uuid, *_instance_ids(device), device.share_id, device.consumed)


def _instance_ids(device: PreparedDevice) -> tuple[int | None, int | None]:
    """(GPU instance ID, compute instance ID) of a dynamic MIG device once prepare created it."""
    if device.mig is not None and device.mig.created:
        assert device.mig.gi is not None and device.mig.ci is not None
        return device.mig.gi, device.mig.ci
    return None, None


def _attributes(attributes: tuple[tuple[str, AttrValue], ...], uuid: str, gi: int | None, ci: int | None,
                share_id: str | None, consumed: tuple[tuple[str, int], ...]) -> dict[str, dict[str, str | int | bool]]:
    identity: dict[str, AttrValue] = {}
    if uuid:  # a dynamic MIG device's is known only once its instance is made
        identity["uuid"] = AttrValue.of_string(uuid)
    if gi is not None and ci is not None:
        identity["gpuInstanceId"] = AttrValue.of_int(gi)
        identity["computeInstanceId"] = AttrValue.of_int(ci)
    if share_id is not None:
        identity["shareID"] = AttrValue.of_string(share_id)
        for name, amount in consumed:
            if name in CAPACITIES:  # the claim names them: only this driver's capacities
                identity[f"consumed{name[:1].upper()}{name[1:]}"] = AttrValue.of_int(amount)
    published = [(n, v) for n, v in attributes if n not in identity and n not in CAPACITIES]
    capacities = [(n, v) for n, v in attributes if n in CAPACITIES]
    kept = [*identity.items(), *published, *capacities][:MAX_ATTRIBUTES]
    return {name: value.to_api() for name, value in sorted(kept, key=lambda item: item[0])}


@lru_cache(maxsize=1024)
def _attributes_json(attributes: tuple[tuple[str, AttrValue], ...], uuid: str, gi: int | None, ci: int | None,
                     share_id: str | None, consumed: tuple[tuple[str, int], ...]) -> str:
    """:func:`device_attributes` as compact JSON, once per device and share: the bulk of each
    file, the same for every claim of the device (its attributes are discovery's tuple)."""
    return json.dumps(_attributes(attributes, uuid, gi, ci, share_id, consumed), separators=(",", ":"))


def _device_json(device: PreparedDevice, driver: str) -> str:
    attributes = _attributes_json(device.attributes, device.uuid, *_instance_ids(device), device.share_id,
                                  device.consumed)
    return (f'{{"driver":{json_string(driver)},"pool":{json_string(device.pool)},"name":{json_string(device.device)},'
            f'"attributes":{attributes}}}')


def metadata_object(claim: PreparedClaim, driver: str, request: str, version: str) -> dict[str, Any]:
    """``request``'s DeviceMetadata in API ``version``: the devices of the claim serving it."""
    assert claim.metadata is not None
    base = base_request(request)
    obj: dict[str, Any] = {
        "kind": "DeviceMetadata", "apiVersion": f"{GROUP}/{version}",
        "metadata": {"name": claim.ref.name, "namespace": claim.ref.namespace, "uid": claim.uid, "generation": 1}}
    if claim.metadata.pod_claim_name:
        obj["podClaimName"] = claim.metadata.pod_claim_name
    obj["requests"] = [{"name": request, "devices": [
        {"driver": driver, "pool": d.pool, "name": d.device, "attributes": device_attributes(d)}
        for d in claim.devices if base in d.requests]}]
    return obj


def encode(claim: PreparedClaim, driver: str, request: str) -> bytes:
    """``request``'s file: the object once per version, newest first, one per line; exactly
    ``json.dumps`` of :func:`metadata_object` (compact), assembled from each device's cached
    attributes. Encoded once: the versions differ in ``apiVersion`` only, its second member."""
    assert claim.metadata is not None
    base = base_request(request)
    head = (f'"metadata":{{"name":{json_string(claim.ref.name)},"namespace":{json_string(claim.ref.namespace)},'
            f'"uid":{json_string(claim.uid)},"generation":1}}')
    if claim.metadata.pod_claim_name:
        head += f',"podClaimName":{json_string(claim.metadata.pod_claim_name)}'
    devices = ",".join(_device_json(d, driver) for d in claim.devices if base in d.requests)
    rest = f'{head},"requests":[{{"name":{json_string(request)},"devices":[{devices}]}}]}}'
    return "".join(f'{{"kind":"DeviceMetadata","apiVersion":"{GROUP}/{version}",{rest}\n'
                   for version in VERSIONS).encode()


def claim_metadata(requests: Iterable[str], pod_claim: str | None) -> ClaimMetadata:
    """The record of a claim prepared with metadata: its requests as allocated, one per request."""
    seen: dict[str, str] = {}
    for request in requests:
        seen.setdefault(base_request(request), request)
    return ClaimMetadata(tuple(seen.values()), pod_claim)


class MetadataFiles:
    """The metadata files in ``root`` (:func:`.cdi.metadata_dir`), each replaced atomically. Those
    an earlier release wrote into ``legacy`` roots (``<plugin-dir>/dra-device-metadata``) are never
    written: they serve the claims it prepared (:meth:`root_of`) and go with them, or as orphans."""

    def __init__(self, root: Path, driver: str, legacy: Sequence[Path] = ()) -> None:
        self.root = root
        self.driver = driver
        self.roots = (root, *legacy)

    def files(self, claim: PreparedClaim, root: Path | None = None) -> list[tuple[str, bytes]]:
        """The claim's files in ``root`` (this release's when None), and their content; the paths
        as strings (built on every prepare: no path objects)."""
        if claim.metadata is None:
            return []
        where = self.root if root is None else root
        return [(host_path_string(where, claim.uid, r), encode(claim, self.driver, r))
                for r in claim.metadata.requests]

    def write(self, claim: PreparedClaim) -> None:
        for path, content in self.files(claim):
            try:
                write_atomic(path, content)
            except FileNotFoundError:  # the node's first claim (or the first since a reboot): the directory
                self.root.mkdir(parents=True, exist_ok=True)
                write_atomic(path, content)

    def holds(self, claim: PreparedClaim, root: Path | None = None) -> bool:
        """True when every file of the claim in ``root`` (this release's when None) holds what its
        record says."""
        try:
            return all(Path(path).read_bytes() == content for path, content in self.files(claim, root))
        except OSError:
            return False

    def root_of(self, claim: PreparedClaim) -> Path | None:
        """Where the claim's files are as recorded: this release's directory, else an earlier
        release's (a claim it prepared keeps its files there, and its spec mounting them, until it
        is unprepared); None when they are in neither."""
        return next((root for root in self.roots if self.holds(claim, root)), None)

    def remove(self, claim_uids: Collection[str]) -> dict[str, OSError]:
        """The claims' files (whichever requests they are of, in whichever root), found in one
        listing however many claims go: an unprepare of many claims stays linear. Claim UID -> why
        some of its files are still there."""
        wanted = set(claim_uids)
        if not wanted:
            return {}
        try:
            names = self._names()
        except OSError as error:
            return dict.fromkeys(wanted, error)
        failed: dict[str, OSError] = {}
        for root, name in names:
            uid = name.partition("_")[0]
            if uid in wanted and claim_uid_of(name) == uid:
                try:
                    (root / name).unlink(missing_ok=True)
                except OSError as error:
                    failed.setdefault(uid, error)
        return failed

    def claim_uids(self) -> set[str]:
        return {uid for uid in (claim_uid_of(name) for _, name in self._names()) if uid}

    def remove_temp_files(self) -> int:
        """Temp files of writes a crash interrupted (``.<file>.tmp-<pid>``)."""
        temps = [(root, n) for root, n in self._names() if n.startswith(".") and TEMP_MARK in n]
        for root, name in temps:
            (root / name).unlink(missing_ok=True)
        return len(temps)

    def remove_empty_legacy_roots(self) -> None:
        """An earlier release's directory once its last claim is gone (start-up)."""
        for root in self.roots[1:]:
            try:
                root.rmdir()
            except OSError:  # not there, or still holding a claim's files
                pass

    def _names(self) -> list[tuple[Path, str]]:
        names = []
        for root in self.roots:
            try:
                names += [(root, name) for name in os.listdir(root)]
            except FileNotFoundError:
                pass
        return names
