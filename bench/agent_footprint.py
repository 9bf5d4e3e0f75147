"""The node agent's resident memory as deployed, and what each candidate process setting is worth.

One agent runs on every GPU node, so its memory is paid once per node. Each sample starts an agent
the way the DaemonSet runs it (metrics and health ports served, ``--pod-uid``, the process
environment ``render.AGENT_PROCESS_ENV``; dgx-h100 profile), waits for its slice, registers it
with a kubelet-side client, has it serve NodePrepareResources (each of its 8 GPUs' claims alone,
then all 8 from concurrent callers; each unprepared again) and one health probe, then reads its
VmRSS. ``max(3, repeat // 2)`` samples per variant; the variants take turns sample by sample, so
a noisy machine's drift hits them alike.

- ``agent RSS as deployed``: the median; target <= 100 MiB.
- ``agent RSS after its first slice``: the same agents before any prepare (no target).
- one row per setting that :func:`candidates` names, toggled against the deployed environment (left out where
  the DaemonSet sets it, added where it does not): that variant's median RSS, and in the note what
  the setting saves (``GPUDRA_EVENT_LOOP=uvloop``: a negative saving is what the opt-in loop costs). A setting stays in the DaemonSet only where this row shows it earns its place
  (docs/agent.md, "Footprint").
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

from bench import Context, Result, at_most, median
from bench.prepare_latency import make_claims
from gpudra_core.kubeapi import Kube, resource_type
from gpudra_dev.kubelet_client import DraClient, probe_health, register
from gpudra_driver.plugin.plugin import socket_paths
from gpudra_dev.localcluster.agents import AGENT_RSS_BUDGET_MIB, AgentProcess, kubeconfig_ca_file, start_agent
from gpudra_dev.localcluster.controlplane import free_port
from gpudra_dev.localcluster.objects import create_fake_node, create_scratch_namespace, delete_node
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.render import AGENT_PROCESS_ENV

NAMESPACE = resource_type("v1", "Namespace")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
GPUS = 8  # the dgx-h100 profile's
TIMEOUT_S = 60
SERVING = 1  # grpc.health.v1 HealthCheckResponse.ServingStatus


def candidates(ca_file: str | None) -> dict[str, str]:
    """The process settings weighed, with the value each takes when set (the local cluster's CA
    file stands in for the ServiceAccount's, as ``start_agent`` does)."""
    return {"MALLOC_ARENA_MAX": "2", "SSL_CERT_FILE": ca_file or AGENT_PROCESS_ENV.get("SSL_CERT_FILE", ""),
            "PYTHONOPTIMIZE": "2",
            # the opt-in loop: what uvloop costs, as a negative saving
            "GPUDRA_EVENT_LOOP": "uvloop"}


async def sample(ctx: Context, plane: Any, kube: Kube, namespace: str, driver: str,
                 env: Mapping[str, str | None]) -> tuple[float, float]:
    """(MiB after the first slice, MiB after serving prepares and a health probe) of one agent."""
    node = f"fp-{secrets.token_hex(3)}"
    await create_fake_node(kube, node)
    agent: AgentProcess | None = None
    try:
        claims = await make_claims(kube, namespace, driver, node, GPUS, prefix=node)
        pod_uid = str(uuid.uuid4())
        workdir = ctx.workdir(f"agent_footprint/{node}")
        health_port = free_port()
        agent = start_agent(kubeconfig=plane.kubeconfig, node_name=node, nvml="fake:dgx-h100",
                            driver=driver, workdir=workdir, env=env, extra_args=(
                                "--pod-uid", pod_uid, "--metrics-port", str(free_port()),
                                "--health-port", str(health_port)))
        running = agent
        reg_socket = socket_paths(workdir / "kubelet", driver, pod_uid)[1]
        selector = f"spec.driver={driver},spec.nodeName={node}"

        async def published() -> bool:
            assert running.process.poll() is None, running.log_tail()
            if not reg_socket.is_socket():
                return False
            page = await kube.request("GET", SLICE.path(), query={"fieldSelector": selector})
            return sum(len(s["spec"].get("devices") or []) for s in page["items"]) == GPUS

        await wait_for(published, timeout=TIMEOUT_S, what=f"{node}'s slice and registration socket")
        started = agent.rss_mib()
        registered = await register(reg_socket, driver=driver)
        async with DraClient(registered.endpoint) as client:
            for claim in claims:
                _check(await client.prepare([claim]))
                await client.unprepare([claim])
            for response in await asyncio.gather(*(client.prepare([claim]) for claim in claims)):
                _check(response)
            await client.unprepare(claims)
        assert await probe_health(health_port) == SERVING
        served = agent.rss_mib()
        return started, served
    finally:
        if agent is not None:
            await asyncio.to_thread(agent.stop)
        await delete_node(kube, node)


def _check(response: Any) -> None:
    errors = [r.error for r in response.claims.values() if r.error]
    assert not errors, errors


async def run(ctx: Context) -> list[Result]:
    plane = await ctx.control_plane()
    kube = await ctx.kube()
    settings = candidates(kubeconfig_ca_file(plane.kubeconfig))
    # each variant: the env changes against the deployed environment (None: left out)
    variants: dict[str, dict[str, str | None]] = {"deployed": {}}
    for name, value in settings.items():
        variants[name] = {name: None} if name in AGENT_PROCESS_ENV else {name: value}
    driver = f"fp{secrets.token_hex(3)}.gpudra.io"
    namespace = await create_scratch_namespace(kube, "fp")
    started: dict[str, list[float]] = {v: [] for v in variants}
    served: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(max(3, ctx.repeat // 2)):  # each sample is a new interpreter: fewer rounds
            for variant, env in variants.items():
                first, after = await sample(ctx, plane, kube, namespace, driver, env)
                started[variant].append(first)
                served[variant].append(after)
    finally:
        await kube.delete(NAMESPACE, namespace)

    def spread(samples: list[float]) -> str:
        return f"min {min(samples):.1f}, max {max(samples):.1f}, n={len(samples)}"

    deployed = median(served["deployed"])
    rows = [
        at_most("agent RSS as deployed", round(deployed, 1), "MiB", AGENT_RSS_BUDGET_MIB,
                f"VmRSS after 16 NodePrepares and a health probe; {spread(served['deployed'])}"),
        Result("agent RSS after its first slice", round(median(started["deployed"]), 1), "MiB",
               note=f"the same agents before any prepare; {spread(started['deployed'])}"),
    ]
    for name, value in settings.items():
        rss = median(served[name])
        if name in AGENT_PROCESS_ENV:
            metric, saved = f"agent RSS without {name}", rss - deployed
        else:
            metric, saved = f"agent RSS with {name}={os.path.basename(value)}", deployed - rss
        rows.append(Result(metric, round(rss, 1), "MiB",
                           note=f"{name} saves {saved:.1f} MiB ({saved / deployed:.1%}; medians; "
                                f"as deployed spans {max(served['deployed']) - min(served['deployed']):.1f}); "
                                f"{spread(served[name])}"))
    return rows
