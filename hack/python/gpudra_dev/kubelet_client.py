"""The kubelet's side of the DRA plugin protocol, for tests, the benchmark and debugging.

:func:`register` does what the kubelet's plugin watcher does with a registration socket: GetInfo,
validate the answer the way ``validateSupportedServices`` does (first plugin-listed version the
kubelet supports), then NotifyRegistrationStatus. :class:`DraClient` then calls the DRA socket
the plugin named, through v1 or v1beta1. :func:`probe_health` is the kubelet's gRPC probe of the
agent's health port."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpudra_driver.plugin.sockets import SocketAddress
from gpudra_driver.plugin.gen import (dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc,
                                      pluginregistration_pb2, pluginregistration_pb2_grpc)

KUBELET_VERSIONS = {"v1.DRAPlugin": "v1", "v1beta1.DRAPlugin": "v1beta1"}  # servicesSupportedByKubelet
_API = {"v1": (dra_v1_pb2, dra_v1_pb2_grpc), "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}


class RegistrationRefused(Exception):
    pass


@dataclass(frozen=True)
class Registered:
    name: str
    endpoint: str
    version: str  # "v1" or "v1beta1": what this kubelet will call
    info: Any  # the PluginInfo


async def register(registration_socket: Path, *, driver: str | None = None,
                   prefer: Iterable[str] = KUBELET_VERSIONS) -> Registered:
    """The kubelet's registration handshake. ``prefer``: the service names this "kubelet" supports
    (pass ``["v1beta1.DRAPlugin"]`` to act like a 1.32/1.33 kubelet)."""
    supported = list(prefer)
    with SocketAddress(Path(registration_socket)) as address:
        return await _register(address, registration_socket, driver, supported)


async def _register(address: SocketAddress, registration_socket: Path, driver: str | None,
                    supported: list[str]) -> Registered:
    async with grpc.aio.insecure_channel(address.target) as channel:
        stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=1.0)
        error = _validate(info, driver, supported)
        status = pluginregistration_pb2.RegistrationStatus(plugin_registered=error is None, error=error or "")
        if error:
            try:  # the plugin answers a refusal with an error of its own; the kubelet only logs it
                await stub.NotifyRegistrationStatus(status, timeout=5)
            except grpc.aio.AioRpcError:
                pass
            raise RegistrationRefused(error)
        await stub.NotifyRegistrationStatus(status, timeout=5)
        version = next(v for v in info.supported_versions if v in supported)
        endpoint = info.endpoint or str(registration_socket)
        return Registered(info.name, endpoint, KUBELET_VERSIONS[version], info)


def _validate(info: Any, driver: str | None, supported: list[str]) -> str | None:
    if info.type != "DRAPlugin":
        return f"unexpected plugin type {info.type!r}"
    if driver is not None and info.name != driver:
        return f"plugin name {info.name!r}, expected {driver!r}"
    if not info.supported_versions:
        return "empty list of supported gRPC services (aka supported versions)"
    if not any(v in supported for v in info.supported_versions):
        return (f"none of services supported by the plugin ({list(info.supported_versions)}) are supported "
                f"by the kubelet ({supported})")
    return None


class DraClient:
    """Calls NodePrepareResources / NodeUnprepareResources like the kubelet (45 s deadline)."""

    def __init__(self, endpoint: str | Path, version: str = "v1") -> None:
        self.version = version
        self.pb, grpc_mod = _API[version]
        self.address = SocketAddress(Path(endpoint))  # held open: the channel may reconnect
        self.channel = grpc.aio.insecure_channel(self.address.target)
        self.stub = grpc_mod.DRAPluginStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()
        self.address.close()

    async def __aenter__(self) -> DraClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _claims(self, claims: Iterable[tuple[str, str, str]]) -> list[Any]:
        return [self.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]

    async def prepare(self, claims: Iterable[tuple[str, str, str]], timeout: float = 45) -> Any:
        """``claims``: (namespace, name, uid) triples. Returns the NodePrepareResourcesResponse."""
        request = self.pb.NodePrepareResourcesRequest(claims=self._claims(claims))
        return await self.stub.NodePrepareResources(request, timeout=timeout)

    async def unprepare(self, claims: Iterable[tuple[str, str, str]], timeout: float = 45) -> Any:
        request = self.pb.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        return await self.stub.NodeUnprepareResources(request, timeout=timeout)


async def probe_health(port: int, service: str = "liveness", timeout: float = 10) -> int:
    """The kubelet's gRPC probe: ``grpc.health.v1`` Check on ``localhost:port``; the status."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"localhost:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return response.status

