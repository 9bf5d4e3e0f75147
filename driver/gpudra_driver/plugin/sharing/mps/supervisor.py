"""The MPS supervisor: runs the MPS control daemons that prepared claims ask for, outside the agent.

An MPS control daemon must outlive the agent that asked for it: the claim's containers keep using
it through an agent restart and a DaemonSet rolling update. A process the agent starts dies with
the agent's container (its PID namespace and cgroup go with it), so the daemons run here, in a
DaemonSet of their own (``gpudra-mps-<config>``) that is not rolled with the agent
(``updateStrategy: OnDelete``) and does nothing but this: no API access, no kubelet socket, and
of the plugin directory only ``mps/``.

The desired state is files: the agent writes ``<plugin-dir>/mps/<claimUID>/daemon.json``
(:class:`gpudra_driver.plugin.sharing.mps.plan.DaemonSpec`) and removes it; this process converges on them:

* a spec without a running daemon: the claim's ``pipe`` directory becomes a small tmpfs
  (``nosymfollow``; emptied when it already is one) and its ``shm`` directory a tmpfs of the spec's
  size (the claim's ``/dev/shm``), both bounded in bytes and inodes and charged to the memory of
  whoever writes them, not to the kubelet's disk (:mod:`gpudra_driver.plugin.sharing.mps.mounts`); then
  ``nvidia-cuda-mps-control -f`` from the driver root, with
  ``CUDA_VISIBLE_DEVICES`` the claim's GPUs and the claim's pipe and log directories; ready once
  its control socket answers; then the limits, through the control socket;
* a running daemon without a spec (the claim was unprepared, or rolled back): killed at once with
  its process group (the MPS servers it started), its tmpfs mounts unmounted and its directory
  removed;
* a spec that changed: the daemon is killed so too, and started again with the new spec, in the same
  directories (the claim's containers hold its mounts);
* a daemon that died while its claim is prepared: started again with its limits (counted in
  ``restarts``, which the agent turns into an Event on the claim), after a backoff that doubles
  from :data:`RESTART_BACKOFF` to :data:`MAX_RESTART_BACKOFF` seconds while it keeps dying young.

Each claim converges on its own (a task per pass, one pass of a claim at a time), so a claim whose
daemon is slow to start or stop, or whose tenant answers on its control socket and never says
more, delays no other claim; a failure in one claim's pass fails that claim only. It converges
every :data:`TICK` seconds and whenever the agent asks (``supervisor.sock``, one JSON line each way:
``{"sync": true, "claims": [uid, ...]}`` -> ``{"daemons": {uid: status}}``, once the named claims'
passes are done, at most :data:`SYNC_WAIT` seconds).

**A daemon is stopped by SIGKILL, never by ``quit``.** Its control socket may be the tenant's
(below), so a ``quit`` could wait for an answer that never comes, or be answered while the daemon
stays; and the agent waits for the stop under its node lock (an unprepare: the GPUs go back to
``DEFAULT`` only after it), so that wait must not be the tenant's to choose. A graceful ``quit``
would buy nothing: a claim is unprepared only once the kubelet has stopped every
container using it, so no client is left; a rolled-back prepare never had containers; and a daemon
restarted for a changed spec takes the claim's MPS server from its clients either way (MPS clients
cannot reconnect, and ``quit`` waits for them to exit). The kill goes through the daemon's pidfd:
it is stopped first (so it starts no server meanwhile), then every process below it, its process
group and itself are killed (:func:`~gpudra_driver.plugin.sharing.mps.processes.kill_group`), and the stop
waits at most :data:`KILL_TIMEOUT` for it to go: what the agent waits for is bounded by the
process's exit, not by the tenant.

**The pipe and shm directories belong to the tenant.** They are mounted read-write into the
claim's containers, whose processes may run as root: anything in them (the daemon's PID file, its
control socket, a symlink) may be forged. So the supervisor takes no decision from them:

* it keeps its own record of each daemon it starts, in :data:`STATE_DIR` (``mps/supervisor/``,
  mode 0700, never mounted into a container): PID, start time (``/proc/<pid>/stat`` field 22) and
  executable (:mod:`gpudra_driver.plugin.sharing.mps.processes`), written before the daemon's program runs (the
  helper that execs it waits for the record), so no daemon runs unrecorded. A supervisor started
  again in place (possible where it is not a container of its own, e.g. in the local cluster)
  adopts a running daemon only if the record matches the process now behind that PID and names
  the control daemon's executable, and signals a process only through a pidfd opened on it and
  checked against the record: a reused PID, or a PID a tenant wrote down, is never hit;
* the pipe directory is mounted ``nosymfollow`` (and the daemon's ``/dev/shm`` bound so in a mount
  namespace of its own), so a symlink a tenant plants (``control`` pointing at another claim's
  socket, the PID file at a file of the supervisor's) is not followed;
* a (re)started daemon gets an emptied pipe directory: what a tenant left there goes, removed
  without recursion (a bounded tmpfs holds at most :data:`~gpudra_driver.plugin.sharing.mps.mounts.PIPE_INODES`).
  The tenant's containers still mount it and may keep writing into it, so the emptying stops
  after :data:`EMPTY_OPS` operations or :data:`EMPTY_TIMEOUT` seconds and that start fails; each
  claim's filesystem work runs in a thread of its own (:func:`in_thread`), so no claim waits for
  another's;
* what a control client prints is read up to :data:`CLIENT_OUTPUT_LIMIT` bytes (the control
  socket may be the tenant's daemon, answering at any length); more kills it and fails the call;
* the daemon's environment (the driver root's ``LD_LIBRARY_PATH``) is handed to the exec helper
  with its "go" and applied only to the control daemon, never to the helper's own Python.

What a tenant can still do is its own claim's business: quit its daemon (the supervisor starts it
again, and the agent reports it), or answer the supervisor's limit commands with a daemon of its
own on the control socket, which escapes its own claim's limits and nobody else's (docs/sharing.md,
"What it isolates").

``--isolate-shm`` (the DaemonSet sets it) gives each daemon the claim's ``shm`` tmpfs as its
``/dev/shm``: the MPS server it starts and the claim's containers (which get the same tmpfs at
``/dev/shm`` through CDI) must share it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudra_driver.plugin.sharing.mps.mounts import (PIPE_INODES, PIPE_SIZE, VIEW_FAILED, empty_directory, helper_command,
                                     mount_tmpfs, remove_tree, shm_inodes, unmount)
from gpudra_driver.plugin.fsutil import remove, write_atomic
from gpudra_driver.plugin.model import is_uid
from gpudra_driver.plugin.sharing.mps.plan import (DEFAULT_MAX_SHM_SIZE, DEFAULT_SHM_SIZE, FAILED, KILL_WAIT, READY,
                                      SPEC_FILE, STARTING, STATUS_FILE, SUPERVISOR_SOCKET, DaemonSpec)
from gpudra_driver.plugin.sockets import SocketAddress
from gpudra_driver.plugin.sharing.mps.processes import ProcessRecord, exited, kill_group, observe, open_recorded, wait_exited
from gpudra_core.quantity import format_quantity, parse_quantity

log = logging.getLogger(__name__)

STATE_DIR = "supervisor"  # under the MPS root: this process's own records, one <claimUID>.json per daemon
TICK = 1.0  # seconds between liveness checks
READY_TIMEOUT = 20.0  # seconds for a started daemon to answer on its control socket
CLIENT_TIMEOUT = 10.0  # seconds for one nvidia-cuda-mps-control client call
KILL_TIMEOUT = KILL_WAIT  # seconds for a killed daemon to go (one stuck in the driver may never)
SYNC_WAIT = 25.0  # seconds a sync waits for the claims it names: inside the agent's 30 s
RESTART_BACKOFF = 5.0  # seconds from a daemon's start to its restart, doubled per death before ...
STABLE_AFTER = 60.0  # ... it ran this long
MAX_RESTART_BACKOFF = 300.0
LEFTOVER_AGE = 60.0  # seconds a directory without a spec or a daemon is left to the agent writing it
MAX_SYNC_CLAIMS = 4096  # claim UIDs in one sync request
EMPTY_OPS = 8 * PIPE_INODES  # scans and removals to empty a claim's pipe tmpfs: a full one takes fewer
EMPTY_TIMEOUT = 5.0  # seconds to empty a claim's pipe directory, whatever it is
CLIENT_OUTPUT_LIMIT = 64 * 2**10  # bytes a control client call may print: more fails the call


def shm_size_of(spec: DaemonSpec, default: int, bound: int) -> int:
    """The size of the claim's /dev/shm tmpfs: what its config asks (``sharing.mps.shmSize``), or
    the platform's ``default``; ValueError naming the field and the bound when it asks for more
    than ``bound``. Checked here, where the tmpfs is mounted: the agent does not know the bound."""
    if spec.shm_size is None:
        return default
    if spec.shm_size > bound:
        raise ValueError(f"sharing.mps.shmSize: {format_quantity(spec.shm_size, binary=True)} is more than "
                         f"{format_quantity(bound, binary=True)}, the most an MPS claim may ask for "
                         "(spec.sharing.mps.maxShmSize of the GpuDraConfig)")
    return spec.shm_size


def restart_at(started_at: float, noticed_at: float, failures: int) -> tuple[float, int]:
    """(when to start a dead daemon again, its count of deaths in a row): at once after one that
    ran :data:`STABLE_AFTER` seconds; else :data:`RESTART_BACKOFF` after its start, doubled per
    earlier death in a row, at most :data:`MAX_RESTART_BACKOFF`."""
    if noticed_at - started_at >= STABLE_AFTER:
        return noticed_at, 0
    return started_at + min(MAX_RESTART_BACKOFF, RESTART_BACKOFF * 2.0 ** min(failures, 16)), failures + 1


@dataclass
class Daemon:
    spec: DaemonSpec
    pid: int | None = None
    pidfd: int | None = None  # on the daemon, ours or adopted: every signal goes through it
    process: asyncio.subprocess.Process | None = None  # ours, started by this process: reaped by asyncio
    state: str = STARTING
    message: str = ""
    restarts: int = 0
    started_at: float = 0.0
    failures: int = 0  # deaths in a row, each soon after its start
    retry_at: float | None = None  # when a dead daemon is started again

    def alive(self) -> bool:
        return self.pidfd is not None and not exited(self.pidfd)

    def forget(self) -> None:
        """Drop the handle on the process (gone, or to be started again)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.process, self.pidfd, self.pid = None, None, None

    async def killed(self) -> bool:
        """SIGKILL, through the pidfd (never to a PID's later owner), with its process group: the
        MPS servers it started. Whether it has gone within :data:`KILL_TIMEOUT`."""
        if self.pidfd is None or self.pid is None:
            return True
        kill_group(self.pidfd, self.pid)
        return await wait_exited(self.pidfd, KILL_TIMEOUT)

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts, "message": self.message}


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a thread of its own, not in asyncio's shared executor: one claim's
    filesystem work (a tenant racing the emptying of its pipe directory, a mount that blocks)
    never waits for, or makes wait, another claim's. Each claim runs one pass at a time, so there
    are at most as many such threads as claims."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result, error = function(*args), None
        except BaseException as raised:  # noqa: BLE001 (handed to the awaiting task)
            result, error = None, raised
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=work, name=f"mps-{getattr(function, '__name__', 'work')}", daemon=True).start()
    return await done


class OutputTooLong(Exception):
    """A control client printed more than its limit (its control socket may be the tenant's)."""


async def _limited_output(process: asyncio.subprocess.Process, data: bytes, limit: int) -> bytes:
    """Write ``data`` to the process's stdin, close it, and read its stdout (stderr joined to it)
    to its end and its exit: at most ``limit`` bytes held, OutputTooLong beyond (a reply as long
    as a tenant's fake daemon likes would otherwise fill this process's memory)."""
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(data)
        await process.stdin.drain()
    except ConnectionError:  # it exited without reading: its output and status say why
        pass
    process.stdin.close()
    out = bytearray()
    while chunk := await process.stdout.read(64 * 2**10):
        out += chunk
        if len(out) > limit:
            raise OutputTooLong
    await process.wait()
    return bytes(out)


async def _discard_and_wait(process: asyncio.subprocess.Process) -> None:
    """The exit of a killed process whose output is read no more: what is left of it is dropped."""
    if process.stdout is not None:
        while await process.stdout.read(64 * 2**10):
            pass
    await process.wait()


def _failed(message: str) -> dict[str, Any]:
    return {"state": FAILED, "pid": None, "restarts": 0, "message": message}


@dataclass
class Supervisor:
    root: Path  # <plugin-dir>/mps
    control: Path  # nvidia-cuda-mps-control, as this process sees it
    library_dir: Path | None = None  # the driver root's library directory, for the daemon's loader
    isolate_shm: bool = False
    shm_size: int = DEFAULT_SHM_SIZE  # bytes: a claim's /dev/shm, unless its spec says otherwise
    max_shm_size: int = DEFAULT_MAX_SHM_SIZE  # bytes: the most a claim's spec may ask for
    daemons: dict[str, Daemon] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}  # claim UID -> held by its pass
        self._queued: dict[str, asyncio.Task[None]] = {}  # claim UID -> its next pass, not begun
        self._tasks: set[asyncio.Task[None]] = set()
        self._statuses: dict[str, dict[str, Any]] = {}
        self._first_seen: dict[str, float] = {}  # directory without a spec -> when first seen (monotonic)

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    # -- the loop -----------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        path = self.root / SUPERVISOR_SOCKET
        path.unlink(missing_ok=True)
        with SocketAddress(path) as address:  # a deep plugin directory: bound through /proc/self/fd
            server = await asyncio.start_unix_server(self._answer, path=address.address)
        log.info("MPS supervisor on %s (control daemon %s)", path, self.control)
        try:
            while not stop.is_set():
                try:
                    await self.converge()
                except Exception:  # noqa: BLE001 (listing the root failed: the next tick tries again)
                    log.exception("MPS supervisor pass failed")
                try:
                    await asyncio.wait_for(stop.wait(), TICK)
                except TimeoutError:
                    pass
        finally:
            server.close()
            path.unlink(missing_ok=True)
            for task in list(self._tasks):
                task.cancel()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), CLIENT_TIMEOUT) or b"{}")
            claims = request.get("claims", []) if isinstance(request, dict) else None
            if not isinstance(request, dict) or request.get("sync") is not True or not isinstance(claims, list) \
                    or len(claims) > MAX_SYNC_CLAIMS or not all(isinstance(u, str) and is_uid(u) for u in claims):
                reply: dict[str, Any] = {"error": "expected {\"sync\": true, \"claims\": [claim UID, ...]}"}
            else:  # an agent that names no claims (an older one) waits for all, as it did
                reply = {"daemons": await self.converge(claims if "claims" in request else None)}
        except (ValueError, TimeoutError) as error:
            reply = {"error": f"bad request: {error}"}
        writer.write(json.dumps(reply).encode() + b"\n")
        try:
            await writer.drain()
        finally:
            writer.close()

    async def converge(self, wait_for: Iterable[str] | None = ()) -> dict[str, dict[str, Any]]:
        """A pass over every claim (each its own task); once those of ``wait_for`` (None: all)
        are done, at most :data:`SYNC_WAIT` seconds, every claim's status. A claim still
        converging then is Starting, whatever it was before."""
        claims = self._claims()
        waited = claims if wait_for is None else set(wait_for)
        passes = {uid: self._schedule(uid) for uid in sorted(claims | waited)}
        pending: set[asyncio.Task[None]] = set()
        if waited:
            _, pending = await asyncio.wait([passes[uid] for uid in waited], timeout=SYNC_WAIT)
        statuses = dict(self._statuses)
        for uid in waited:
            if passes[uid] in pending:
                statuses[uid] = {**statuses.get(uid, _failed("")), "state": STARTING,
                                 "message": f"its daemon is still converging after {SYNC_WAIT:g}s"}
        return statuses

    def _claims(self) -> set[str]:
        """Every claim with something to converge: a directory, a record, a daemon."""
        try:
            dirs = {n for n in os.listdir(self.root) if is_uid(n)}
        except FileNotFoundError:
            dirs = set()
        return dirs | set(self._recorded()) | set(self.daemons)

    def _schedule(self, uid: str) -> asyncio.Task[None]:
        """The claim's next pass: one not yet begun (it reads the spec when it begins), or a new one."""
        task = self._queued.get(uid)
        if task is None:
            task = self._queued[uid] = asyncio.create_task(self._pass(uid), name=f"mps-claim-{uid}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    async def _pass(self, uid: str) -> None:
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            del self._queued[uid]  # begun: a request from now on may have changed the spec, and gets a pass of its own
            try:
                status = await self._converge_claim(uid)
            except Exception as error:  # noqa: BLE001 (one claim's failure is that claim's: never the supervisor's)
                log.exception("MPS claim %s: its pass failed", uid)
                status = _failed(f"the MPS supervisor failed on this claim: {error!r}")
            if status is None:
                self._statuses.pop(uid, None)
            else:
                self._statuses[uid] = status
                self._write_status(uid, status)
        if uid not in self._queued and uid not in self.daemons and not lock.locked():
            self._locks.pop(uid, None)

    async def _converge_claim(self, uid: str) -> dict[str, Any] | None:
        """One claim: its daemon as its spec says (None: it has none, nothing to report)."""
        spec, problem = self._spec(uid)
        daemon = self.daemons.get(uid)
        if problem is not None:
            if daemon is not None:
                await self._stop(uid, self.daemons.pop(uid), remove=False)
            return _failed(problem)
        if spec is None:
            if daemon is not None:
                await self._stop(uid, self.daemons.pop(uid))
            elif self._leftover(uid):
                await self._stop_leftover(uid)
            else:
                return None
            self._first_seen.pop(uid, None)
            return None
        self._first_seen.pop(uid, None)
        if daemon is not None and daemon.spec != spec:
            log.info("MPS claim %s: its daemon spec changed; starting its daemon again with it", uid)
            await self._stop(uid, daemon, remove=False)  # the directories stay: the claim's containers hold them
            daemon = self.daemons[uid] = Daemon(spec, restarts=daemon.restarts)
            await self._start(uid, daemon)
        elif daemon is None:
            daemon = self.daemons[uid] = Daemon(spec)
            await self._start(uid, daemon)
        elif not daemon.alive():
            now = time.monotonic()
            if daemon.retry_at is None:
                daemon.retry_at, daemon.failures = restart_at(daemon.started_at, now, daemon.failures)
            if now >= daemon.retry_at:
                daemon.restarts += 1
                log.warning("MPS control daemon of claim %s (PID %s) is gone; starting it again (restart %d)",
                            uid, daemon.pid, daemon.restarts)
                await self._start(uid, daemon)
            elif daemon.state != FAILED:
                daemon.state, daemon.message = STARTING, f"the daemon (PID {daemon.pid}) exited; restarting " \
                                                         f"in {daemon.retry_at - now:.0f}s"
        return daemon.status()

    # -- specs ----------------------------------------------------------------------------------
    def _spec(self, uid: str) -> tuple[DaemonSpec | None, str | None]:
        """The claim's spec (None: none on disk), or why it is not one."""
        path = self.root / uid / SPEC_FILE
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        try:
            spec = DaemonSpec.from_json(json.loads(data))
            if spec.claim_uid != uid:
                raise ValueError(f"claimUID {spec.claim_uid} is not its directory's")
            return spec, None
        except ValueError as error:
            return None, f"{path}: {error}"

    def _leftover(self, uid: str) -> bool:
        """A claim without a spec whose daemon (an earlier supervisor's) is recorded or whose
        directory a daemon ran in, or whose directory has been without a spec for a while; not one
        the agent has just made and is writing the spec into."""
        base = self.root / uid
        if (self.state_dir / f"{uid}.json").exists() or (base / "pipe").exists():
            return True
        if not base.is_dir():
            return False
        now = time.monotonic()
        return now - self._first_seen.setdefault(uid, now) > LEFTOVER_AGE

    def _write_status(self, uid: str, status: Mapping[str, Any]) -> None:
        try:
            write_atomic(self.root / uid / STATUS_FILE, (json.dumps(status, sort_keys=True) + "\n").encode())
        except OSError as error:  # the directory went meanwhile (unprepared), or no room: nothing to report
            log.debug("status of %s not written: %s", uid, error)

    # -- records: which daemons this supervisor (or an earlier one) started ----------------------
    def _recorded(self) -> list[str]:
        try:
            return [n.removesuffix(".json") for n in os.listdir(self.state_dir)
                    if n.endswith(".json") and is_uid(n.removesuffix(".json"))]
        except FileNotFoundError:
            return []

    def _record(self, uid: str) -> ProcessRecord | None:
        try:
            return ProcessRecord.from_json(json.loads((self.state_dir / f"{uid}.json").read_bytes()))
        except FileNotFoundError:
            return None
        except ValueError as error:  # not ours to trust: as if none
            log.warning("MPS daemon record of claim %s is unreadable (%s); ignored", uid, error)
            return None

    def _remember(self, uid: str, record: ProcessRecord) -> None:
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        write_atomic(self.state_dir / f"{uid}.json", (json.dumps(record.to_json(), sort_keys=True) + "\n").encode(),
                     mode=0o600)

    def _forget(self, uid: str) -> None:
        remove(self.state_dir / f"{uid}.json")

    def _adopt(self, uid: str, daemon: Daemon) -> bool:
        """Take over the recorded daemon of ``uid`` if that very process, a control daemon, still runs."""
        record = self._record(uid)
        pidfd = open_recorded(record, str(self.control)) if record is not None else None
        if record is None or pidfd is None:
            return False
        daemon.pidfd, daemon.pid = pidfd, record.pid
        log.info("adopted the running MPS control daemon of claim %s (PID %s, recorded)", uid, record.pid)
        return True

    # -- daemons --------------------------------------------------------------------------------
    def _env(self, uid: str, spec: DaemonSpec | None = None) -> dict[str, str]:
        base = self.root / uid
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        env.update(CUDA_MPS_PIPE_DIRECTORY=str(base / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(base / "log"))
        if spec is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
        if self.library_dir is not None:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(self.library_dir), env.get("LD_LIBRARY_PATH")) if p)
        return env

    def _prepare_dirs(self, uid: str, spec: DaemonSpec) -> None:
        """The claim's directories for a fresh daemon (in a thread: a plain pipe directory an older
        version left may hold anything): an empty pipe tmpfs (nothing a tenant left there
        survives; kept mounted if it is, the claim's containers hold it), the log directory, and
        the shm tmpfs (kept if already mounted: the claim's containers may be using it)."""
        base = self.root / uid
        size = shm_size_of(spec, self.shm_size, self.max_shm_size)
        for name, mode in (("pipe", 0o755), ("log", 0o755), ("shm", 0o1777)):
            (base / name).mkdir(mode=mode, exist_ok=True)
        # a tenant's container has the pipe tmpfs mounted read-write and may keep writing into it:
        # bounded (a full tmpfs takes fewer operations), or this claim's pass would never end
        empty_directory(base / "pipe", max_ops=EMPTY_OPS if os.path.ismount(base / "pipe") else None,
                        deadline=time.monotonic() + EMPTY_TIMEOUT)
        if not os.path.ismount(base / "pipe"):
            mount_tmpfs(base / "pipe", PIPE_SIZE, PIPE_INODES, 0o755, nosymfollow=True)
        os.chmod(base / "log", 0o755)  # mkdir's mode is masked by the umask
        if not os.path.ismount(base / "shm"):
            mount_tmpfs(base / "shm", size, shm_inodes(size), 0o1777)

    async def _start(self, uid: str, daemon: Daemon) -> None:
        daemon.started_at, daemon.retry_at = time.monotonic(), None
        daemon.forget()
        if not self._adopt(uid, daemon):
            self._forget(uid)
            try:
                await in_thread(self._prepare_dirs, uid, daemon.spec)
            except (ValueError, OSError) as error:  # more than the platform allows; a mount refused; a
                # tenant that keeps writing into its pipe directory (EmptyingStopped)
                daemon.state, daemon.message = FAILED, str(error)
                log.error("claim %s: %s", uid, daemon.message)
                return
            problem = await self._spawn(uid, daemon)
            if problem is None:
                problem = await self._wait_ready(uid, daemon)
            if problem is not None:
                daemon.state, daemon.message = FAILED, problem
                log.error("claim %s: %s", uid, problem)
                await self._stop(uid, daemon, remove=False)
                return
        problem = await self._client(uid, daemon.spec.commands()) if daemon.spec.commands() else None
        if problem is not None:
            daemon.state, daemon.message = FAILED, f"setting its limits failed: {problem}"
            log.error("claim %s: %s", uid, daemon.message)
            await self._stop(uid, daemon, remove=False)
            return
        daemon.state, daemon.message = READY, ""
        log.info("MPS control daemon of claim %s ready (PID %s, GPUs %s)", uid, daemon.pid, ",".join(daemon.spec.gpus))

    async def _spawn(self, uid: str, daemon: Daemon) -> str | None:
        """Start the daemon through the helper (:mod:`gpudra_driver.plugin.sharing.mps.mounts`), in a session of its
        own; it runs the control daemon only once this process has recorded it. None, or why not."""
        base = self.root / uid
        command = helper_command(str(self.control), ["-f"], base / "shm" if self.isolate_shm else None)
        try:
            process = await asyncio.create_subprocess_exec(  # the helper's own Python: this process's environment
                *command, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as error:
            return f"starting {self.control} failed: {error}"
        daemon.process, daemon.pid = process, process.pid
        try:
            daemon.pidfd = os.pidfd_open(process.pid)  # our unreaped child: the PID is still its own
            seen = observe(process.pid)
            if seen is None:
                raise OSError(f"the helper (PID {process.pid}) exited at once")
            # what the helper becomes: the same PID and start time, the control daemon's executable
            self._remember(uid, ProcessRecord(seen.pid, seen.start_time, os.path.realpath(self.control)))
            assert process.stdin is not None
            # the daemon's environment (the driver root's libraries) only for the daemon's program
            process.stdin.write(b"go " + json.dumps(self._env(uid, daemon.spec)).encode() + b"\n")
            await process.stdin.drain()
            process.stdin.close()
        except (OSError, ConnectionError) as error:  # ENOSPC on the record included: this claim fails, alone
            if daemon.pidfd is not None:
                kill_group(daemon.pidfd, process.pid)
            return f"starting {self.control} failed: {error}"
        return None

    async def _wait_ready(self, uid: str, daemon: Daemon) -> str | None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not daemon.alive():
                code = await self._exit_status(daemon)
                if code == VIEW_FAILED:
                    return f"the daemon's mount namespace could not be set up (--isolate-shm, {self.root / uid / 'shm'})"
                return f"{self.control} -f exited with {code} before it answered; " \
                       f"see {self.root / uid / 'log' / 'control.log'}"
            if await self._client(uid, ["get_default_active_thread_percentage"]) is None:
                return None
            await asyncio.sleep(0.05)  # polling the control socket: the daemon gives no other signal
        return f"the daemon did not answer on its control socket within {READY_TIMEOUT:g}s"

    @staticmethod
    async def _exit_status(daemon: Daemon) -> int | str:
        if daemon.process is None:
            return "?"
        try:
            return await asyncio.wait_for(daemon.process.wait(), 1.0)
        except TimeoutError:
            return "?"

    async def _client(self, uid: str, commands: list[str], timeout: float = CLIENT_TIMEOUT) -> str | None:
        """Run control commands; None when every one succeeded, else what failed. The pipe
        directory follows no symlink: a planted ``control`` link reaches no other daemon."""
        try:
            process = await asyncio.create_subprocess_exec(
                str(self.control), env=self._env(uid), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as error:
            return f"{self.control}: {error}"
        try:
            out = await asyncio.wait_for(_limited_output(process, "".join(f"{c}\n" for c in commands).encode(),
                                                         CLIENT_OUTPUT_LIMIT), timeout)
        except (TimeoutError, OutputTooLong) as error:
            process.kill()
            try:  # what is left in the pipe is read and dropped: asyncio's wait ends only once it closes
                await asyncio.wait_for(_discard_and_wait(process), KILL_TIMEOUT)
            except TimeoutError:
                pass
            if isinstance(error, OutputTooLong):
                return f"{self.control} printed more than {CLIENT_OUTPUT_LIMIT} bytes; killed"
            return f"{self.control} did not answer within {timeout:g}s"
        if process.returncode != 0:
            lines = out.decode(errors="replace").strip().splitlines()
            return f"exit {process.returncode}" + (f": {lines[-1]}" if lines else "")
        return None

    async def _stop(self, uid: str, daemon: Daemon, *, remove: bool = True) -> None:
        """Kill the daemon and its process group at once, through its pidfd (never through its
        control socket, which may be the tenant's: module docstring), and wait at most
        :data:`KILL_TIMEOUT` for it to go; then, with ``remove``, its mounts and directory."""
        if daemon.alive() and not await daemon.killed():
            log.error("MPS control daemon of claim %s (PID %s) did not go within %gs of SIGKILL",
                      uid, daemon.pid, KILL_TIMEOUT)
        daemon.forget()
        self._forget(uid)
        if remove:
            await in_thread(self._remove_dir, uid)
            log.info("MPS control daemon of claim %s stopped", uid)

    def _remove_dir(self, uid: str) -> None:
        """The claim's directory, its tmpfs mounts first: what a tenant wrote goes with them, unwalked."""
        unmount(self.root / uid / "pipe")
        unmount(self.root / uid / "shm")
        remove_tree(self.root / uid)

    async def _stop_leftover(self, uid: str) -> None:
        """A claim without a spec: it is gone. Its daemon, if an earlier supervisor's record names a
        process that still runs, is killed; nothing else is signalled."""
        daemon = Daemon(DaemonSpec(uid, ("?",)))
        if self._adopt(uid, daemon):
            await self._stop(uid, daemon)
        else:
            self._forget(uid)
            await in_thread(self._remove_dir, uid)


def _size(text: str) -> int:
    """A positive whole number of bytes from a quantity (``64Mi``), for --shm-size."""
    try:
        value = parse_quantity(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value != int(value) or not 0 < value < 2**63:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number of bytes")
    return int(value)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("mps-supervisor", help="run the MPS control daemons of this node's claims "
                                   "(the gpudra-mps DaemonSet)", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--plugin-dir", type=Path, required=True,
                        help="the driver's kubelet plugin directory (<kubelet-dir>/plugins/<driver>)")
    parser.add_argument("--driver-root", type=Path, default=Path("/"),
                        help="where the NVIDIA driver's files are, as this process sees them")
    parser.add_argument("--isolate-shm", action="store_true",
                        help="give each daemon the claim's shm tmpfs as /dev/shm")
    parser.add_argument("--shm-size", type=_size, default=DEFAULT_SHM_SIZE, metavar="QUANTITY",
                        help="the size of a claim's /dev/shm tmpfs, unless its daemon spec says otherwise "
                             f"(default {DEFAULT_SHM_SIZE // 2**20}Mi). The supervisor mounts it, so it needs "
                             "CAP_SYS_ADMIN, as for --isolate-shm")
    parser.add_argument("--max-shm-size", type=_size, default=DEFAULT_MAX_SHM_SIZE, metavar="QUANTITY",
                        help="the most a claim may ask for its /dev/shm (sharing.mps.shmSize in its GpuConfig); "
                             f"more fails its prepare (default {DEFAULT_MAX_SHM_SIZE // 2**30}Gi)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpudra_driver.driverroot import DriverRoot, DriverRootError, locate_nvml
    from gpudra_driver.logsetup import configure_logging

    configure_logging()
    root = DriverRoot.at(str(args.driver_root))
    try:
        library_dir: Path | None = locate_nvml(root).path.parent
    except (DriverRootError, OSError) as error:
        log.warning("the driver root's libraries were not found (%s); the daemons use the loader's path", error)
        library_dir = None
    supervisor = Supervisor(args.plugin_dir / "mps", root.local / "usr/bin/nvidia-cuda-mps-control", library_dir,
                            args.isolate_shm, args.shm_size, args.max_shm_size)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # The daemons stay when this process stops: claims still use them. In its DaemonSet the
        # container's end takes them along; a supervisor started again in place adopts them.
        await supervisor.serve(stop)

    asyncio.run(serve())
    return 0
