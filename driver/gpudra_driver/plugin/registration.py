"""The plugin-registration service the kubelet's plugin watcher talks to.

The kubelet finds ``<kubelet-dir>/plugins_registry/<socket>`` with inotify, calls GetInfo (1 s
timeout), validates and registers the plugin, then calls NotifyRegistrationStatus. Removing the
socket deregisters this instance."""

from __future__ import annotations

import asyncio
import logging

import grpc

from gpudra_driver.plugin.gen import pluginregistration_pb2 as pb
from gpudra_driver.plugin.gen import pluginregistration_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration constants.go
# The kubelet picks the first entry of this list that it supports (v1 on 1.34+, v1beta1 on 1.32/1.33).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# KEP-4680 health streaming, listed when the agent monitors health. Kubelet 1.37 streams v1 when
# it is listed, else v1alpha1 (pkg/kubelet/cm/dra/plugin: pickHealthService); 1.35 and 1.36 call
# v1alpha1 whatever is listed, with their ResourceHealthStatus gate on (alpha, off, in 1.35; beta,
# on, from 1.36). Entries a kubelet does not know are skipped when it picks the DRAPlugin version.
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str, versions: tuple[str, ...] = SUPPORTED_VERSIONS) -> None:
        self.info = pb.PluginInfo(type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=versions)
        self.registered = asyncio.Event()
        self.error: str | None = None

    async def GetInfo(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.PluginInfo:
        return self.info

    async def NotifyRegistrationStatus(self, request: pb.RegistrationStatus,
                                       context: grpc.aio.ServicerContext) -> pb.RegistrationStatusResponse:
        if request.plugin_registered:
            self.error = None
            self.registered.set()
            log.info("registered with the kubelet as %s (%s)", self.info.name, ", ".join(self.info.supported_versions))
        else:
            self.error = request.error
            self.registered.clear()
            log.error("the kubelet refused to register %s: %s", self.info.name, request.error)
            # Upstream's registration server answers a refusal with an error as well.
            await context.abort(grpc.StatusCode.UNKNOWN, f"plugin registration failed: {request.error}")
        return pb.RegistrationStatusResponse()
