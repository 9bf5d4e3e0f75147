"""The agent's liveness: ``grpc.health.v1`` on a TCP port, for the kubelet's gRPC probes (the
DaemonSet's startupProbe and livenessProbe; dra-example-driver's healthcheck does the same).

A check dials the plugin's own sockets by path, as the kubelet does, and afresh each time: an open
connection outlives its socket file, so only a new one notices a file removed from under the agent
(a cleaned-up ``plugins_registry``: the kubelet has deregistered the plugin and will not call it
again until the agent restarts and serves a new socket). It passes when the DRA socket answers a
NodePrepareResources without claims and, once the registration socket is served (after the first
discovery; an agent still waiting for NVML stays alive), that socket answers GetInfo. The empty
call takes no node lock, so a peer holding the lock never gets this instance restarted; a call
holding it for longer than any call may (a hung disk) fails the check instead. The check runs on the agent's event loop, so a wedged loop fails it too: the probe
times out.

The port is open to the pod network, so a check costs little and is shared: concurrent callers
wait for the one in flight, at most a few calls are served at once, and a failure is logged when
its reason changes, not on every call."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpudra_driver.plugin.gen import dra_v1_pb2, dra_v1_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from gpudra_driver.plugin.sockets import SocketAddress

log = logging.getLogger(__name__)

SERVICES = ("", "liveness")  # the whole server, and the name the DaemonSet's probes ask for
CHECK_TIMEOUT = 3.0  # per socket; the probes' timeoutSeconds leaves room for both
# A call answers within the kubelet's 45 s (plugin.CALL_BUDGET); one holding the node lock this
# long answers nothing again.
CALL_STUCK_AFTER = 120.0
# Its own subchannel pool: a new connection even where another channel of this process (a test's
# kubelet client) is connected to the same path, to the server behind a file since removed.
FRESH_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
MAX_CONCURRENT_CHECKS = 4
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PluginSockets(Protocol):
    @property
    def dra_socket(self) -> Path: ...

    @property
    def registration_socket(self) -> Path: ...

    @property
    def registration_served(self) -> bool: ...

    def busy_for(self) -> float: ...


async def liveness_problem(plugin: PluginSockets, timeout: float = CHECK_TIMEOUT) -> str | None:
    """Why the plugin cannot serve the kubelet now; None when it can."""
    if (running := plugin.busy_for()) > CALL_STUCK_AFTER:
        return f"the prepare/unprepare call that took the node lock {running:.0f}s ago is not done (a hung disk?)"
    checks = [("DRA", plugin.dra_socket, _answers_prepare)]
    if plugin.registration_served:
        checks.append(("registration", plugin.registration_socket, _answers_get_info))
    for name, path, call in checks:
        try:
            if not path.is_socket():
                return f"the {name} socket {path} is gone"
            with SocketAddress(path) as address:
                async with grpc.aio.insecure_channel(address.target, options=FRESH_CONNECTION) as channel:
                    await call(channel, timeout)
        except (grpc.aio.AioRpcError, OSError, ValueError, asyncio.TimeoutError) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else error
            return f"the {name} socket {path} does not answer: {detail}"
    return None


async def _problem_or_bug(plugin: PluginSockets) -> str | None:
    try:
        return await liveness_problem(plugin)
    except Exception as error:  # a bug of the check: reported like any failure, with its reason
        log.exception("the liveness check itself failed")
        return f"the liveness check failed: {error!r}"


async def _answers_prepare(channel: grpc.aio.Channel, timeout: float) -> None:
    await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout, wait_for_ready=False)


async def _answers_get_info(channel: grpc.aio.Channel, timeout: float) -> None:
    await pluginregistration_pb2_grpc.RegistrationStub(channel).GetInfo(
        pluginregistration_pb2.InfoRequest(), timeout=timeout, wait_for_ready=False)


class LivenessServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, plugin: PluginSockets) -> None:
        self.plugin = plugin
        self._in_flight: asyncio.Task[str | None] | None = None
        self._last_problem: str | None = None

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.service not in SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        if self._in_flight is None or self._in_flight.done():
            self._in_flight = asyncio.ensure_future(_problem_or_bug(self.plugin))
            self._in_flight.add_done_callback(self._report)
        # shielded: a caller that gives up does not cancel the check the others wait for
        problem = await asyncio.shield(self._in_flight)
        return health_pb2.HealthCheckResponse(status=SERVING if problem is None else NOT_SERVING)

    def _report(self, check: asyncio.Task[str | None]) -> None:
        """Log a failure when its reason changes, and the recovery."""
        if check.cancelled():  # the server stopping
            return
        problem = check.result()
        if problem != self._last_problem:
            if problem is not None:
                log.warning("liveness check failed (the kubelet restarts the agent after repeated failures): %s",
                            problem)
            else:
                log.info("liveness check passes again")
        self._last_problem = problem


async def serve(port: int, plugin: PluginSockets) -> tuple[grpc.aio.Server, int]:
    """The health service on ``port`` of every address of the pod (0: a free port); the server
    and its port."""
    # so_reuseport off: a port another process holds is an error here, not a silent share of it
    server = grpc.aio.server(maximum_concurrent_rpcs=MAX_CONCURRENT_CHECKS, options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(LivenessServicer(plugin), server)
    try:
        bound = server.add_insecure_port(f"[::]:{port}")
    except RuntimeError as error:  # grpcio raises where older versions returned 0
        raise OSError(f"cannot serve the health check on port {port}: {error}") from None
    if bound == 0:
        raise OSError(f"cannot serve the health check on port {port}")
    await server.start()
    log.info("health check (grpc.health.v1, service 'liveness') on port %d", bound)
    return server, bound
