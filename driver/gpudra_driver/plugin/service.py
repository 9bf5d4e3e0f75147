"""gRPC servicers for DRAPlugin v1 and v1beta1: proto in, :class:`Core` calls, proto out; and for
DRAResourceHealth v1 and v1alpha1 (KEP-4680): the health feed out, as a stream.

Both versions share one implementation; they differ only in their message classes (v1beta1's
Device has no share_id). Every claim of a request appears in the response, each with its own
error, so one bad claim never fails the others. Only a bug turns into an RPC error."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import grpc

from gpudra_driver.plugin.devicemetadata import answer_cdi_ids
from gpudra_driver.plugin.model import DeviceHealth
from gpudra_driver.plugin.gen import (
    dra_health_v1_pb2, dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc, dra_v1_pb2,
    dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc,
)
from gpudra_driver.plugin.model import ClaimRef, PrepareResult

log = logging.getLogger(__name__)


class Feed(Protocol):
    @property
    def timeout(self) -> float: ...

    def watch(self) -> AsyncIterator[tuple[DeviceHealth, ...]]: ...

    async def close(self) -> None: ...


class Core(Protocol):
    async def prepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...

    async def unprepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, str | None]: ...


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _servicer(pb: ModuleType, base: type) -> type:
    has_share_id = "share_id" in pb.Device.DESCRIPTOR.fields_by_name

    class Servicer(base):  # type: ignore[misc, valid-type]
        def __init__(self, core: Core) -> None:
            self.core = core

        async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            refs = _refs(request)
            results = await self.core.prepare(refs)
            response = pb.NodePrepareResourcesResponse()
            for ref in refs:
                result = results.get(ref.uid) or PrepareResult(error=f"claim {ref.uid}: no result (bug)")
                out = response.claims[ref.uid]
                if result.error:
                    out.error = result.error
                    continue
                assert result.claim is not None
                for device, cdi_ids in zip(result.claim.devices, answer_cdi_ids(result.claim)):
                    added = out.devices.add(request_names=device.requests, pool_name=device.pool,
                                            device_name=device.device, cdi_device_ids=cdi_ids)
                    if device.share_id is not None and has_share_id:  # v1 only (KEP-5075, 1.35+)
                        added.share_id = device.share_id
            return response

        async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            refs = _refs(request)
            results = await self.core.unprepare(refs)
            response = pb.NodeUnprepareResourcesResponse()
            for ref in refs:
                error = results.get(ref.uid, f"claim {ref.uid}: no result (bug)")
                response.claims[ref.uid].error = error or ""
            return response

    Servicer.__name__ = Servicer.__qualname__ = f"DRAPlugin{pb.__name__.rsplit('_', 2)[-2].capitalize()}Servicer"
    return Servicer


V1Servicer = _servicer(dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginServicer)
V1beta1Servicer = _servicer(dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginServicer)

# API version name -> (servicer class, function adding it to a server)
VERSIONS = {
    "v1": (V1Servicer, dra_v1_pb2_grpc.add_DRAPluginServicer_to_server),
    "v1beta1": (V1beta1Servicer, dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server),
}


def _health_servicer(pb: ModuleType, base: type) -> type:
    service_name = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name  # "v1.DRAResourceHealth", ...

    class Servicer(base):  # type: ignore[misc, valid-type]
        def __init__(self, feed: Feed) -> None:
            self.feed = feed

        async def NodeWatchResources(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            """The complete list at once, then at each probe round (its time refreshed) and change,
            until the kubelet cancels the call."""
            timeout = int(self.feed.timeout)
            log.info("the kubelet watches device health through %s", service_name)
            async for devices in self.feed.watch():
                yield pb.NodeWatchResourcesResponse(devices=[
                    pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                                    health=pb.HealthStatus.Value(d.health), last_updated_time=int(d.updated),
                                    health_check_timeout_seconds=timeout, message=d.message)
                    for d in devices])

    Servicer.__name__ = Servicer.__qualname__ = \
        f"DRAResourceHealth{pb.__name__.rsplit('_', 2)[-2].capitalize()}Servicer"
    return Servicer


HealthV1Servicer = _health_servicer(dra_health_v1_pb2, dra_health_v1_pb2_grpc.DRAResourceHealthServicer)
HealthV1alpha1Servicer = _health_servicer(dra_health_v1alpha1_pb2,
                                          dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer)

# registration name (supported_versions) -> (servicer class, function adding it to a server)
HEALTH_SERVICES = {
    "v1.DRAResourceHealth": (HealthV1Servicer, dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server),
    "v1alpha1.DRAResourceHealth": (HealthV1alpha1Servicer,
                                   dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server),
}
