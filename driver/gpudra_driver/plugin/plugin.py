"""The kubelet plugin's I/O shell: sockets, gRPC servers, the claim GET.

Sockets (unique per agent instance, so a DaemonSet rolling update can overlap two instances; the
kubelet prefers the newest registered one that is connected):

* ``<kubelet-dir>/plugins/<driver>/dra-<podUID>.sock``: DRAPlugin v1 and v1beta1;
* ``<kubelet-dir>/plugins_registry/<driver>-<podUID>-reg.sock``: registration.

Start: stale sockets (nobody accepts on them: a crashed instance's) are removed, the checkpoint and
CDI directory are reconciled, the DRA socket is served; the registration socket appears once
devices have been discovered, so the kubelet never prefers an instance that cannot prepare yet.
Stop (SIGTERM): registration socket first (deregistration), then the DRA server after in-flight
calls finish, then our socket files. Prepare GETs each claim (concurrently, before taking any
lock) and has :class:`DeviceState` read each as its GET returns (bounded, its configs decoded,
still before any lock: :mod:`.allocation`), then changes the node's state one call at a time."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gpudra_driver import metrics
from gpudra_core.devicemodel import Device
from gpudra_driver.driverroot import DriverRoot, locate_nvml
from gpudra_driver.nvml import load_nvml
from gpudra_driver.plugin import devicemetadata, service
from gpudra_driver.plugin.allocation import ReadClaim
from gpudra_driver.plugin.sharing.mps import plan as mps
from gpudra_driver.plugin.cdi import CdiDir, metadata_dir
from gpudra_driver.plugin.claimreporter import ClaimReporter
from gpudra_driver.plugin.checkpoint import read_boot_id
from gpudra_driver.plugin.driverfiles import DriverFilesCache
from gpudra_driver.plugin.devicenodes import CapMinor, node_devices, read_mig_cap_minor
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.plugin.miginstances import MigInstances
from gpudra_driver.plugin.sharing.apply import GpuControl
from gpudra_driver.plugin.gen import pluginregistration_pb2_grpc
from gpudra_driver.plugin.locking import LOCK_FILE
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PrepareResult
from gpudra_driver.plugin.registration import HEALTH_SERVICES, SUPPORTED_VERSIONS, RegistrationServicer
from gpudra_driver.plugin.sockets import MAX_SOCKET_PATH, SocketAddress
from gpudra_driver.plugin.state import DeviceState, Fetched

if TYPE_CHECKING:
    from gpudra_driver.uninstall import FilePlan

log = logging.getLogger(__name__)

# GET a claim (None: not found)
GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]
CLAIM_GET_TIMEOUT = 10.0  # with the node lock's wait (locking.LOCK_TIMEOUT) inside the kubelet's 45 s per call
# How long a call may take before it answers: the kubelet's 45 s, less room for the writes and the
# answer. A call queued behind others waits for the node lock only until then.
CALL_BUDGET = 40.0


def socket_paths(kubelet_dir: Path, driver: str, instance: str) -> tuple[Path, Path]:
    """(DRA socket, registration socket). Where ``<kubelet-dir>/...`` plus a driver name and pod UID
    would not fit a unix socket address, the names are hashed (as upstream's kubeletplugin does
    after 1.35), keeping a per-driver prefix so stale-socket cleanup recognises them. A directory
    too deep even for that is still served (see :mod:`.sockets`)."""
    plugin_dir, registry = kubelet_dir / "plugins" / driver, kubelet_dir / "plugins_registry"
    dra, reg = plugin_dir / f"dra-{instance}.sock", registry / f"{driver}-{instance}-reg.sock"
    short = hashlib.sha256(instance.encode()).hexdigest()[:12]
    if len(os.fsencode(dra)) > MAX_SOCKET_PATH:
        dra = plugin_dir / f"dra-{short}.sock"
    if len(os.fsencode(reg)) > MAX_SOCKET_PATH:
        reg = registry / f"{_registry_prefix(driver, hashed=True)}{short}-reg.sock"
    return dra, reg


def _registry_prefix(driver: str, *, hashed: bool) -> str:
    return f"gpudra-{hashlib.sha256(driver.encode()).hexdigest()[:8]}-" if hashed else f"{driver}-"


def _is_stale(path: Path) -> bool:
    """True when ``path`` is a unix socket nobody accepts on (its server died)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        with SocketAddress(path) as address:
            sock.connect(address.address)
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError as error:
        return error.errno in (errno.ECONNREFUSED, errno.ENOTSOCK)
    finally:
        sock.close()


class KubeletPlugin:
    def __init__(self, *, driver: str, node: str, kubelet_dir: Path, cdi_dir: Path, get_claim: GetClaim,
                 driver_root: DriverRoot | None = None, cdi_hook: str | None = None, host_dev: Path = Path("/dev"),
                 instance: str | None = None, boot_id: str | None = None,
                 proc_root: Path = Path("/proc"), api_versions: Sequence[str] = ("v1", "v1beta1"),
                 fault: FaultHook | None = None, claim_get_timeout: float = CLAIM_GET_TIMEOUT,
                 nvml: str | None = None, health: service.Feed | None = None,
                 reporter: ClaimReporter | None = None, device_metadata: bool = True) -> None:
        """``nvml``: the NVML the agent discovers with (see :func:`gpudra_driver.nvml.load_nvml`),
        also used to change a GPU's compute mode for sharing. ``health``: the device health to
        stream to the kubelet (DRAResourceHealth, served and advertised only then). ``reporter``:
        told of every claim prepared and unprepared, after the answer (claim status, per-pod series).
        ``device_metadata``: claims' containers get their devices' metadata files (KEP-5304)."""
        self.driver, self.node = driver, node
        self.instance = instance or str(uuid.uuid4())
        self.plugin_dir = kubelet_dir / "plugins" / driver
        self.registry_dir = kubelet_dir / "plugins_registry"
        self.dra_socket, self.registration_socket = socket_paths(kubelet_dir, driver, self.instance)
        self.get_claim = get_claim
        self.claim_get_timeout = claim_get_timeout
        self.cap_minor: CapMinor = read_mig_cap_minor(proc_root)
        self.driver_files = DriverFilesCache(driver_root or DriverRoot.at("/"), hook=cdi_hook, host_dev=host_dev,
                                             proc=proc_root)
        root = driver_root or DriverRoot.at("/")
        control = GpuControl(lambda: load_nvml(nvml, root), root.local / "usr/bin/nvidia-smi",
                             lambda: locate_nvml(root).path)
        # the metadata directory is known whatever the flag: claims prepared with it keep their files
        cdi = CdiDir(cdi_dir, driver, self.driver_files, self.plugin_dir / mps.ROOT, metadata_dir(cdi_dir, driver),
                     legacy_metadata_roots=(self.plugin_dir / devicemetadata.LEGACY_SUBDIR,))
        self.state = DeviceState(self.plugin_dir, cdi, driver=driver, node=node,
                                 boot_id=boot_id or read_boot_id(), fault=fault or FaultHook(), gpu_control=control,
                                 mig=MigInstances(control.load_nvml, self.cap_minor), device_metadata=device_metadata)
        self.api_versions = tuple(api_versions)
        self.health = health
        self.reporter = reporter
        self.registration = RegistrationServicer(
            driver, os.fspath(self.dra_socket),
            (*(v for v in SUPPORTED_VERSIONS if v.split(".")[0] in self.api_versions),
             *(HEALTH_SERVICES if health is not None else ())))
        self.devices_known = asyncio.Event()
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self.registration_served = False  # the registration socket is up (after the first discovery)
        self._register_task: asyncio.Task[None] | None = None

    # -- devices ------------------------------------------------------------------------------
    def set_devices(self, devices: Sequence[Device]) -> None:
        """This node's devices from the latest discovery (called from the rescan loop)."""
        self.state.set_devices(node_devices(list(devices), self.cap_minor))
        if self.reporter is not None:
            self.reporter.set_devices(devices)
        self.devices_known.set()

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_sockets()
        await asyncio.to_thread(self.state.recover)  # before any call can reach the state
        metrics.set_prepared_claims(self.state.prepared_count)  # claims prepared by earlier instances
        self._dra_server = grpc.aio.server()
        for version in self.api_versions:
            servicer_class, add = service.VERSIONS[version]
            add(servicer_class(self), self._dra_server)
        if self.health is not None:
            for name in HEALTH_SERVICES:
                health_class, add_health = service.HEALTH_SERVICES[name]
                add_health(health_class(self.health), self._dra_server)
        self._listen(self._dra_server, self.dra_socket)
        await self._dra_server.start()
        log.info("DRA service (%s%s) on %s", ", ".join(self.api_versions),
                 ", health" if self.health is not None else "", self.dra_socket)
        self._register_task = asyncio.create_task(self._register(), name="plugin-registration")
        self._register_task.add_done_callback(_log_registration_failure)

    async def watch(self) -> None:
        """Wait while the plugin serves; raise when it no longer can: its registration socket could
        not be served (the kubelet would never call). The agent then exits and its pod restarts,
        instead of running on unregistered."""
        registering = self._register_task
        if registering is None:
            raise RuntimeError("the kubelet plugin was not started")
        await registering  # raises what serving the registration socket raised
        await asyncio.Event().wait()  # served: from here on, the plugin serves until cancelled

    async def _register(self) -> None:
        await self.devices_known.wait()
        self._reg_server = grpc.aio.server()
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, self._reg_server)
        self._listen(self._reg_server, self.registration_socket)
        await self._reg_server.start()
        self.registration_served = True
        log.info("registration socket %s (waiting for the kubelet)", self.registration_socket)

    async def stop(self, grace: float = 5.0) -> None:
        if self._register_task is not None:
            self._register_task.cancel()
            await asyncio.gather(self._register_task, return_exceptions=True)
        # Deregister first: the kubelet stops routing new calls here once the socket is gone.
        _unlink(self.registration_socket)
        if self._reg_server is not None:
            await self._reg_server.stop(0)
        if self.health is not None:
            await self.health.close()  # health streams never end by themselves
        if self._dra_server is not None:
            await self._dra_server.stop(grace)  # in-flight prepares finish, new ones are refused
        _unlink(self.dra_socket)
        log.info("kubelet plugin stopped; sockets removed")

    def remove_node_files(self) -> tuple[FilePlan, list[str]]:
        """Uninstall: remove what this driver put on the node unless claims hold it or another
        instance serves (:mod:`gpudra_driver.uninstall`), decided and done under the node lock (the
        lock file itself goes too: the lock holds on its inode until released). The plan and what
        could not be removed. Blocking; call it off the event loop, after :meth:`stop`."""
        from gpudra_driver import uninstall
        from gpudra_driver.plugin.checkpoint import is_leftover
        from gpudra_driver.plugin.state import CHECKPOINT_FILE

        if not self.plugin_dir.is_dir():
            return uninstall.FilePlan(), []
        with self.state.locks.node_locked_blocking():
            held = uninstall.held_claims(self.state.checkpoint.load())
            sockets = self._instance_sockets()  # ours is gone (stop): any live one is another instance's
            live = [p for p in sockets if not _is_stale(p)]
            entries = list(self.plugin_dir.iterdir())
            cdi = self.state.cdi
            specs = [cdi.spec_path(uid) for uid in sorted(cdi.claim_uids())]
            files = [p for p in entries if not p.is_dir() and (
                p.name in (CHECKPOINT_FILE, LOCK_FILE) or is_leftover(p.name, CHECKPOINT_FILE) or p in sockets)]
            stale_registrations = [p for p in self._registration_sockets() if _is_stale(p)]
            metadata = [cdi.metadata_root] if cdi.metadata_root is not None and cdi.metadata_root.is_dir() else []
            plan = uninstall.plan_files(held=held, other_instance=live[0] if live else None, cdi_specs=specs,
                                        plugin_dir=self.plugin_dir, plugin_files=[*files, *stale_registrations],
                                        subdirs=[*(p for p in entries if p.is_dir()), *metadata])
            return plan, uninstall.remove_files(plan) if plan.removes else []

    def _instance_sockets(self) -> list[Path]:
        """The DRA sockets in the plugin directory (every instance's, crashed ones' included)."""
        return [self.plugin_dir / n for n in os.listdir(self.plugin_dir) if n.startswith("dra") and n.endswith(".sock")]

    def _registration_sockets(self) -> list[Path]:
        prefixes = (_registry_prefix(self.driver, hashed=False), _registry_prefix(self.driver, hashed=True))
        try:
            names = os.listdir(self.registry_dir)
        except FileNotFoundError:
            return []
        return [self.registry_dir / n for n in names if n.startswith(prefixes) and n.endswith("-reg.sock")]

    def _listen(self, server: grpc.aio.Server, path: Path) -> None:
        _unlink(path)  # ours by construction (unique instance name)
        with SocketAddress(path) as address:  # bound (the file exists) before the handle closes
            try:
                bound = server.add_insecure_port(address.target)
            except RuntimeError as error:  # grpcio raises where older versions returned 0
                raise OSError(f"cannot listen on unix socket {path}: {error}") from None
            if bound == 0:
                raise OSError(f"cannot listen on unix socket {path}")

    def _remove_stale_sockets(self) -> None:
        for path in [*self._instance_sockets(), *self._registration_sockets()]:
            if _is_stale(path):
                _unlink(path)
                log.info("removed stale socket %s", path)

    def busy_for(self) -> float:
        """Seconds the prepare/unprepare call running now has taken (0: none runs)."""
        return self.state.locks.busy_for()

    # -- the calls ------------------------------------------------------------------------------
    async def prepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        if not refs:  # nothing to do (the liveness check's call): no round, no node lock
            return {}
        started, deadline = time.perf_counter(), time.monotonic() + CALL_BUDGET
        with self.state.queue.reading_claims():  # a batch starting meanwhile waits a moment for this call
            fetched = await asyncio.gather(*(self._fetch_and_read(ref) for ref in refs))
        results = await self.state.prepare_read([(ref, read) for ref, (_, read) in zip(refs, fetched)], deadline)
        self._record(metrics.PREPARE, started, [r.error for r in results.values()])
        if self.reporter is not None:
            for ref, (live, _) in zip(refs, fetched):
                if (result := results.get(ref.uid)) is not None and result.claim is not None:
                    self.reporter.prepared(result.claim, live if isinstance(live, Mapping) else None)
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        if not refs:
            return {}
        started, deadline = time.perf_counter(), time.monotonic() + CALL_BUDGET
        results = await self.state.unprepare(refs, deadline)
        self._record(metrics.UNPREPARE, started, list(results.values()))
        if self.reporter is not None:
            for ref in refs:
                if ref.uid in results and results[ref.uid] is None:
                    self.reporter.unprepared(ref)
        return results

    def _record(self, operation: metrics.ClaimOperation, started: float, errors: list[str | None]) -> None:
        """Per-claim metrics: the claims of one call share its duration (they are done together)."""
        seconds = time.perf_counter() - started
        for error in errors:
            operation.record(seconds, ok=not error)
        metrics.set_prepared_claims(self.state.prepared_count)

    async def _fetch_and_read(self, ref: ClaimRef) -> tuple[Fetched, ReadClaim]:
        """The claim as its GET returned it, and as read (:meth:`DeviceState.read`): read as soon
        as it is there, while the call's other GETs are still in flight."""
        fetched = await self._fetch(ref)
        return fetched, self.state.read(ref, fetched)

    async def _fetch(self, ref: ClaimRef) -> Fetched:
        try:
            ref.check()  # never put a malformed name into an API path
            async with asyncio.timeout(self.claim_get_timeout):  # token refresh included; no extra task
                return await self.get_claim(ref.namespace, ref.name)
        except ClaimError as error:
            return error
        except TimeoutError:
            return ClaimError(f"{ref}: reading it from the API server took over {self.claim_get_timeout:g}s")
        except Exception as error:  # the API server's answer, a dropped connection
            from gpudra_core.kubeapi import error_message

            return ClaimError(f"{ref}: reading it from the API server failed: {error_message(error) or error!r}")


def _log_registration_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the plugin registration socket could not be served: %r", task.exception())


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there to remove
        pass


def claim_getter(kube: Any) -> GetClaim:
    """GET a ResourceClaim through the agent's one API adapter."""
    from gpudra_core.kubeapi import resource_type

    claims = resource_type("resource.k8s.io/v1", "ResourceClaim")

    async def get(namespace: str, name: str) -> Mapping[str, Any] | None:
        return await kube.get(claims, name, namespace)

    return get
