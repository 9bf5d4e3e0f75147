"""The agent's liveness: ``grpc.health.v1`` on a TCP port, for the kubelet's gRPC probes (the
DaemonSet's startupProbe and livenessProbe; dra-example-driver's healthcheck does the same).

A check dials the plugin's own sockets by path, as the kubelet does, and afresh each time: an open
connection outlives its socket file, so only a new one notices a file removed from under the agent
(a cleaned-up ``plugins_registry``: the kubelet has deregistered the plugin and will not call it
again until the agent restarts and serves a new socket). It passes when the DRA socket answers a
NodePrepareResources without claims and, once the registration socket is served (after the first
discovery; an agent still waiting for NVML stays alive), that socket answers GetInfo. The check
runs on the agent's event loop, so a wedged loop fails it too: the probe times out."""

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
FRESH_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PluginSockets(Protocol):
    @property
    def dra_socket(self) -> Path: ...

    @property
    def registration_socket(self) -> Path: ...

    @property
    def registration_served(self) -> bool: ...


async def liveness_problem(plugin: PluginSockets, timeout: float = CHECK_TIMEOUT) -> str | None:
    """Why the plugin cannot serve the kubelet now; None when it can."""
    checks = [("DRA", plugin.dra_socket, _answers_prepare)]
    if plugin.registration_served:
        checks.append(("registration", plugin.registration_socket, _answers_get_info))
    for name, path, call in checks:
        if not path.is_socket():
            return f"the {name} socket {path} is gone"
        try:
            with SocketAddress(path) as address:
                # its own subchannel pool: a new connection, not one another channel kept open
                async with grpc.aio.insecure_channel(address.target, options=FRESH_CONNECTION) as channel:
                    await call(channel, timeout)
        except (grpc.aio.AioRpcError, OSError, ValueError, asyncio.TimeoutError) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else error
            return f"the {name} socket {path} does not answer: {detail}"
    return None


async def _answers_prepare(channel: grpc.aio.Channel, timeout: float) -> None:
    await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout, wait_for_ready=False)


async def _answers_get_info(channel: grpc.aio.Channel, timeout: float) -> None:
    await pluginregistration_pb2_grpc.RegistrationStub(channel).GetInfo(
        pluginregistration_pb2.InfoRequest(), timeout=timeout, wait_for_ready=False)


class LivenessServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, plugin: PluginSockets) -> None:
        self.plugin = plugin

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.service not in SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        problem = await liveness_problem(self.plugin)
        if problem is not None:
            log.warning("liveness check failed (the kubelet restarts the agent after repeated failures): %s",
                        problem)
        return health_pb2.HealthCheckResponse(status=SERVING if problem is None else NOT_SERVING)


async def serve(port: int, plugin: PluginSockets) -> tuple[grpc.aio.Server, int]:
    """The health service on ``port`` of every address of the pod (0: a free port); the server
    and its port."""
    server = grpc.aio.server()
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
