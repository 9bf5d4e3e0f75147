"""Integration fixtures on top of the session control plane (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest_asyncio
import yaml

from gpudra_driver.kubeapi import Kube, Obj, resource_type
from gpudra_operator.localcluster.waiting import wait_for

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
