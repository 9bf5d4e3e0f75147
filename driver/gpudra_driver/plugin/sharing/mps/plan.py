"""MPS control daemons: which ones the checkpoint asks for, and what each looks like (pure).

A claim whose devices are shared with strategy MPS gets one control daemon of its own
(``nvidia-cuda-mps-control``) serving exactly its GPUs (``CUDA_VISIBLE_DEVICES``), with its own
directories under the plugin directory, ``<plugin-dir>/mps/<claimUID>/``:

* ``pipe``: the daemon's control socket; a small tmpfs the supervisor mounts (``nosymfollow``,
  :mod:`gpudra_driver.plugin.sharing.mps.mounts`), mounted into the claim's containers at ``/tmp/nvidia-mps``, the
  path ``CUDA_MPS_PIPE_DIRECTORY`` names for them;
* ``shm``: the daemon's and the clients' ``/dev/shm``, where the MPS server and its clients meet:
  a tmpfs the supervisor mounts, of the size the claim's GpuConfig asks (``sharing.mps.shmSize``,
  at most the platform's ``spec.sharing.mps.maxShmSize``) or else the platform's default
  (``spec.sharing.mps.shmSize``, :data:`DEFAULT_SHM_SIZE`): bounded, and never on the kubelet's disk;
* ``log``: ``control.log`` and ``server.log``;
* ``supervisor/`` (beside the claims' directories, not in them): the supervisor's own records of
  the daemons it started. The ``pipe`` and ``shm`` directories are mounted read-write into the
  claim's containers, so nothing in them is trusted;
* ``daemon.json``: what the daemon must be (:class:`DaemonSpec`), written by the agent and read by
  the MPS supervisor (:mod:`gpudra_driver.plugin.sharing.mps.supervisor`), which runs the daemons outside the
  agent's container so that they outlive it (docs/sharing.md, "MPS").

Like the GPU settings (:mod:`.gpusettings`), the daemons are derived from the checkpoint, so a
rollback, an unprepare or a start-up after a crash converges them the same way: the claims of the
checkpoint (PrepareStarted ones too) with MPS devices, nothing else.

The limits go to the daemon as its defaults (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``), so every MPS server it starts for the claim's
processes enforces them; a process cannot lift them by changing its environment. A claim holding a
share of a GPU (consumable capacity) gets the share it was granted as its limits: its consumed
memory caps its pinned memory, and that memory's part of the GPU is its active thread percentage,
unless its config asks for less.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudra_core.agentcontract import MPS_SUPERVISOR_SOCKET as SUPERVISOR_SOCKET  # in the MPS root
from gpudra_driver.plugin.model import MPS, PreparedClaim

ROOT = "mps"  # under the plugin directory
CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the MPS clients' default CUDA_MPS_PIPE_DIRECTORY
SPEC_FILE = "daemon.json"  # in a claim's directory: written by the agent
STATUS_FILE = "status.json"  # in a claim's directory: written by the supervisor
# A daemon's state in the supervisor's status file (its ``state``).
READY, STARTING, FAILED = "Ready", "Starting", "Failed"
DAEMON_STATES = (READY, STARTING, FAILED)
# Seconds the supervisor waits for a daemon it killed (SIGKILL, with its process group) to go: a stop's
# bound, which the agent waits for under its node lock (one stuck in the driver may never go).
KILL_WAIT = 5.0
MIB = 2**20
# A claim's /dev/shm: what containerd, CRI-O and Docker give a container's /dev/shm (64 MiB), so a
# workload gets no less with MPS than without. MPS itself needs little of it.
DEFAULT_SHM_SIZE = 64 * MIB
# The most a claim may ask for (GpuConfig sharing.mps.shmSize) unless the platform team says otherwise
# (spec.sharing.mps.maxShmSize): the pages count against the writer's memory limit, but a claim
# whose pods set none would otherwise size the tmpfs by the node's memory.
DEFAULT_MAX_SHM_SIZE = 1024 * MIB


@dataclass(frozen=True)
class DaemonSpec:
    """One claim's control daemon: the GPUs it serves (UUIDs, the order of CUDA_VISIBLE_DEVICES),
    its default active thread percentage (None: MPS's own, 100) and pinned memory limits per GPU
    (UUID -> MiB; absent: none), and the size of its /dev/shm tmpfs in bytes (None: the
    supervisor's default)."""

    claim_uid: str
    gpus: tuple[str, ...]
    active_thread_percentage: int | None = None
    pinned_memory_mib: tuple[tuple[str, int], ...] = ()
    shm_size: int | None = None

    def commands(self) -> list[str]:
        """The control commands that set the limits (nvidia-cuda-mps-control's stdin, a line each)."""
        lines = []
        if self.active_thread_percentage is not None:
            lines.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        lines += [f"set_default_device_pinned_mem_limit {uuid} {mib}M" for uuid, mib in self.pinned_memory_mib]
        return lines

    def to_json(self) -> dict[str, Any]:
        data = {"claimUID": self.claim_uid, "gpus": list(self.gpus),
                "activeThreadPercentage": self.active_thread_percentage,
                "pinnedMemoryMiB": dict(self.pinned_memory_mib)}
        if self.shm_size is not None:  # only when set: a spec without it stays byte-identical
            data["shmBytes"] = self.shm_size
        return data

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: Any) -> DaemonSpec:
        if not isinstance(data, dict):
            raise ValueError(f"{data!r} is not a daemon spec")
        gpus, percentage, pinned = data.get("gpus"), data.get("activeThreadPercentage"), data.get("pinnedMemoryMiB")
        if not isinstance(data.get("claimUID"), str) or not isinstance(gpus, list) or not gpus \
                or not all(isinstance(g, str) and g for g in gpus):
            raise ValueError("claimUID and a non-empty list of GPU UUIDs (gpus) are required")
        if percentage is not None and (type(percentage) is not int or not 1 <= percentage <= 100):
            raise ValueError(f"activeThreadPercentage {percentage!r} is not an integer between 1 and 100")
        if not isinstance(pinned, dict) or not all(k in gpus and type(v) is int and v > 0 for k, v in pinned.items()):
            raise ValueError(f"pinnedMemoryMiB {pinned!r} is not a map of its GPUs to a positive number of MiB")
        shm = data.get("shmBytes")
        if shm is not None and (type(shm) is not int or not 0 < shm < 2**63):
            raise ValueError(f"shmBytes {shm!r} is not a positive number of bytes")
        return cls(data["claimUID"], tuple(gpus), percentage, tuple(sorted(pinned.items())), shm)


def daemon_for(claim: PreparedClaim) -> DaemonSpec | None:
    """The daemon ``claim`` asks for; None when none of its devices is shared with MPS. Planning
    (:mod:`.prepare`) has checked that its MPS devices agree on one thread percentage."""
    devices = [d for d in claim.devices if d.sharing.strategy == MPS and not d.admin_access]
    if not devices:
        return None
    percentages = {p for d in devices if (p := d.sharing.active_thread_percentage) is not None}
    pinned = tuple(sorted((d.uuid, math.ceil(d.sharing.pinned_memory_limit / MIB))
                          for d in devices if d.sharing.pinned_memory_limit is not None))
    # one /dev/shm per claim: the largest its requests' configs ask for (the supervisor bounds it)
    shm = max((size for d in devices if (size := d.sharing.shm_size) is not None), default=None)
    return DaemonSpec(claim.uid, tuple(d.uuid for d in devices), min(percentages) if percentages else None, pinned,
                      shm)


def wanted(claims: Mapping[str, PreparedClaim]) -> dict[str, DaemonSpec]:
    """Claim UID -> its daemon, for every claim that asks for one."""
    return {uid: spec for uid, claim in claims.items() if (spec := daemon_for(claim)) is not None}


def share_limits(consumed_memory: int, device_memory: int) -> tuple[int, int]:
    """(pinned memory limit in bytes, active thread percentage) of a claim holding a share of a
    GPU: what it was granted, its memory, and that memory's part of the GPU's (rounded up, at
    least 1%)."""
    part = consumed_memory / device_memory if device_memory else 1.0
    return consumed_memory, max(1, min(100, math.ceil(part * 100)))


def claim_dir(root: Path, claim_uid: str) -> Path:
    """``root``: ``<plugin-dir>/mps``; ``claim_uid`` must be checked (ClaimRef.check) by the caller."""
    return root / claim_uid


def cdi_edits(root: Path, claim_uid: str) -> dict[str, Any]:
    """The claim's containers' edits: the pipe directory where the clients look for it, and the
    daemon's /dev/shm (host paths: the plugin directory is the same path on the host)."""
    base = claim_dir(root, claim_uid)
    return {"env": [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIRECTORY}"],
            "mounts": [{"hostPath": str(base / "pipe"), "containerPath": CONTAINER_PIPE_DIRECTORY,
                        "options": ["rbind", "rw", "nosuid", "nodev"]},
                       {"hostPath": str(base / "shm"), "containerPath": "/dev/shm",
                        "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]}]}  # as runtimes mount /dev/shm


def daemons_by_state(statuses: Mapping[str, Mapping[str, Any] | None]) -> dict[str, int]:
    """State -> how many of the daemons (claim UID -> its status, None: none yet) are in it, every
    state present. A daemon the supervisor has not reported on (or in a state it never writes) is
    Starting: its spec is there, so it is on its way."""
    counts = dict.fromkeys(DAEMON_STATES, 0)
    for status in statuses.values():
        state = status.get("state") if status is not None else None
        counts[state if state in counts else STARTING] += 1
    return counts


def restarts_since(counts: Mapping[str, int], seen: Mapping[str, int]) -> dict[str, int]:
    """Claim UID -> restarts of its daemon since ``seen`` (both claim UID -> restart count), for
    the claims whose count went up; a claim not in ``seen`` had none before."""
    return {uid: count - seen.get(uid, 0) for uid, count in counts.items() if count > seen.get(uid, 0)}
