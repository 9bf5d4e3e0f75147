"""The MPS supervisor: runs the MPS control daemons that prepared claims ask for, outside the agent.

An MPS control daemon must outlive the agent that asked for it: the claim's containers keep using
it through an agent restart and a DaemonSet rolling update. A process the agent starts dies with
the agent's container (its PID namespace and cgroup go with it), so the daemons run here, in a
DaemonSet of their own (``gpudra-mps-<config>``) that is not rolled with the agent
(``updateStrategy: OnDelete``) and does nothing but this: no API access, no kubelet socket.

The desired state is files: the agent writes ``<plugin-dir>/mps/<claimUID>/daemon.json``
(:class:`gpudra_driver.plugin.mps.DaemonSpec`) and removes it; this process converges on them:

* a spec without a running daemon: ``nvidia-cuda-mps-control -f`` from the driver root, with
  ``CUDA_VISIBLE_DEVICES`` the claim's GPUs and the claim's pipe and log directories; ready once
  its control socket answers; then the limits, through the control socket;
* a running daemon without a spec (the claim was unprepared, or rolled back): ``quit``, killed if
  it does not go, and its directory removed;
* a daemon that died while its claim is prepared: started again with its limits (counted in
  ``restarts``, which the agent turns into an Event on the claim), at most once per
  :data:`RESTART_BACKOFF` seconds.

It converges every :data:`TICK` seconds and whenever the agent asks (``supervisor.sock``, one JSON
line each way: ``{"sync": true}`` -> ``{"daemons": {uid: status}}``). A daemon that a previous
supervisor left running (possible where the supervisor is not a container of its own, e.g. in the
local cluster) is adopted: watched by PID, its limits set again.

``--isolate-shm`` (the DaemonSet sets it) starts each daemon in a mount namespace of its own with
the claim's ``shm`` directory as its ``/dev/shm``: the MPS server it starts and the claim's
containers (which get the same directory at ``/dev/shm`` through CDI) must share it.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudra_driver.plugin.fsutil import write_atomic
from gpudra_driver.plugin.model import is_uid
from gpudra_driver.plugin.mps import SPEC_FILE, DaemonSpec
from gpudra_driver.plugin.sockets import SocketAddress

log = logging.getLogger(__name__)

SOCKET = "supervisor.sock"
STATUS_FILE = "status.json"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the control daemon's, in its pipe directory
TICK = 1.0  # seconds between liveness checks
READY_TIMEOUT = 20.0  # seconds for a started daemon to answer on its control socket
CLIENT_TIMEOUT = 10.0  # seconds for one nvidia-cuda-mps-control client call
QUIT_TIMEOUT = 10.0  # seconds for a daemon to go after quit, before it is killed
RESTART_BACKOFF = 5.0  # seconds between two starts of one claim's daemon
LEFTOVER_AGE = 60.0  # seconds a directory without a spec or a daemon is left to the agent writing it
READY, STARTING, FAILED = "Ready", "Starting", "Failed"


@dataclass
class Daemon:
    spec: DaemonSpec
    pid: int | None = None
    process: asyncio.subprocess.Process | None = None  # None: not ours (adopted), or not running
    state: str = STARTING
    message: str = ""
    restarts: int = 0
    started_at: float = 0.0

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return self.pid is not None and _pid_alive(self.pid)

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts, "message": self.message}


@dataclass
class Supervisor:
    root: Path  # <plugin-dir>/mps
    control: Path  # nvidia-cuda-mps-control, as this process sees it
    library_dir: Path | None = None  # the driver root's library directory, for the daemon's loader
    isolate_shm: bool = False
    daemons: dict[str, Daemon] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()

    # -- the loop -----------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
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
            for uid in self._leftover_dirs(wanted, invalid):
                await self._quit_leftover(uid)
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

    def _leftover_dirs(self, wanted: Mapping[str, DaemonSpec], invalid: Mapping[str, str]) -> list[str]:
        """Directories without a spec that a daemon ran in (an earlier supervisor's), or that were
        left without one for a while; not one the agent has just made and is writing the spec into."""
        now = time.time()
        return [uid for uid in self._claim_dirs() if uid not in wanted and uid not in invalid
                and ((self.root / uid / "pipe").exists() or now - _mtime(self.root / uid) > LEFTOVER_AGE)]

    def _write_status(self, uid: str, status: Mapping[str, Any]) -> None:
        try:
            write_atomic(self.root / uid / STATUS_FILE, (json.dumps(status, sort_keys=True) + "\n").encode())
        except OSError as error:  # the directory went meanwhile (unprepared): nothing to report
            log.debug("status of %s not written: %s", uid, error)

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

    async def _start(self, uid: str, daemon: Daemon) -> None:
        base = self.root / uid
        daemon.started_at = time.monotonic()
        daemon.process, daemon.pid = None, None
        for name, mode in (("pipe", 0o755), ("log", 0o755), ("shm", 0o1777)):
            (base / name).mkdir(mode=mode, exist_ok=True)
            os.chmod(base / name, mode)  # mkdir's mode is masked by the umask
        if await self._client(uid, ["get_default_active_thread_percentage"]) is None:
            daemon.pid = _read_pid(base / "pipe" / PID_FILE)  # an earlier supervisor's: adopted
            log.info("adopted the running MPS control daemon of claim %s (PID %s)", uid, daemon.pid)
        else:
            try:
                daemon.process = await asyncio.create_subprocess_exec(
                    str(self.control), "-f", env=self._env(uid, daemon.spec), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=_shm_namespace(base / "shm") if self.isolate_shm else None)
            except OSError as error:
                daemon.state, daemon.message = FAILED, f"starting {self.control} failed: {error}"
                log.error("claim %s: %s", uid, daemon.message)
                return
            daemon.pid = daemon.process.pid
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
        """Run control commands; None when every one succeeded, else what failed."""
        try:
            process = await asyncio.create_subprocess_exec(
                str(self.control), env=self._env(uid), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as error:
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
            await self._client(uid, ["quit"])
            await self._wait_gone(daemon)
        if remove:
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
                await asyncio.sleep(0.05)  # not our child: no exit to wait on
        if daemon.alive() and daemon.pid is not None:
            log.warning("MPS control daemon PID %s did not quit within %gs; killing it", daemon.pid, QUIT_TIMEOUT)
            os.killpg(daemon.pid, signal.SIGKILL) if daemon.process is not None else os.kill(daemon.pid, signal.SIGKILL)
            if daemon.process is not None:
                await daemon.process.wait()

    async def _quit_leftover(self, uid: str) -> None:
        """A directory without a spec: the claim is gone. Its daemon (an earlier supervisor's) quits."""
        pid = _read_pid(self.root / uid / "pipe" / PID_FILE)
        if pid is not None and _pid_alive(pid):
            await self._stop(uid, Daemon(DaemonSpec(uid, ("?",)), pid=pid))
        else:
            shutil.rmtree(self.root / uid, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # a zombie has exited
    except (OSError, IndexError):
        return False


_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 0x1000, 0x4000, 0x40000


def _shm_namespace(shm: Path):  # type: ignore[no-untyped-def]
    """A preexec function: a private mount namespace whose /dev/shm is ``shm``."""
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for ok in (libc.unshare(_CLONE_NEWNS) == 0,
                   libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0,
                   libc.mount(os.fsencode(shm), b"/dev/shm", None, _MS_BIND, None) == 0):
            if not ok:
                raise OSError(ctypes.get_errno(), f"isolating /dev/shm for the MPS daemon ({shm})")
    return enter


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("mps-supervisor", help="run the MPS control daemons of this node's claims "
                                   "(the gpudra-mps DaemonSet)", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--plugin-dir", type=Path, required=True,
                        help="the driver's kubelet plugin directory (<kubelet-dir>/plugins/<driver>)")
    parser.add_argument("--driver-root", type=Path, default=Path("/"),
                        help="where the NVIDIA driver's files are, as this process sees them")
    parser.add_argument("--isolate-shm", action="store_true",
                        help="give each daemon the claim's shm directory as /dev/shm (needs CAP_SYS_ADMIN)")
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
                            args.isolate_shm)

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
