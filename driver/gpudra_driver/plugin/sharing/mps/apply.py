"""The agent's side of the MPS daemons (I/O): the spec files the MPS supervisor converges on, and
its answer (:mod:`gpudra_driver.plugin.sharing.mps.supervisor`). Called under the node lock, off the event loop
(the calls block on the supervisor, which waits only for the claims named in the call: another
claim's slow daemon does not hold the node lock). A call that only stops daemons (an unprepare, a
rollback) waits at most :data:`STOP_TIMEOUT`: the supervisor kills them at once, so their exit,
not their tenants, bounds it; the GPUs go back to ``DEFAULT`` only after it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpudra_driver import metrics
from gpudra_driver.plugin.fsutil import remove, write_atomic
from gpudra_driver.plugin.model import PreparedClaim, is_uid
from gpudra_driver.plugin.sharing.mps.plan import (KILL_WAIT, READY, SPEC_FILE, STATUS_FILE, SUPERVISOR_SOCKET,
                                                   DaemonSpec, daemons_by_state, restarts_since)
from gpudra_driver.plugin.sockets import SocketAddress

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 30.0  # seconds: starting a daemon and setting its limits, inside the kubelet's 45 s
# seconds for the supervisor to stop daemons (no start in the call): SIGKILL, at most KILL_WAIT for
# them to go, then their two tmpfs unmounted and their directories removed. Waited under the node lock.
STOP_TIMEOUT = KILL_WAIT + 5.0


class MpsUnavailable(OSError):
    """The supervisor cannot be reached or did not answer."""


class MpsDaemons:
    def __init__(self, root: Path, timeout: float = SYNC_TIMEOUT, stop_timeout: float = STOP_TIMEOUT) -> None:
        self.root = root  # <plugin-dir>/mps
        self.timeout = timeout  # a call that starts a daemon
        self.stop_timeout = min(stop_timeout, timeout)  # a call that only stops daemons

    def present(self) -> dict[str, bytes]:
        """Claim UID -> the spec file's bytes, for every spec on disk."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return {}
        specs = {}
        for uid in names:
            if is_uid(uid):
                try:
                    specs[uid] = (self.root / uid / SPEC_FILE).read_bytes()
                except (FileNotFoundError, NotADirectoryError):
                    continue
        return specs

    def converge(self, wanted: Mapping[str, DaemonSpec], keep: Collection[str] = ()) -> dict[str, str]:
        """Make the spec files ``wanted``, leaving those of ``keep`` (claims adopted from a corrupt
        checkpoint: their pods still hold their daemons) as they are, and, when that changed
        anything, have the supervisor converge those claims. Returns claim UID -> why, for each
        wanted daemon that is not running (the supervisor unreachable included). A call that starts
        no daemon waits at most :attr:`stop_timeout` for the stops. Daemons no longer wanted only
        have their spec removed when the supervisor cannot be reached: it stops them when it is
        back."""
        present = self.present()
        added = {uid: spec for uid, spec in wanted.items() if present.get(uid) != spec.encode()}
        removed = [uid for uid in present if uid not in wanted and uid not in keep]
        for uid in removed:
            remove(self.root / uid / SPEC_FILE)
        for uid, spec in added.items():
            (self.root / uid).mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / uid / SPEC_FILE, spec.encode())
        if not added and not removed:
            return {}
        try:
            statuses = self.sync([*added, *removed], self.timeout if added else self.stop_timeout)
        except MpsUnavailable as error:
            if removed:
                log.warning("MPS daemons of claim(s) %s: %s; it stops them when it is back", removed, error)
            return {uid: str(error) for uid in added}
        problems = {}
        for uid in added:
            status = statuses.get(uid) or {}
            if status.get("state") != READY:
                problems[uid] = f"its MPS control daemon is not running: {status.get('message') or 'no status'}"
        return problems

    def sync(self, claims: Sequence[str] = (), timeout: float | None = None) -> dict[str, Mapping[str, Any]]:
        """The supervisor's converge, now, waiting for ``claims`` only, at most ``timeout`` seconds
        in all (None: :attr:`timeout`); claim UID -> status."""
        path = self.root / SUPERVISOR_SOCKET
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline))
            with SocketAddress(path) as address:
                sock.connect(address.address)
            sock.settimeout(_left(deadline))
            sock.sendall(json.dumps({"sync": True, "claims": list(claims)}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                sock.settimeout(_left(deadline))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (FileNotFoundError, ConnectionRefusedError):
            raise MpsUnavailable(f"the MPS supervisor is not running on this node (no one listens on {path}; "
                                 "is spec.sharing.mps set in the GpuDraConfig?)") from None
        except OSError as error:  # a timeout included
            raise MpsUnavailable(f"the MPS supervisor did not answer on {path}: {error}") from None
        finally:
            sock.close()
        try:
            reply = json.loads(data)
            return dict(reply["daemons"])
        except (ValueError, KeyError, TypeError):
            raise MpsUnavailable(f"the MPS supervisor answered {data[:200]!r}") from None

    def statuses(self) -> dict[str, Mapping[str, Any] | None]:
        """Claim UID -> the supervisor's last status of its daemon (its status file; None: none
        yet, or unreadable), for every spec on disk. No call: the files are read."""
        statuses: dict[str, Mapping[str, Any] | None] = {}
        for uid in self.present():
            try:
                status = json.loads((self.root / uid / STATUS_FILE).read_bytes())
            except (OSError, ValueError):
                status = None
            statuses[uid] = status if isinstance(status, dict) else None
        return statuses

    def restarts(self) -> dict[str, int]:
        """Claim UID -> how often its daemon was restarted, from the supervisor's status files (no call)."""
        return restarts_of(self.statuses())


def restarts_of(statuses: Mapping[str, Mapping[str, Any] | None]) -> dict[str, int]:
    counts = {}
    for uid, status in statuses.items():
        try:
            counts[uid] = int((status or {}).get("restarts") or 0)
        except (ValueError, TypeError):
            continue
    return counts


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` (time.monotonic); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


CHECK_INTERVAL = 5.0  # seconds between looks at the daemons' status files


async def watch_daemons(daemons: MpsDaemons, claims: Callable[[], Sequence[PreparedClaim]],
                        report: Callable[[str, str, str], Awaitable[None]],
                        interval: float = CHECK_INTERVAL) -> None:
    """Every ``interval`` seconds, the daemons as the supervisor's status files say: their count
    by state (``gpudra_agent_mps_daemons``) and, whenever the supervisor restarted a claim's
    daemon, ``gpudra_agent_mps_daemon_restarts_total`` and a Warning Event (on the Node: the agent
    writes events nowhere else): the claim's processes lost their MPS server and must start again."""
    seen: dict[str, int] | None = None  # restart counts the Events have covered
    counted: dict[str, int] | None = None  # ... and the counter: an Event that failed is posted again, not counted
    while True:
        try:
            statuses = await asyncio.to_thread(daemons.statuses)
            metrics.mps_daemons(daemons_by_state(statuses))
            counts = restarts_of(statuses)
            if counted is not None:
                metrics.mps_daemons_restarted(sum(restarts_since(counts, counted).values()))
            counted = counts
            if seen is not None:
                await _report_new(counts, seen, claims, report)
            seen = counts
        except Exception:  # noqa: BLE001 (a corrupt checkpoint, an API error: the agent goes on, recovering in place)
            log.exception("looking at the MPS daemons failed; trying again in %gs", interval)
        await asyncio.sleep(interval)


async def _report_new(counts: Mapping[str, int], seen: Mapping[str, int],
                      claims: Callable[[], Sequence[PreparedClaim]],
                      report: Callable[[str, str, str], Awaitable[None]]) -> None:
    new = restarts_since(counts, seen)
    if not new:
        return
    names = {c.uid: c.ref for c in claims()}
    for uid in new:
        count = counts[uid]
        claim = names.get(uid)
        what = f"ResourceClaim {claim.namespace}/{claim.name} (UID {uid})" if claim else f"claim {uid}"
        await report("Warning", "MPSDaemonRestarted",
                     f"the MPS control daemon of {what} exited and was started again (restart {count}, "
                     "limits set again); processes that were using it lost their MPS server and must "
                     "be restarted")
