"""Node agent publishing latency and footprint, on the local control plane with simulated NVML.

Latencies are medians over ``ctx.repeat`` runs, each reported as a ratio to the median of one
bare ResourceSlice create + get round trip measured in the same run (so the numbers travel
between machines); the absolute medians are in the notes. Every time is taken when the bench's
own watch on the node's slices delivers the event, not by polling.

- start: ``gpudra agent`` process started -> its first slice visible (interpreter start included)
- restore: one of its slices deleted -> a new one visible
- republish: the simulated device set changed on disk -> a slice with the new devices visible;
  this agent rescans every 0.05 s, so up to one interval of the figure is the rescan period
- idle CPU: a started agent's CPU use over the 10 s after its first publish (target: ~0, here
  <= 1% of a core), run as the DaemonSet runs it: metrics and health served, with the DaemonSet's
  process environment (``render.AGENT_PROCESS_ENV``). Its memory: ``agent_footprint``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import time
from pathlib import Path
from typing import Any

import yaml

from bench import Context, Result, at_most, median
from bench._watchlog import WatchLog
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import free_port
from gpudra_dev.localcluster.objects import create_fake_node, delete_node

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
PROFILES = Path(__file__).resolve().parents[1] / "driver" / "gpudra_driver" / "profiles"
IDLE_WINDOW_S = 10.0
IDLE_CPU_TARGET = 0.01  # fraction of one core


def slice_events(kube: Kube, driver: str, node: str) -> WatchLog:
    """A recorded watch on one node's slices of one driver."""
    return WatchLog(kube, SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")


def devices_of(obj: Obj) -> list[str]:
    return [d["name"] for d in obj["spec"].get("devices") or []]


def has_devices(count: int, kind: str, obj: Obj) -> bool:
    return len(devices_of(obj)) == count


async def bare_round_trip(kube: Kube, node: str, driver: str, i: int) -> float:
    body: Obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"bare-{node}-{i}"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": f"bare-{i}", "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}]}}
    started = time.perf_counter()
    await kube.create(body)
    got = await kube.get(SLICE, body["metadata"]["name"])
    elapsed = time.perf_counter() - started
    assert got is not None
    await kube.delete(SLICE, body["metadata"]["name"])
    return elapsed


def proc_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; utime, stime are fields 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Agents:
    def __init__(self, ctx: Context, kube: Kube) -> None:
        self.ctx, self.kube = ctx, kube
        self.procs: list[AgentProcess] = []
        self.nodes: list[str] = []

    async def node(self, prefix: str) -> str:
        name = f"{prefix}-{secrets.token_hex(3)}"
        await create_fake_node(self.kube, name)
        self.nodes.append(name)
        return name

    def start(self, node: str, nvml: str, driver: str, **kwargs: Any) -> AgentProcess:
        agent = start_agent(kubeconfig=self.ctx._plane.kubeconfig, node_name=node, nvml=nvml, driver=driver,
                            workdir=self.ctx.workdir(f"agents/{node}"), **kwargs)
        self.procs.append(agent)
        return agent

    async def close(self) -> None:
        for agent in self.procs:
            await asyncio.to_thread(agent.stop)
        for node in self.nodes:
            await delete_node(self.kube, node)


async def run(ctx: Context) -> list[Result]:
    await ctx.control_plane()
    kube = await ctx.kube()
    agents = Agents(ctx, kube)
    driver = f"b{secrets.token_hex(3)}.gpudra.io"
    try:
        node = await agents.node("bare")
        await bare_round_trip(kube, node, driver, -1)  # warm the connection
        bare = median([await bare_round_trip(kube, node, driver, i) for i in range(ctx.repeat)])

        # start -> first slice; idle CPU of the first agent
        starts: list[float] = []
        cpu = 0.0
        for i in range(max(3, ctx.repeat // 2)):  # each start is a new interpreter: fewer rounds
            node = await agents.node("start")
            events = slice_events(kube, driver, node)
            await events.start()
            started = time.perf_counter()
            # as the DaemonSet runs it: metrics and health served (and its process env, which
            # start_agent applies)
            agent = agents.start(node, "fake:dgx-h100", driver, extra_args=(
                "--metrics-port", str(free_port()), "--health-port", str(free_port())))
            at, _ = await events.first(0, lambda kind, obj: len(devices_of(obj)) == 8, "the first slice")
            starts.append(at - started)
            if i == 0:
                cpu_before, window_start = proc_cpu_s(agent.process.pid), time.monotonic()
                await asyncio.sleep(IDLE_WINDOW_S)  # the measurement window itself
                cpu = (proc_cpu_s(agent.process.pid) - cpu_before) / (time.monotonic() - window_start)
            await events.stop()
            await asyncio.to_thread(agent.stop)

        # deleted -> restored, on one long-lived agent
        node = await agents.node("restore")
        events = slice_events(kube, driver, node)
        await events.start()
        agents.start(node, "fake:l4x2", driver)
        _, live = await events.first(0, lambda kind, obj: len(devices_of(obj)) == 2, "the L4s")
        restores: list[float] = []
        for _ in range(ctx.repeat):
            mark = events.mark()
            old_uid = live["metadata"]["uid"]
            started = time.perf_counter()
            await kube.delete(SLICE, live["metadata"]["name"])
            at, live = await events.first(mark, lambda kind, obj: kind == "ADDED" and obj["metadata"]["uid"] != old_uid,
                                          "the restored slice")
            restores.append(at - started)
        await events.stop()

        # device change -> republished
        node = await agents.node("change")
        profile = yaml.safe_load((PROFILES / "dgx-h100.yaml").read_text())
        path = ctx.workdir("profiles") / f"{node}.yaml"
        _write(path, profile)
        events = slice_events(kube, driver, node)
        await events.start()
        agents.start(node, f"fake:{path}", driver, rescan_interval=0.05)
        await events.first(0, lambda kind, obj: len(devices_of(obj)) == 8, "the H100s")
        changes: list[float] = []
        for i in range(ctx.repeat):
            count = 7 if i % 2 == 0 else 8
            mark = events.mark()
            started = time.perf_counter()
            _write(path, {**profile, "gpus": profile["gpus"][:count]})
            at, _ = await events.first(mark, functools.partial(has_devices, count), f"{count} devices")
            changes.append(at - started)
        await events.stop()
    finally:
        await agents.close()

    def ratio(metric: str, samples: list[float]) -> Result:
        value = median(samples)
        return Result(metric, value / bare, "x round trip",
                      note=f"median {value * 1000:.1f} ms, min {min(samples) * 1000:.1f}, "
                           f"max {max(samples) * 1000:.1f}, n={len(samples)}")

    return [
        Result("bare ResourceSlice create+get", bare * 1000, "ms", note=f"median of {ctx.repeat}"),
        ratio("agent start -> first slice", starts),
        ratio("slice deleted -> restored", restores),
        ratio("device change -> republished", changes),
        at_most("slice deleted -> restored (absolute)", median(restores), "s", 2.0),
        at_most("agent idle CPU", round(cpu * 100, 3), "% of a core", IDLE_CPU_TARGET * 100,
                f"utime+stime over {IDLE_WINDOW_S:g} s after the first publish"),
    ]


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)  # atomically: the agent rescans the file every 0.05 s
