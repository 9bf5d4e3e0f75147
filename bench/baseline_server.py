"""The benchmark's baseline: a bare DRAPlugin v1 server whose NodePrepareResources does only what
no plugin can avoid, one ResourceClaim GET per claim (concurrently, through the same API adapter),
and answers without devices. Run as its own process, like the agent."""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

from gpudra_driver import eventloop
from gpudra_core.kubeapi import Kube, connect, resource_type
from gpudra_driver.plugin.gen import dra_v1_pb2, dra_v1_pb2_grpc
from gpudra_driver.plugin.sockets import SocketAddress

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")


class Baseline(dra_v1_pb2_grpc.DRAPluginServicer):
    def __init__(self, kube: Kube, unprepare_idle: float = 0.0) -> None:
        self.kube = kube
        self.unprepare_idle = unprepare_idle

    async def NodePrepareResources(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.gather(*(self.kube.get(CLAIM, c.name, c.namespace) for c in request.claims))
        response = dra_v1_pb2.NodePrepareResourcesResponse()
        for c in request.claims:
            response.claims[c.uid].error = ""
        return response

    async def NodeUnprepareResources(self, request, context):  # type: ignore[no-untyped-def]
        if self.unprepare_idle:  # the confound check (prepare_latency --aa-unprepare-idle)
            await asyncio.sleep(self.unprepare_idle)
        response = dra_v1_pb2.NodeUnprepareResourcesResponse()
        for c in request.claims:
            response.claims[c.uid].error = ""
        return response


async def main(socket_path: str, kubeconfig: str, unprepare_idle: float = 0.0) -> None:
    from pathlib import Path

    api = await connect(kubeconfig)
    server = grpc.aio.server()
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(Baseline(Kube(api, "gpudra-bench"), unprepare_idle), server)
    with SocketAddress(Path(socket_path)) as address:
        server.add_insecure_port(address.target)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(1)
    await api.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--event-loop", choices=eventloop.LOOPS, default=eventloop.DEFAULT,
                        help="the agent's loop, so that the two differ only in what the agent does")
    parser.add_argument("--unprepare-idle", type=float, default=0.0,
                        help="seconds each unprepare waits, idle, before it answers (a control: untimed work)")
    args = parser.parse_args()
    eventloop.run(main(args.socket, args.kubeconfig, args.unprepare_idle), args.event_loop)
