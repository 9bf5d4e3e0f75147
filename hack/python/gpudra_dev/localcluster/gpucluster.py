"""A whole gpudra installation on the local control plane: simulated GPU nodes, their agents, the
operator, and a kubelet stand-in. `gpudra-dev demo` and the e2e test both stand on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpudra_core.kubeapi import Kube, Obj, connect, resource_type

from gpudra_operator.crd import load_crd
from .agents import AgentProcess, start_agent
from .controlplane import ControlPlane
from .kubelet_sim import KubeletSimulator
from .objects import create_fake_node
from .operatorproc import OperatorProcess, start_operator
from .waiting import wait_for

CRD = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
GPU_NODE_LABELS = {"nvidia.com/gpu.present": "true"}


@dataclass(frozen=True)
class SimulatedNode:
    name: str
    profile: str


DEMO_NODES = (
    SimulatedNode("gpu-h100-0", "dgx-h100"),
    SimulatedNode("gpu-a100-40g-0", "dgx-a100-40gb"),
    SimulatedNode("gpu-a100-mig-0", "a100-80gb-mig"),
)


class LocalGpuCluster:
    """``async with LocalGpuCluster(...) as gc:`` starts everything; leaving stops everything."""

    def __init__(self, bin_dir: Path, workdir: Path, *, nodes: tuple[SimulatedNode, ...] = DEMO_NODES,
                 driver: str = "gpu.gpudra.io", say: Callable[[str], None] = print) -> None:
        self.plane = ControlPlane(bin_dir, workdir / "cluster")
        self.workdir = workdir
        self.nodes = nodes
        self.driver = driver
        self.say = say
        self.agents: dict[str, AgentProcess] = {}
        self.operator: OperatorProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.kube: Kube

    async def __aenter__(self) -> LocalGpuCluster:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        started = time.monotonic()
        self.say("starting etcd, kube-apiserver, kube-controller-manager and kube-scheduler")
        await asyncio.to_thread(self.plane.start)
        self.say(f"control plane ready in {time.monotonic() - started:.1f}s at {self.plane.server}")
        self._api = await connect(str(self.plane.kubeconfig))
        self.kube = Kube(self._api, field_manager="gpudra-demo")
        await self._install_crd()
        await self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpudra-system"}})
        # Shipped statically by manifests/ on a real cluster (the operator creates no RBAC).
        await self.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                               "metadata": {"name": "gpudra-agent", "namespace": "gpudra-system"}})
        for node in self.nodes:
            await create_fake_node(self.kube, node.name, GPU_NODE_LABELS)
            self.say(f"node {node.name}: fake driver root with the mock NVML library, profile {node.profile}; "
                     "agent starting (--nvml real)")
            self.agents[node.name] = start_agent(
                kubeconfig=self.plane.kubeconfig, node_name=node.name, nvml=f"mock:{node.profile}",
                driver=self.driver, workdir=self.agent_workdir(node.name),
                extra_args=("--pod-uid", f"demo-{node.name}"))
        # Pods with claims stay Pending until run_seed prepares them through the agent's socket.
        self.kubelet = KubeletSimulator(self.kube, hold_claims=True)
        self._tasks.append(asyncio.create_task(self.kubelet.run()))
        self.operator = start_operator(kubeconfig=self.plane.kubeconfig, log_path=self.workdir / "operator.log")
        self.say(f"operator started (log: {self.workdir / 'operator.log'})")

    async def _install_crd(self) -> None:
        crd = load_crd()
        await self.kube.apply(crd)

        async def established() -> bool:
            live = await self.kube.get(CRD, crd["metadata"]["name"])
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in ((live or {}).get("status") or {}).get("conditions") or [])

        await wait_for(established, timeout=60, what="the GpuDraConfig CRD to be Established")

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        if self.operator:
            self.operator.stop()
        for agent in self.agents.values():
            agent.stop()
        if getattr(self, "_api", None):
            await self._api.close()
        await asyncio.to_thread(self.plane.stop)

    # --- what a user does -----------------------------------------------------------------
    async def apply_file(self, path: Path) -> list[Obj]:
        """Server-side apply every document of a manifest, as `kubectl apply --server-side` does."""
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        return [await self.kube.apply(doc) for doc in docs]

    async def wait_ready(self, name: str, timeout: float = 90) -> Obj:
        async def ready() -> Obj | None:
            config = await self.kube.get(CONFIG, name)
            conditions = ((config or {}).get("status") or {}).get("conditions") or []
            ok = config is not None and any(c["type"] == "Ready" and c["status"] == "True"
                                            and c.get("observedGeneration") == config["metadata"]["generation"]
                                            for c in conditions)
            return config if ok else None

        return await wait_for(ready, timeout=timeout, what=f"GpuDraConfig {name} to be Ready")

    async def wait_published(self, timeout: float = 60) -> dict[str, list[Obj]]:
        """Every simulated node has published at least one slice."""
        async def published() -> dict[str, list[Obj]] | None:
            for name, agent in self.agents.items():
                assert agent.process.poll() is None, f"agent on {name} exited:\n{agent.log_tail()}"
            by_node: dict[str, list[Obj]] = {}
            async for s in self.kube.list(SLICE, field_selector=f"spec.driver={self.driver}"):
                by_node.setdefault(s["spec"]["nodeName"], []).append(s)
            return by_node if set(by_node) >= set(self.agents) else None

        return await wait_for(published, timeout=timeout, what="every node's ResourceSlices")

    def kubectl(self, *args: str, check: bool = True) -> str:
        result = self.plane.kubectl(*args, check=check)
        return result.stdout + result.stderr

    def agent_workdir(self, node_name: str) -> Path:
        return self.workdir / "nodes" / node_name

    def registration_socket(self, node_name: str) -> Path:
        """Where the kubelet of ``node_name`` would find the agent's registration socket."""
        from gpudra_driver.plugin.plugin import socket_paths

        return socket_paths(self.agent_workdir(node_name) / "kubelet", self.driver, f"demo-{node_name}")[1]

    def cdi_dir(self, node_name: str) -> Path:
        return self.agent_workdir(node_name) / "cdi"

    @property
    def env_hint(self) -> dict[str, Any]:
        return {"KUBECONFIG": str(self.plane.kubeconfig)}
