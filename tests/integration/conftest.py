"""Integration fixtures on top of the session control plane (tests/conftest.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CRD = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")


def _established(crd: Obj | None) -> bool:
    conditions: list[dict[str, Any]] = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def crd_installed(kube: Kube) -> Obj:
    """crds/gpudraconfig.yaml applied (server-side) and Established; returns the live CRD."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())
    await kube.apply(crd)
    name = crd["metadata"]["name"]

    async def probe() -> Obj | None:
        live = await kube.get(CRD, name)
        return live if _established(live) else None

    return await wait_for(probe, timeout=60, what=f"CRD {name} to be Established")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Agent work dirs right under /tmp: the kubelet plugin's unix sockets live there, and a
    socket path must stay within 107 bytes (pytest's tmp_path is too deep for that)."""
    path = Path(tempfile.mkdtemp(prefix="gpudra-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def agents(cluster: ControlPlane, short_dir: Path) -> AsyncIterator[Callable[..., AgentProcess]]:
    """Start `gpudra agent` subprocesses for fake Nodes; all are stopped after the test."""
    started: list[AgentProcess] = []

    def start(node_name: str, nvml: str, driver: str, kubeconfig: Path | None = None,
              **kwargs: Any) -> AgentProcess:
        agent = start_agent(kubeconfig=kubeconfig or cluster.kubeconfig, node_name=node_name, nvml=nvml,
                            driver=driver, workdir=short_dir / f"{node_name}-{len(started)}", **kwargs)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
