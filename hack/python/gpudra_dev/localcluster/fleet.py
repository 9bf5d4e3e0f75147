"""A simulated GPU fleet for benches: fake Nodes, each with one ResourceSlice of its GPUs (owned by
the Node, written directly as an agent would publish it) and one agent pod bound to it (no
kubelet: the pod stays Pending, which the slice GC counts as a running agent)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gpudra_core.kubeapi import Kube

from gpudra_operator.render import agent_labels
from .objects import create_fake_node, fake_slice

CREATE_CONCURRENCY = 32  # requests in flight while populating


async def bounded(jobs: Sequence[Callable[[], Awaitable[Any]]], limit: int = CREATE_CONCURRENCY) -> list[Any]:
    """Run ``jobs`` with at most ``limit`` in flight; their results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with semaphore:
            return await job()

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def node_names(start: int, stop: int) -> list[str]:
    return [f"gpu-{i:05d}" for i in range(start, stop)]


async def add_gpu_nodes(kube: Kube, names: Sequence[str], *, driver: str, devices: int, agent_namespace: str,
                        config_name: str) -> None:
    """Nodes ``names``, each with a ``devices``-GPU slice of ``driver`` and an agent pod of the
    GpuDraConfig ``config_name`` (its labels) in ``agent_namespace``."""
    nodes = await bounded([functools.partial(create_fake_node, kube, n) for n in names])
    labels = agent_labels(config_name)
    jobs: list[Callable[[], Awaitable[Any]]] = []
    for node in nodes:
        name, uid = node["metadata"]["name"], node["metadata"]["uid"]
        jobs.append(functools.partial(kube.create, fake_slice(
            f"{name}-{driver.replace('.', '-')}-0", driver, name, owner_uid=uid, devices=devices)))
        jobs.append(functools.partial(kube.create, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"gpudra-agent-{name}", "namespace": agent_namespace, "labels": labels},
            "spec": {"nodeName": name, "containers": [{"name": "agent", "image": "example.com/gpudra:bench"}]}}))
    await bounded(jobs)
