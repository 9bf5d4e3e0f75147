"""The crash-safe record of which claims this node has prepared.

State machine per claim (keyed by claim UID)::

    (absent) --prepare--> PrepareStarted --CDI spec written--> PrepareCompleted --unprepare--> (absent)
                                |                                                          ^
                                +--- failure, or rollback (at start, or by a live peer) ---+

The file is JSON: ``{"version", "checksum", "bootID", "claims": {uid: {"state", "namespace",
"name", "devices"}}}``, plus ``"adopted": {uid: [[pool, device], ...]}`` when a corrupt checkpoint
was set aside: claims whose CDI spec was kept for running containers without an entry (nothing
else about them survived), with the devices their spec names; kept until unprepared; and
``"adoptedNames": {uid: [namespace, name]}`` for those whose name the agent that adopted them knew
(for the leak sweep; an older agent drops it, which only keeps those claims until unprepared).
``checksum`` is ``sha256:<hex>`` over the canonical JSON of everything else, so a torn or
hand-edited file is detected. ``bootID`` is the node's
``/proc/sys/kernel/random/boot_id`` when it was written: after a reboot no container holds a
prepared device any more (and the kubelet prepares again), so an old boot's checkpoint is void.

Transitions and :func:`reconcile` are pure; :class:`CheckpointFile` is the file I/O.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from json.encoder import encode_basestring_ascii as json_string  # json.dumps(str), without its dispatch
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpudra_driver.plugin import fsutil
from gpudra_driver.plugin.model import EXCLUSIVE, PreparedClaim, PreparedDevice

log = logging.getLogger(__name__)

# The file's version is the lowest whose readers keep all of its content, as a CDI spec's is:
# 2 when it holds adoptions or admin-access devices, which an agent reading only version 1 would
# drop on its next write (it would then hand a monitored GPU, or a kept spec's GPU, to a second
# claim); 3 when it holds shared devices (consumable capacity: share IDs and consumed capacity);
# 4 when it holds dynamic MIG devices, whose instances an older agent would never destroy;
# 5 when it holds claims prepared with device metadata (KEP-5304), whose specs an older agent would
# rewrite without the metadata mounts the kubelet was answered (a restarting container would fail).
# Such an agent refuses the file instead: a downgrade with them needs them unprepared.
VERSION = 5
READS = (1, 2, 3, 4, 5)
STARTED = "PrepareStarted"
COMPLETED = "PrepareCompleted"
STATES = (STARTED, COMPLETED)
# The scratch file a save writes (:meth:`CheckpointFile.scratch`): the name earlier agents gave
# theirs, so every version since treats it as disposable.
SCRATCH_SUFFIX = "scratch-volatile"


class CheckpointError(Exception):
    """The checkpoint cannot be used as it is (corrupt, or written by a newer agent)."""


class NewerCheckpoint(CheckpointError):
    """Written by a newer agent: not corrupt, and not this agent's to rewrite."""


@dataclass(frozen=True)
class Entry:
    state: str
    claim: PreparedClaim

    @cached_property
    def canonical(self) -> str:
        """``"<uid>":{...}``, this entry's member of the canonical ``claims`` object: computed once
        per entry, as every save encodes them all. The claim's part is the claim's own cached
        canonical JSON (unchanged from PrepareStarted to PrepareCompleted); ``state`` sorts after
        all of its keys, so it goes last."""
        body = self.claim.canonical_json
        return f'{json_string(self.claim.uid)}:{body[:-1]},"state":{json_string(self.state)}}}'

    @cached_property
    def admin_access(self) -> bool:
        return any(device.admin_access for device in self.claim.devices)

    @cached_property
    def shares_gpus(self) -> bool:
        """Some device is shared (TimeSlicing, MPS): only then may the entry ask anything of its
        GPUs' settings or need an MPS daemon. Cached: every step of a prepare scans the entries."""
        return any(device.sharing.strategy != EXCLUSIVE for device in self.claim.devices)

    @cached_property
    def version(self) -> int:
        """The lowest checkpoint version whose readers keep this entry whole."""
        if self.claim.metadata is not None:
            return 5
        if any(device.mig is not None or device.mig_mode_off is not None for device in self.claim.devices):
            return 4
        if any(device.needs_version_3 for device in self.claim.devices):
            return 3
        return 2 if self.admin_access else 1


@dataclass(frozen=True)
class Checkpoint:
    boot_id: str
    claims: Mapping[str, Entry] = field(default_factory=lambda: MappingProxyType({}))
    # claim UID -> the (pool, device) pairs its kept spec names (see the module docstring)
    adopted: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=lambda: MappingProxyType({}))
    # adopted claim UID -> (namespace, name), where known: what the leak sweep looks it up by
    adopted_names: Mapping[str, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))
    # UUIDs of GPUs whose sharing settings the agent changed and has not put back yet: recorded
    # before a change, dropped once the defaults are back (see gpusettings), so a crash or a failed
    # reset anywhere leaves the reset for the next start to do.
    touched: frozenset[str] = frozenset()

    # -- transitions (pure: each returns a new Checkpoint) ------------------------------------
    def touching(self, uuids: Iterable[str]) -> Checkpoint:
        more = self.touched | set(uuids)
        return self if more == self.touched else replace(self, touched=frozenset(more))

    def untouched(self, uuids: Iterable[str]) -> Checkpoint:
        fewer = self.touched - set(uuids)
        return self if fewer == self.touched else replace(self, touched=frozenset(fewer))

    def adopting(self, specs: Mapping[str, Iterable[tuple[str, str]]]) -> Checkpoint:
        """Record kept specs (claim UID -> the (pool, device) pairs each names), replacing what
        was recorded for them; a completed claim needs none."""
        kept = {uid: tuple(pairs) for uid, pairs in specs.items()
                if uid not in self.claims or self.claims[uid].state != COMPLETED}
        if not kept:
            return self
        return replace(self, adopted=MappingProxyType({**self.adopted, **kept}))

    def naming(self, names: Mapping[str, tuple[str, str]]) -> Checkpoint:
        """Record the (namespace, name) of adopted claims (a UID names one object forever)."""
        known = {uid: (namespace, name) for uid, (namespace, name) in names.items() if uid in self.adopted}
        if not known:
            return self
        return replace(self, adopted_names=MappingProxyType({**self.adopted_names, **known}))

    def started(self, claim: PreparedClaim) -> Checkpoint:
        """An adopted claim prepared again stays adopted until its prepare completes: a rollback
        keeps its spec."""
        return self._with(claim.uid, Entry(STARTED, claim))

    def completed(self, uid: str) -> Checkpoint:
        entry = self.claims[uid]
        return self._with(uid, Entry(COMPLETED, entry.claim))

    def without(self, *uids: str) -> Checkpoint:
        """Unprepared: entries and adoptions go."""
        return replace(self.rolled_back(*uids), adopted=self._adopted_without(uids),
                       adopted_names=self._names_without(uids))

    def rolled_back(self, *uids: str) -> Checkpoint:
        """Half-done prepares undone: their entries go, adoptions stay."""
        return replace(self, claims=MappingProxyType({u: e for u, e in self.claims.items() if u not in uids}))

    def _with(self, uid: str, entry: Entry) -> Checkpoint:
        completed = entry.state == COMPLETED
        adopted = self._adopted_without((uid,)) if completed else self.adopted
        names = self._names_without((uid,)) if completed else self.adopted_names
        after = Checkpoint(self.boot_id, MappingProxyType({**self.claims, uid: entry}), adopted, names, self.touched)
        if "_owners" in self.__dict__ and uid not in self.claims and uid not in self.adopted:
            owners = dict(self._owners)  # keep the index, not rebuild it
            _add_holders(owners, uid, entry)
            after.__dict__["_owners"] = owners
        return after

    def possible_devices(self, uid: str) -> tuple[tuple[str, str], ...]:
        """What an adopted claim's spec may name while a prepare of it is half done: the devices
        adopted and those being prepared (its spec may have been rewritten), sorted."""
        entry = self.claims.get(uid)
        prepared = [(d.pool, d.device) for d in entry.claim.devices] if entry else []
        return tuple(sorted({*self.adopted.get(uid, ()), *prepared}))

    def _adopted_without(self, uids: Iterable[str]) -> Mapping[str, tuple[tuple[str, str], ...]]:
        if not self.adopted or not any(uid in self.adopted for uid in uids):
            return self.adopted
        return MappingProxyType({u: pairs for u, pairs in self.adopted.items() if u not in uids})

    def _names_without(self, uids: Iterable[str]) -> Mapping[str, tuple[str, str]]:
        if not self.adopted_names or not any(uid in self.adopted_names for uid in uids):
            return self.adopted_names
        return MappingProxyType({u: n for u, n in self.adopted_names.items() if u not in uids})

    # -- queries ------------------------------------------------------------------------------
    def completed_count(self) -> int:
        return sum(1 for entry in self.claims.values() if entry.state == COMPLETED)

    @cached_property
    def changes_gpus(self) -> bool:
        """Some claim asks for GPU settings (TimeSlicing), holds a dynamic MIG instance or a dynamic
        MIG GPU whole, or some GPU still has settings: changing the checkpoint may mean calls into
        the driver."""
        return bool(self.touched) or any(e.shares_gpus or any(d.mig is not None or d.mig_mode_off is not None
                                                              for d in e.claim.devices)
                                         for e in self.claims.values())

    @cached_property
    def half_done(self) -> tuple[str, ...]:
        """The claims in PrepareStarted, sorted. Found by a reader holding the node lock, they are
        a crashed instance's: a prepare holds the lock from its PrepareStarted write to its commit."""
        return tuple(sorted(uid for uid, entry in self.claims.items() if entry.state == STARTED))

    def device_owner(self, pool: str, device: str) -> str | None:
        """A claim UID holding ``device`` (in either state), if any; admin access holds nothing."""
        holders = self._owners.get((pool, device))
        return holders[0][0] if holders else None

    def device_holders(self, pool: str, device: str) -> tuple[Holder, ...]:
        """Every claim holding ``device`` (in either state), with what it holds (None: an adopted
        claim's kept spec, which holds the whole device); admin access holds nothing."""
        return self._owners.get((pool, device), ())

    @cached_property
    def _owners(self) -> dict[tuple[str, str], tuple[Holder, ...]]:
        """(pool, device) -> its holders, built once per checkpoint (planning asks for every device
        of every claim of a batch) and carried over by :meth:`started`."""
        owners: dict[tuple[str, str], tuple[Holder, ...]] = {}
        for uid, pairs in self.adopted.items():  # a kept spec's devices stay held until unprepared
            for pair in pairs:
                owners[pair] = (*owners.get(pair, ()), (uid, None))
        for uid, entry in self.claims.items():
            _add_holders(owners, uid, entry)
        return owners

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Checkpoint) and self.boot_id == other.boot_id
                and dict(self.claims) == dict(other.claims) and dict(self.adopted) == dict(other.adopted)
                and dict(self.adopted_names) == dict(other.adopted_names) and self.touched == other.touched)


# A device's holder: the claim UID and its device entry (None for an adopted claim's kept spec).
Holder = tuple[str, "PreparedDevice | None"]


def _add_holders(owners: dict[tuple[str, str], tuple[Holder, ...]], uid: str, entry: Entry) -> None:
    for device in entry.claim.devices:
        if not device.admin_access:
            key = (device.pool, device.device)
            owners[key] = (*owners.get(key, ()), (uid, device))


# -- encoding ----------------------------------------------------------------------------------

def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode(checkpoint: Checkpoint) -> bytes:
    # Exactly _canonical() of {("adopted",) ("adoptedNames",) "bootID", "claims", ("touched",)
    # "version"}, assembled from each entry's cached canonical JSON (keys in sorted order: adopted
    # < adoptedNames < bootID < claims < touched < version;
    # claims by UID), because the commit of every prepare encodes the whole checkpoint on the
    # kubelet's critical path. "adopted" only when there are any: other files stay as they were.
    entries = checkpoint.claims
    claims = ",".join([entries[uid].canonical for uid in sorted(entries)])
    adopted = ""
    if checkpoint.adopted:
        adopted = '"adopted":' + _canonical({u: [list(p) for p in pairs] for u, pairs in checkpoint.adopted.items()}).decode() + ","
    if checkpoint.adopted_names:
        adopted += '"adoptedNames":' + _canonical({u: list(n) for u, n in checkpoint.adopted_names.items()}).decode() + ","
    version = max([3 if checkpoint.touched else 2 if checkpoint.adopted else 1,
                   *(entry.version for entry in entries.values())])
    touched = f'"touched":{json.dumps(sorted(checkpoint.touched), separators=(",", ":"))},' if checkpoint.touched else ""
    canonical = (f'{{{adopted}"bootID":{json.dumps(checkpoint.boot_id)},"claims":{{{claims}}},'
                 f'{touched}"version":{version}}}').encode()
    checksum = "sha256:" + hashlib.sha256(canonical).hexdigest()
    # The checksum spliced in front of the canonical body. Readers re-canonicalise the body, so
    # key order in the file does not matter; `jq .` pretty-prints it.
    return b'{"checksum":' + json.dumps(checksum).encode() + b"," + canonical[1:] + b"\n"


def decode(data: bytes) -> Checkpoint:
    """Parse and verify; raises :class:`CheckpointError` naming what is wrong."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"not JSON: {error}") from None
    if not isinstance(doc, dict):
        raise CheckpointError("not a JSON object")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"no valid version ({version!r})")  # torn or hand-edited: corrupt
    if version not in READS:
        raise NewerCheckpoint(f"version {version!r}; this agent reads versions up to {VERSION} "
                              "(downgrading an agent with prepared claims needs them unprepared first)")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    expected = "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()
    if doc.get("checksum") != expected:
        raise CheckpointError(f"checksum mismatch (file says {doc.get('checksum')!r})")
    try:
        claims = {}
        for uid, raw in doc["claims"].items():
            if raw["state"] not in STATES:
                raise CheckpointError(f"claim {uid}: unknown state {raw['state']!r}")
            claims[uid] = Entry(raw["state"], PreparedClaim.from_json(uid, raw))
        touched = doc.get("touched") or []
        if not isinstance(touched, list) or not all(isinstance(u, str) for u in touched):
            raise CheckpointError(f"touched: {touched!r} is not a list of GPU UUIDs")
        adopted = _adopted_from_json(doc.get("adopted") or {})
        return Checkpoint(str(doc["bootID"]), MappingProxyType(claims), adopted,
                          _adopted_names_from_json(doc.get("adoptedNames") or {}, adopted), frozenset(touched))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise CheckpointError(f"malformed content: {error!r}") from None


def _adopted_from_json(raw: Any) -> Mapping[str, tuple[tuple[str, str], ...]]:
    def pair(item: Any) -> tuple[str, str]:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise CheckpointError(f"adopted: {item!r} is not a [pool, device] pair")
        return item[0], item[1]

    if not isinstance(raw, dict) or not all(isinstance(pairs, list) for pairs in raw.values()):
        raise CheckpointError("adopted: not an object of claim UID -> [[pool, device], ...]")
    return MappingProxyType({uid: tuple(pair(item) for item in pairs) for uid, pairs in raw.items()})


def _adopted_names_from_json(raw: Any, adopted: Mapping[str, Any]) -> Mapping[str, tuple[str, str]]:
    if not isinstance(raw, dict) or not all(
            isinstance(n, list) and len(n) == 2 and all(isinstance(x, str) for x in n) for n in raw.values()):
        raise CheckpointError("adoptedNames: not an object of claim UID -> [namespace, name]")
    return MappingProxyType({uid: (n[0], n[1]) for uid, n in raw.items() if uid in adopted})


# -- reconciliation (pure) -----------------------------------------------------------------------

@dataclass(frozen=True)
class Reconciliation:
    checkpoint: Checkpoint
    remove_specs: tuple[str, ...]  # claim UIDs whose CDI spec must go
    rewrite_specs: tuple[PreparedClaim, ...]  # completed claims whose spec is missing
    rolled_back: tuple[str, ...]  # half-done prepares undone

    @property
    def changed(self) -> bool:
        return bool(self.remove_specs or self.rewrite_specs or self.rolled_back)


def reconcile(checkpoint: Checkpoint, spec_uids: Iterable[str]) -> Reconciliation:
    """Make the checkpoint and the CDI directory agree, after a crash or a reboot.

    * PrepareStarted: the kubelet never got an answer; roll back (entry and any spec go). It will
      call again and get a fresh prepare.
    * PrepareCompleted without its spec: roll forward, rewrite it (the kubelet believes the claim
      is prepared; containers that restart need the spec).
    * an adopted claim's spec (kept when a corrupt checkpoint was set aside) stays, even when a
      prepare of it was half done (it then holds the devices of both, until its spec is read
      again: the prepare may have rewritten it); an adopted claim whose spec is gone is forgotten;
    * a spec of ours without a completed entry and not adopted: an orphan, removed.
    """
    on_disk = set(spec_uids)
    started = checkpoint.half_done
    completed = {u: e for u, e in checkpoint.claims.items() if e.state == COMPLETED}
    remove = tuple(sorted(u for u in on_disk if u not in completed and u not in checkpoint.adopted))
    rewrite = tuple(e.claim for u, e in sorted(completed.items()) if u not in on_disk and e.claim.devices)
    kept = checkpoint.rolled_back(*started).adopting(
        {u: checkpoint.possible_devices(u) for u in started if u in checkpoint.adopted})
    vanished = [u for u in kept.adopted if u not in on_disk]
    return Reconciliation(kept.without(*vanished), remove, rewrite, started)


# -- file I/O --------------------------------------------------------------------------------------

class CheckpointFile:
    """The checkpoint file: read (with a cache of its last decoded content) and replaced atomically.

    Decoding and verifying is O(prepared claims), so what this instance last read or wrote is
    reused while the file holds exactly its bytes (reading them is cheap; another agent
    instance's write changes them). Callers hold the node lock."""

    def __init__(self, path: Path, boot_id: str) -> None:
        self.path = path
        self.boot_id = boot_id
        self.prepared_count = 0  # completed claims in the checkpoint last read or written (a metric)
        self._cached: tuple[bytes, Checkpoint] | None = None

    def load(self) -> Checkpoint:
        """The checkpoint on disk; an empty one when there is none or it is from an earlier boot
        (logged). A corrupt file or a newer version raises :class:`CheckpointError`."""
        data = fsutil.read_file(self.path)
        if data is not None and self._cached is not None and self._cached[0] == data:
            return self._cached[1]
        self._cached = None
        checkpoint, problem = (Checkpoint(self.boot_id), None) if data is None else parse(data, self.boot_id)
        if problem:
            log.warning("%s", problem)
        if data is not None and not problem:
            self._cached = (data, checkpoint)
        self.prepared_count = checkpoint.completed_count()
        return checkpoint

    def save(self, checkpoint: Checkpoint) -> None:
        """Replace the file atomically (a scratch file exchanged with it; see :mod:`.fsutil` for
        why, and for why no fsync)."""
        self._cached = None
        data = encode(checkpoint)
        fsutil.write_exchanging(self.path, data, self.scratch, mode=0o600)
        self._cached = (data, checkpoint)
        self.prepared_count = checkpoint.completed_count()

    @property
    def scratch(self) -> Path:
        """The file each save writes and then exchanges with the checkpoint."""
        return self.path.with_name(f".{self.path.name}.{SCRATCH_SUFFIX}")

    def load_unlocked(self, attempts: int = 5) -> Checkpoint:
        """:meth:`load` for a caller without the node lock (a periodic task): a read that races a
        save may see the file that save is overwriting (:func:`.fsutil.write_exchanging`), which
        fails its checksum; it is read again. A file still corrupt after ``attempts`` raises."""
        for attempt in range(attempts):
            try:
                return self.load()
            except NewerCheckpoint:
                raise
            except CheckpointError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    @property
    def last(self) -> Checkpoint | None:
        """The checkpoint last read or written, without reading the file again; None if unknown."""
        return self._cached[1] if self._cached is not None else None

    @property
    def is_cached(self) -> bool:
        """The file holds a checkpoint this boot can use, as last read or written."""
        return self._cached is not None

    def leftovers(self) -> list[Path]:
        """Files of the checkpoint's writers that a crash may have left half-written."""
        return [self.path.parent / n for n in os.listdir(self.path.parent) if is_leftover(n, self.path.name)]


def is_leftover(name: str, checkpoint_name: str) -> bool:
    """A temp file of an interrupted write, or a scratch file (this agent's, which a crash may have
    left half-written; earlier agents' kept two)."""
    prefix = f".{checkpoint_name}."
    return name.startswith(prefix + fsutil.TEMP_MARK[1:]) or name in {prefix + "scratch-durable", prefix + SCRATCH_SUFFIX}


def load(path: Path, boot_id: str) -> tuple[Checkpoint, str | None]:
    """The checkpoint at ``path`` (see :func:`parse`); a missing file is an empty checkpoint."""
    data = fsutil.read_file(path)
    return (Checkpoint(boot_id), None) if data is None else parse(data, boot_id)


def parse(data: bytes, boot_id: str) -> tuple[Checkpoint, str | None]:
    """The checkpoint in ``data`` and, when it had to be discarded (an earlier boot's), why. A
    corrupt file or a newer version raises."""
    checkpoint = decode(data)
    if checkpoint.boot_id != boot_id:
        return Checkpoint(boot_id), (f"checkpoint is from boot {checkpoint.boot_id}, this is boot {boot_id}: "
                                     f"discarding {len(checkpoint.claims)} claim(s) prepared before the reboot")
    return checkpoint, None


def read_boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    return path.read_text().strip()
