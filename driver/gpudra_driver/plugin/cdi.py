"""CDI specs: one JSON file per prepared claim in the CDI directory.

Kind ``k8s.<driver>/claim`` (``k8s.gpu.gpudra.io/claim`` for the default driver), device names
``<claimUID>-<device>`` so two claims never define the same CDI device (the CDI cache drops both
definitions of a duplicate), file ``k8s.<driver>-claim_<claimUID>.json`` (CDI's
``GenerateTransientSpecName``). Each spec is whole: the claim's device nodes, and the driver's user
space (libraries, binaries, firmware, IPC sockets, control nodes, hooks; see
:mod:`gpudra_driver.plugin.driverfiles`) as spec-wide edits. One file per claim, rather than a
node-wide common spec plus per-claim ones, keeps a prepare one atomic write with one CDI device ID
per device, and pins each claim to the driver files it was prepared with. A claim prepared with
device metadata has one more device per request, ``<claimUID>_<request>``, which mounts its
metadata file (:mod:`.devicemetadata`). ``cdiVersion`` is the lowest version that accepts the content
(:func:`minimum_version`, the rules of the CDI library's ``MinimumRequiredVersion``), because a
runtime vendoring an older CDI library rejects versions it does not know.

:func:`cdi_spec` is pure; :class:`CdiDir` writes and removes the files atomically.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from json.encoder import encode_basestring_ascii as json_string  # json.dumps(str), without its dispatch
from pathlib import Path
from typing import Any

from gpudra_driver.plugin import devicemetadata
from gpudra_driver.plugin.driverfiles import DriverFiles, DriverFilesCache, device_node
from gpudra_driver.plugin.fsutil import TEMP_MARK, remove, write_atomic
from gpudra_driver.plugin.sharing.mps import plan as mps
from gpudra_driver.plugin.model import MPS, PreparedClaim

CDI_CLASS = "claim"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


def cdi_vendor(driver: str) -> str:
    return f"k8s.{driver}"


def cdi_kind(driver: str) -> str:
    return f"{cdi_vendor(driver)}/{CDI_CLASS}"


def cdi_device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def cdi_device_id(driver: str, claim_uid: str, device: str) -> str:
    return f"{cdi_kind(driver)}={cdi_device_name(claim_uid, device)}"


def metadata_dir(cdi_dir: Path, driver: str) -> Path:
    """Where the claims' device metadata files go: a directory of the driver's own in the CDI
    directory, beside the specs that mount them (CDI's scan reads no subdirectory)."""
    return cdi_dir / f"{cdi_vendor(driver)}{devicemetadata.DIR_SUFFIX}"


def spec_file_name(driver: str, claim_uid: str) -> str:
    return f"{cdi_vendor(driver)}-{CDI_CLASS}_{claim_uid}.json"


def claim_uid_of(driver: str, file_name: str) -> str | None:
    """The claim UID if ``file_name`` is one of this driver's specs, else None."""
    prefix, suffix = f"{cdi_vendor(driver)}-{CDI_CLASS}_", ".json"
    if file_name.startswith(prefix) and file_name.endswith(suffix) and len(file_name) > len(prefix) + len(suffix):
        return file_name[len(prefix):-len(suffix)]
    return None


def cdi_spec(claim: PreparedClaim, driver: str, files: DriverFiles,
             mps_edits: dict[str, Any] | None = None, metadata_root: Path | None = None) -> dict[str, Any]:
    """The CDI spec for a prepared claim with at least one device, on a node with ``files``.

    Device edits: the device's own nodes. Spec-wide edits (applied once whenever any device of the
    spec is injected): the driver's files and control nodes (:func:`driverfiles.common_edits`), and
    ``NVIDIA_VISIBLE_DEVICES`` listing the claim's GPU/MIG UUIDs when every device serves the same
    requests. Otherwise a container may be given only some of the claim's devices (it references
    one request of the claim), so each device carries the UUIDs of the devices serving exactly its
    requests instead: the variable never names a GPU the container was not given. ``mps_edits``:
    the claim's MPS daemon's pipe and shm directories (:func:`.mps.cdi_edits`), spec-wide too.
    ``metadata_root``: where the claim's device metadata files are, if it has them."""
    if not claim.devices:
        raise ValueError(f"claim {claim.uid} has no devices: no CDI spec to write")
    keys = [tuple(sorted(d.requests)) for d in claim.devices]
    groups: dict[tuple[str, ...], list[str]] = {}
    for key, d in zip(keys, claim.devices):
        groups.setdefault(key, []).append(d.uuid)
    per_device = len(groups) > 1
    devices = []
    for key, d in zip(keys, claim.devices):
        edits: dict[str, Any] = {"deviceNodes": [device_node(p, files.device_root) for p in d.device_nodes]}
        if per_device:
            edits["env"] = [_visible(groups[key])]
        devices.append({"name": cdi_device_name(claim.uid, d.device), "containerEdits": edits})
    if claim.metadata is not None:
        if metadata_root is None:
            raise ValueError(f"claim {claim.uid} has device metadata and no directory for its files is known")
        devices += devicemetadata.cdi_devices(claim, driver, metadata_root)
    common = dict(files.edits)
    if not per_device:
        common["env"] = [_visible([d.uuid for d in claim.devices]), *common["env"]]
    if mps_edits:
        common["env"] = [*common["env"], *mps_edits["env"]]
        common["mounts"] = [*common.get("mounts", []), *mps_edits["mounts"]]
    spec: dict[str, Any] = {"cdiVersion": "", "kind": cdi_kind(driver), "devices": devices, "containerEdits": common}
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def encode_spec(claim: PreparedClaim, driver: str, files: DriverFiles,
                mps_edits: dict[str, Any] | None = None, metadata_root: Path | None = None) -> bytes:
    """``json.dumps(cdi_spec(...))``, compact, with a newline: the file's bytes. The spec-wide
    edits, most of a spec and the same for every claim, are encoded once per driver-files view,
    and each device's own once per device (a claim with MPS adds its own edits to them, and is
    encoded whole); ``cdiVersion`` is :func:`minimum_version` of the same content."""
    if mps_edits:
        return (json.dumps(cdi_spec(claim, driver, files, mps_edits, metadata_root),
                           separators=(",", ":")) + "\n").encode()
    if not claim.devices or len({tuple(sorted(d.requests)) for d in claim.devices}) > 1:
        spec = cdi_spec(claim, driver, files, metadata_root=metadata_root)  # per-device env (or the error)
        common = spec.pop("containerEdits")  # the last member, "env" its first (common_edits' order)
        head = json.dumps(spec, separators=(",", ":"))[:-1]
    else:  # every device serves the same requests: each device's edits are its nodes', encoded once
        skeleton: list[dict[str, Any]] = []
        devices: list[str] = []
        for d in claim.devices:
            edits, edits_json = _node_edits(d.device_nodes, files.device_root)
            name = cdi_device_name(claim.uid, d.device)
            skeleton.append({"name": name, "containerEdits": edits})
            devices.append(f'{{"name":{json_string(name)},"containerEdits":{edits_json}}}')
        if claim.metadata is not None:
            if metadata_root is None:
                raise ValueError(f"claim {claim.uid} has device metadata and no directory for its files is known")
            # Their mounts have no type and their names start as the devices' do (the claim's
            # UID; this branch has at least one device): they never raise the version, so the
            # skeleton goes without them.
            devices += devicemetadata.cdi_devices_json(claim, driver, metadata_root)
        kind = cdi_kind(driver)
        version = minimum_version({"kind": kind, "devices": skeleton, "containerEdits": files.edits})
        head = f'{{"cdiVersion":{json_string(version)},"kind":{json_string(kind)},"devices":[{",".join(devices)}]'
        common = {"env": [_visible([d.uuid for d in claim.devices]), *files.edits["env"]]}
    env = json.dumps(common["env"], separators=(",", ":"))
    return f'{head},"containerEdits":{{"env":{env}{files.edits_json_after_env}}}}}\n'.encode()


@lru_cache(maxsize=1024)
def _node_edits(paths: tuple[str, ...], device_root: str) -> tuple[dict[str, Any], str]:
    """A device's edits (its nodes) and their compact JSON, once per device and driver root.
    Shared by every spec: read them, never change them."""
    edits = {"deviceNodes": [device_node(p, device_root) for p in paths]}
    return edits, json.dumps(edits, separators=(",", ":"))


def _visible(uuids: list[str]) -> str:
    return f"{VISIBLE_DEVICES_ENV}={','.join(uuids)}"


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest CDI spec version whose schema accepts ``spec`` (CDI ``MinimumRequiredVersion``)."""
    devices = spec.get("devices") or []
    edits = [d.get("containerEdits") or {} for d in devices] + [spec.get("containerEdits") or {}]
    rdt = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]  # any intelRdt counts, even {}
    if any(e.get("netDevices") for e in edits) or any(
            r.get("schemata") is not None or r.get("enableMonitoring") for r in rdt):
        return "1.1.0"
    if rdt or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    kind_class = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in kind_class:
        return "0.6.0"
    if any(d.get("name", "a")[:1] and not d["name"][0].isalpha() for d in devices) or any(
            n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


class CdiDir:
    """This driver's spec files in one CDI directory (other files there are never touched)."""

    def __init__(self, path: Path, driver: str, files: DriverFilesCache, mps_root: Path | None = None,
                 metadata_root: Path | None = None, legacy_metadata_roots: tuple[Path, ...] = ()) -> None:
        self.path = path
        self.driver = driver
        self.files = files
        self.mps_root = mps_root  # <plugin-dir>/mps: where MPS claims' daemons keep their directories
        # the metadata files (:func:`metadata_dir`; None: no claim gets them), and where earlier
        # releases put them (removed with their claims)
        self.metadata_root = metadata_root
        self.legacy_metadata_roots = legacy_metadata_roots

    def spec_path(self, claim_uid: str) -> Path:
        return self.path / spec_file_name(self.driver, claim_uid)

    def content(self, claim: PreparedClaim, metadata_root: Path | None = None) -> bytes:
        """The claim's spec, mounting its metadata files from ``metadata_root`` (:attr:`metadata_root`
        when None)."""
        # Compact: with an indent, json.dumps falls back to its pure-Python encoder, on the
        # kubelet's critical path (`jq . <spec>` pretty-prints it).
        mps_edits = None
        if self.mps_root is not None and any(d.sharing.strategy == MPS for d in claim.devices):
            mps_edits = mps.cdi_edits(self.mps_root, claim.uid)
        return encode_spec(claim, self.driver, self.files.current(), mps_edits, metadata_root or self.metadata_root)

    def write(self, claim: PreparedClaim) -> Path:
        """Write the claim's spec atomically (an existing one is replaced whole), after checking
        that every device node it names exists: a spec with a missing node would fail the
        container, so the claim fails with a retryable :class:`DriverFilesError` instead."""
        self.files.check_device_nodes([p for d in claim.devices for p in d.device_nodes])
        path, content = self.spec_path(claim.uid), self.content(claim)
        try:
            write_atomic(path, content)
        except FileNotFoundError:  # no directory yet, e.g. /var/run/cdi on a fresh tmpfs
            self.path.mkdir(parents=True, exist_ok=True)  # (a file in its place fails here)
            write_atomic(path, content)
        return path

    def matches(self, claim: PreparedClaim, metadata_root: Path | None = None) -> bool:
        """True when the claim's spec on disk is exactly what the checkpoint says it should be
        (mounting its metadata files from ``metadata_root``, :attr:`metadata_root` when None)."""
        try:
            return self.spec_path(claim.uid).read_bytes() == self.content(claim, metadata_root)
        except OSError:  # DriverFilesError included: rewriting it reports the reason
            return False

    def device_names(self, claim_uid: str) -> list[str] | None:
        """The devices a spec of ours names (``<claimUID>-<device>``); None when it cannot be read."""
        try:
            devices = json.loads(self.spec_path(claim_uid).read_bytes()).get("devices") or []
            names = [d.get("name") for d in devices]
        except (OSError, ValueError, AttributeError, TypeError):
            return None
        prefix = cdi_device_name(claim_uid, "")
        return [n[len(prefix):] for n in names if isinstance(n, str) and n.startswith(prefix) and n != prefix]

    def exists(self, claim_uid: str) -> bool:
        return self.spec_path(claim_uid).is_file()

    def remove(self, claim_uid: str) -> bool:
        return remove(self.spec_path(claim_uid))

    def claim_uids(self) -> set[str]:
        """UIDs of the claims that have a spec of ours in the directory."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return set()
        return {uid for uid in (claim_uid_of(self.driver, n) for n in names) if uid}

    def remove_temp_files(self) -> int:
        """Temp files left by a write interrupted by a crash (``.<spec>.tmp-<pid>``)."""
        prefix = f".{cdi_vendor(self.driver)}-{CDI_CLASS}_"
        count = 0
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return 0
        for name in names:
            if name.startswith(prefix) and f".json{TEMP_MARK}" in name:
                count += remove(self.path / name)
        return count
