"""The MPS supervisor: runs the MPS control daemons that prepared claims ask for, outside the agent.

An MPS control daemon must outlive the agent that asked for it: the claim's containers keep using
it through an agent restart and a DaemonSet rolling update. A process the agent starts dies with
the agent's container (its PID namespace and cgroup go with it), so the daemons run here, in a
DaemonSet of their own (``gpudra-mps-<config>``) that is not rolled with the agent
(``updateStrategy: OnDelete``) and does nothing but this: no API access, no kubelet socket, and
of the plugin directory only ``mps/``.

The desired state is files: the agent writes ``<plugin-dir>/mps/<claimUID>/daemon.json``
(:class:`gpudra_driver.plugin.mps.DaemonSpec`) and removes it; this process converges on them:

* a spec without a running daemon: the claim's ``shm`` directory becomes a tmpfs of the spec's
  size (the claim's ``/dev/shm``: bounded, and charged to the memory of whoever writes it, not to
  the kubelet's disk), then ``nvidia-cuda-mps-control -f`` from the driver root, with
  ``CUDA_VISIBLE_DEVICES`` the claim's GPUs and the claim's pipe and log directories; ready once
  its control socket answers; then the limits, through the control socket;
* a running daemon without a spec (the claim was unprepared, or rolled back): ``quit``, killed if
  it does not go, its tmpfs unmounted and its directory removed;
* a daemon that died while its claim is prepared: started again with its limits (counted in
  ``restarts``, which the agent turns into an Event on the claim), at most once per
  :data:`RESTART_BACKOFF` seconds.

It converges every :data:`TICK` seconds and whenever the agent asks (``supervisor.sock``, one JSON
line each way: ``{"sync": true}`` -> ``{"daemons": {uid: status}}``).

**The pipe and shm directories belong to the tenant.** They are mounted read-write into the
claim's containers, whose processes may run as root: anything in them (the daemon's PID file, its
control socket, a symlink) may be forged. So the supervisor takes no decision from them:

* it keeps its own record of each daemon it starts, in :data:`STATE_DIR` (``mps/supervisor/``,
  mode 0700, never mounted into a container): PID, start time (``/proc/<pid>/stat`` field 22) and
  executable (``/proc/<pid>/exe``). A supervisor started again in place (possible where it is not
  a container of its own, e.g. in the local cluster) adopts a running daemon only if the record
  matches the process now behind that PID, and signals a process only through a pidfd opened on
  it and checked against the record: a reused PID, or a PID a tenant wrote down, is never hit;
* the daemon's and the control client's view of the pipe directory (and the daemon's of
  ``/dev/shm``) is a ``nosymfollow`` bind mount in a mount namespace of their own, so a symlink a
  tenant plants (``control`` pointing at another claim's socket, the PID file at a file of the
  supervisor's) is not followed;
* a (re)started daemon gets an emptied pipe directory: what a tenant left there goes.

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
import ctypes
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudra_driver.plugin.fsutil import remove, write_atomic
from gpudra_driver.plugin.model import is_uid
from gpudra_driver.plugin.mps import DEFAULT_MAX_SHM_SIZE, DEFAULT_SHM_SIZE, SPEC_FILE, DaemonSpec
from gpudra_driver.plugin.sockets import SocketAddress
from gpudra_driver.quantity import format_quantity, parse_quantity

log = logging.getLogger(__name__)

SOCKET = "supervisor.sock"
STATUS_FILE = "status.json"
STATE_DIR = "supervisor"  # under the MPS root: this process's own records, one <claimUID>.json per daemon
TICK = 1.0  # seconds between liveness checks
READY_TIMEOUT = 20.0  # seconds for a started daemon to answer on its control socket
CLIENT_TIMEOUT = 10.0  # seconds for one nvidia-cuda-mps-control client call
QUIT_TIMEOUT = 10.0  # seconds for a daemon to go after quit, before it is killed
RESTART_BACKOFF = 5.0  # seconds between two starts of one claim's daemon
LEFTOVER_AGE = 60.0  # seconds a directory without a spec or a daemon is left to the agent writing it
READY, STARTING, FAILED = "Ready", "Starting", "Failed"


# -- which process is which (pure) ----------------------------------------------------------------
@dataclass(frozen=True)
class ProcessRecord:
    """A process as the supervisor saw it when it started it: what makes it that process and no
    other. A PID is reused; a PID with the same start time (clock ticks since boot) is not."""

    pid: int
    start_time: int
    exe: str

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "startTime": self.start_time, "exe": self.exe}

    @classmethod
    def from_json(cls, data: Any) -> ProcessRecord:
        if not isinstance(data, dict) or type(data.get("pid")) is not int or data["pid"] <= 0 \
                or type(data.get("startTime")) is not int or not isinstance(data.get("exe"), str):
            raise ValueError(f"{data!r} is not a process record")
        return cls(data["pid"], data["startTime"], data["exe"])


def start_time_of(stat: bytes) -> int:
    """Field 22 (starttime) of a ``/proc/<pid>/stat`` line. The command name (field 2) may hold
    spaces and parentheses, so fields are counted after its last ')'."""
    return int(stat.rsplit(b")", 1)[1].split()[19])  # fields 3.. follow: 22 is the 20th of them


def same_process(record: ProcessRecord, observed: ProcessRecord | None) -> bool:
    """Whether ``observed`` (the process now behind ``record.pid``) is the one recorded. An
    executable replaced on disk since (a driver upgrade) still names the same process."""
    return observed is not None and observed.pid == record.pid and observed.start_time == record.start_time \
        and observed.exe.removesuffix(" (deleted)") == record.exe.removesuffix(" (deleted)")


def observe(pid: int) -> ProcessRecord | None:
    """The process now behind ``pid``; None when there is none (or a zombie, which has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
        exe = os.readlink(f"/proc/{pid}/exe")
        if line.rsplit(b")", 1)[1].split()[0] == b"Z":
            return None
        return ProcessRecord(pid, start_time_of(line), exe)
    except (OSError, IndexError, ValueError):
        return None


def open_recorded(record: ProcessRecord) -> int | None:
    """A pidfd on the recorded process, or None if it is gone (or the PID is another process's
    now). Checked after the pidfd is open: the pidfd pins the process it was opened on, so a
    match then means every signal sent through it reaches the recorded process."""
    try:
        fd = os.pidfd_open(record.pid)
    except OSError:  # ProcessLookupError: gone
        return None
    if same_process(record, observe(record.pid)):
        return fd
    os.close(fd)
    return None


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


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])  # a pidfd is readable once its process exited


@dataclass
class Daemon:
    spec: DaemonSpec
    pid: int | None = None
    process: asyncio.subprocess.Process | None = None  # ours, started by this process
    pidfd: int | None = None  # an earlier supervisor's, adopted: a pidfd checked against its record
    state: str = STARTING
    message: str = ""
    restarts: int = 0
    started_at: float = 0.0

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return self.pidfd is not None and not _exited(self.pidfd)

    def forget(self) -> None:
        """Drop the handle on the process (gone, or to be started again)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.process, self.pidfd, self.pid = None, None, None

    async def killed(self) -> None:
        """SIGKILL, to the process itself and never to a PID's later owner: our child cannot have
        been reaped yet (its group with it: the MPS servers it started), an adopted one is reached
        through its pidfd; then wait until it has gone."""
        if self.process is not None:
            if self.process.returncode is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        elif self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                return
            await asyncio.to_thread(select.select, [self.pidfd], [], [], QUIT_TIMEOUT)

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts, "message": self.message}


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
        self._lock = asyncio.Lock()

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    # -- the loop -----------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        path = self.root / SOCKET
        path.unlink(missing_ok=True)
        with SocketAddress(path) as address:  # a deep plugin directory: bound through /proc/self/fd
            server = await asyncio.start_unix_server(self._answer, path=address.address)
        log.info("MPS supervisor on %s (control daemon %s)", path, self.control)
        try:
            while not stop.is_set():
                await self.converge()
                try:
                    await asyncio.wait_for(stop.wait(), TICK)
                except TimeoutError:
                    pass
        finally:
            server.close()
            path.unlink(missing_ok=True)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), CLIENT_TIMEOUT) or b"{}")
            if not isinstance(request, dict) or request.get("sync") is not True:
                reply: dict[str, Any] = {"error": "expected {\"sync\": true}"}
            else:
                reply = {"daemons": await self.converge()}
        except (ValueError, TimeoutError) as error:
            reply = {"error": f"bad request: {error}"}
        writer.write(json.dumps(reply).encode() + b"\n")
        try:
            await writer.drain()
        finally:
            writer.close()

    async def converge(self) -> dict[str, dict[str, Any]]:
        """One pass over the specs on disk; every spec's status (also written to its directory)."""
        async with self._lock:
            wanted, invalid = self._specs()
            for uid in [u for u in self.daemons if u not in wanted or self.daemons[u].spec != wanted[u]]:
                await self._stop(uid, self.daemons.pop(uid))
            for uid in self._leftovers(wanted, invalid):
                await self._stop_leftover(uid)
            statuses = {uid: {"state": FAILED, "pid": None, "restarts": 0, "message": problem}
                        for uid, problem in invalid.items()}
            for uid, spec in wanted.items():
                daemon = self.daemons.get(uid)
                if daemon is None:
                    daemon = self.daemons[uid] = Daemon(spec)
                    await self._start(uid, daemon)
                elif not daemon.alive() and time.monotonic() - daemon.started_at >= RESTART_BACKOFF:
                    daemon.restarts += 1
                    log.warning("MPS control daemon of claim %s (PID %s) is gone; starting it again (restart %d)",
                                uid, daemon.pid, daemon.restarts)
                    await self._start(uid, daemon)
                elif not daemon.alive():
                    daemon.state, daemon.message = STARTING, f"the daemon (PID {daemon.pid}) exited; restarting"
                statuses[uid] = daemon.status()
            for uid, status in statuses.items():
                self._write_status(uid, status)
            return statuses

    # -- specs ----------------------------------------------------------------------------------
    def _specs(self) -> tuple[dict[str, DaemonSpec], dict[str, str]]:
        wanted: dict[str, DaemonSpec] = {}
        invalid: dict[str, str] = {}
        for uid in self._claim_dirs():
            try:
                data = (self.root / uid / SPEC_FILE).read_bytes()
            except FileNotFoundError:
                continue
            try:
                spec = DaemonSpec.from_json(json.loads(data))
                if spec.claim_uid != uid:
                    raise ValueError(f"claimUID {spec.claim_uid} is not its directory's")
                wanted[uid] = spec
            except ValueError as error:
                invalid[uid] = f"{self.root / uid / SPEC_FILE}: {error}"
        return wanted, invalid

    def _claim_dirs(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if is_uid(n) and (self.root / n).is_dir())
        except FileNotFoundError:
            return []

    def _leftovers(self, wanted: Mapping[str, DaemonSpec], invalid: Mapping[str, str]) -> list[str]:
        """Claims without a spec whose daemon (an earlier supervisor's) is recorded or whose
        directory a daemon ran in, or whose directory was left without a spec for a while; not one
        the agent has just made and is writing the spec into."""
        now = time.time()
        dirs = [uid for uid in self._claim_dirs() if uid not in wanted and uid not in invalid
                and ((self.root / uid / "pipe").exists() or now - _mtime(self.root / uid) > LEFTOVER_AGE)]
        return sorted({*dirs, *(uid for uid in self._recorded() if uid not in wanted and uid not in self.daemons)})

    def _write_status(self, uid: str, status: Mapping[str, Any]) -> None:
        try:
            write_atomic(self.root / uid / STATUS_FILE, (json.dumps(status, sort_keys=True) + "\n").encode())
        except OSError as error:  # the directory went meanwhile (unprepared): nothing to report
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
        """Take over the recorded daemon of ``uid`` if that very process still runs."""
        record = self._record(uid)
        pidfd = open_recorded(record) if record is not None else None
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
        """The claim's directories for a fresh daemon: an empty pipe directory (nothing a tenant
        left there survives), the log directory, and the shm tmpfs (kept if already mounted: the
        claim's containers may be using it)."""
        base = self.root / uid
        for name, mode in (("pipe", 0o755), ("log", 0o755), ("shm", 0o1777)):
            (base / name).mkdir(mode=mode, exist_ok=True)
            os.chmod(base / name, mode)  # mkdir's mode is masked by the umask
        _empty(base / "pipe")
        if not os.path.ismount(base / "shm"):
            mount_shm(base / "shm", shm_size_of(spec, self.shm_size, self.max_shm_size))

    async def _start(self, uid: str, daemon: Daemon) -> None:
        base = self.root / uid
        daemon.started_at = time.monotonic()
        daemon.forget()
        if not self._adopt(uid, daemon):
            self._forget(uid)
            try:
                self._prepare_dirs(uid, daemon.spec)
            except (ValueError, OSError) as error:  # more than the platform allows; a mount refused
                daemon.state, daemon.message = FAILED, str(error)
                log.error("claim %s: %s", uid, daemon.message)
                return
            try:
                daemon.process = await asyncio.create_subprocess_exec(
                    str(self.control), "-f", env=self._env(uid, daemon.spec), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=_private_view(base / "pipe", base / "shm" if self.isolate_shm else None))
            except (OSError, subprocess.SubprocessError) as error:  # a preexec failure is the latter
                daemon.state, daemon.message = FAILED, f"starting {self.control} failed: {error}"
                log.error("claim %s: %s", uid, daemon.message)
                return
            daemon.pid = daemon.process.pid
            record = observe(daemon.pid)  # our unreaped child: the PID cannot be another's yet
            if record is not None:
                self._remember(uid, record)
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

    async def _wait_ready(self, uid: str, daemon: Daemon) -> str | None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not daemon.alive():
                return f"{self.control} -f exited with {daemon.process.returncode if daemon.process else '?'}" \
                       f" before it answered; see {self.root / uid / 'log' / 'control.log'}"
            if await self._client(uid, ["get_default_active_thread_percentage"]) is None:
                return None
            await asyncio.sleep(0.05)  # polling the control socket: the daemon gives no other signal
        return f"the daemon did not answer on its control socket within {READY_TIMEOUT:g}s"

    async def _client(self, uid: str, commands: list[str]) -> str | None:
        """Run control commands; None when every one succeeded, else what failed. The client sees
        the pipe directory without symlinks: a planted ``control`` link reaches no other daemon."""
        try:
            process = await asyncio.create_subprocess_exec(
                str(self.control), env=self._env(uid), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_private_view(self.root / uid / "pipe", None))
        except (OSError, subprocess.SubprocessError) as error:
            return f"{self.control}: {error}"
        try:
            out, _ = await asyncio.wait_for(process.communicate("".join(f"{c}\n" for c in commands).encode()),
                                            CLIENT_TIMEOUT)
        except TimeoutError:
            process.kill()
            await process.wait()
            return f"{self.control} did not answer within {CLIENT_TIMEOUT:g}s"
        if process.returncode != 0:
            lines = out.decode(errors="replace").strip().splitlines()
            return f"exit {process.returncode}" + (f": {lines[-1]}" if lines else "")
        return None

    async def _stop(self, uid: str, daemon: Daemon, *, remove: bool = True) -> None:
        if daemon.alive():
            # The socket may be a tenant's (its own daemon, a planted link the view does not follow):
            # a quit that reached nobody, or not ours, ends in the kill below.
            if await self._client(uid, ["quit"]) is None:
                await self._wait_gone(daemon)
            if daemon.alive():
                log.warning("MPS control daemon of claim %s (PID %s) did not quit; killing it", uid, daemon.pid)
                await daemon.killed()
        daemon.forget()
        self._forget(uid)
        if remove:
            unmount(self.root / uid / "shm")
            shutil.rmtree(self.root / uid, ignore_errors=True)
            log.info("MPS control daemon of claim %s stopped", uid)

    async def _wait_gone(self, daemon: Daemon) -> None:
        deadline = time.monotonic() + QUIT_TIMEOUT
        while daemon.alive() and time.monotonic() < deadline:
            if daemon.process is not None:
                try:
                    await asyncio.wait_for(daemon.process.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    break
            else:
                await asyncio.sleep(0.05)  # not our child: its pidfd says when it has gone

    async def _stop_leftover(self, uid: str) -> None:
        """A claim without a spec: it is gone. Its daemon, if an earlier supervisor's record names a
        process that still runs, quits; nothing else is signalled."""
        daemon = Daemon(DaemonSpec(uid, ("?",)))
        if self._adopt(uid, daemon):
            await self._stop(uid, daemon)
        else:
            self._forget(uid)
            unmount(self.root / uid / "shm")
            shutil.rmtree(self.root / uid, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _empty(directory: Path) -> None:
    """Remove what ``directory`` holds, following no symlink."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            remove(Path(entry.path))


# -- mounts -------------------------------------------------------------------------------------
_CLONE_NEWNS = 0x20000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 0x2, 0x4, 0x8, 0x20
_MS_NOSYMFOLLOW, _MS_BIND, _MS_REC, _MS_SLAVE = 0x100, 0x1000, 0x4000, 0x80000
_MNT_DETACH = 0x2
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ok: bool, what: str) -> None:
    if not ok:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount_shm(path: Path, size: int) -> None:
    """A tmpfs of ``size`` bytes at ``path``, as a container runtime mounts /dev/shm (world-writable,
    sticky; no devices, set-user-ID or executables)."""
    options = f"size={size},mode=1777".encode()
    _check(_libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options) == 0,
           f"mounting a tmpfs of {size} bytes at {path}")


def unmount(path: Path) -> None:
    """Unmount what is mounted at ``path`` (lazily: a container may still hold it open)."""
    for _ in range(8):  # a stack, should one have formed; each round takes the top
        if not os.path.ismount(path):
            return
        if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
            log.warning("unmounting %s failed: %s", path, os.strerror(ctypes.get_errno()))
            return


def _private_view(pipe: Path, shm: Path | None) -> Callable[[], None]:
    """A preexec function: a private mount namespace in which ``pipe`` follows no symlink and, with
    ``shm``, /dev/shm is ``shm`` (following none either)."""
    def bind(source: bytes, target: bytes, flags: int) -> None:
        _check(_libc.mount(source, target, None, _MS_BIND, None) == 0, f"binding {source!r} to {target!r}")
        _check(_libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSYMFOLLOW | flags, None) == 0,
               f"remounting {target!r} nosymfollow")

    def enter() -> None:
        _check(_libc.unshare(_CLONE_NEWNS) == 0, "unshare(CLONE_NEWNS)")
        # a slave: what this namespace mounts stays in it, and a claim's tmpfs the supervisor
        # unmounts goes from it at once (a private copy would hold its pages until the directory went)
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) == 0, "making / a slave")
        bind(os.fsencode(pipe), os.fsencode(pipe), _MS_NOSUID | _MS_NODEV)
        if shm is not None:
            bind(os.fsencode(shm), b"/dev/shm", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    return enter


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
