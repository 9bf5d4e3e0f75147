"""Session-wide fixtures: one real control plane per test run, a Kube client, scratch namespaces
and fake Nodes per test. Nothing here fakes the API server; without binaries the run fails with
the command that fixes it. Every CDI spec an in-process test writes is validated (cdispec.py)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from cdispec import load_and_validate

from gpudra_core.kubeapi import Kube, Obj, connect
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_dev.localcluster.objects import (create_fake_node, create_scratch_namespace,
                                                  delete_namespace, delete_node)

REPO = Path(__file__).resolve().parent.parent


@dataclass
class CdiWrites:
    validated: list[Path] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)


@pytest.fixture(autouse=True)
def cdi_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[CdiWrites]:
    """Validates every CDI spec written in this test's process as it is written: CdiDir.write is
    how the driver writes one. A bad spec fails the test at teardown rather than raising inside
    the code under test, whose error handling could turn it into a per-claim error."""
    writes = CdiWrites()
    write = CdiDir.write

    def validating_write(self: CdiDir, *args: Any, **kwargs: Any) -> Path:
        path = write(self, *args, **kwargs)
        try:
            load_and_validate(path)
        except Exception as error:  # AssertionError, ValidationError, SchemaUnavailable, OSError
            writes.invalid.append(f"{path}: {type(error).__name__}: {error}")
        else:
            writes.validated.append(path)
        return path

    monkeypatch.setattr(CdiDir, "write", validating_write)
    yield writes
    if writes.invalid:
        pytest.fail("invalid CDI spec written:\n" + "\n".join(writes.invalid), pytrace=False)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler, started once."""
    plane = ControlPlane(find_binaries(), tmp_path_factory.mktemp("cluster"))
    started = time.monotonic()
    plane.start()
    print(f"\n[cluster] control plane ready in {time.monotonic() - started:.1f}s at {plane.server}")
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(plane.kubeconfig)
    try:
        yield plane
    finally:
        plane.stop()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def kube(cluster: ControlPlane) -> AsyncIterator[Kube]:
    api = await connect(str(cluster.kubeconfig))
    try:
        yield Kube(api, field_manager="gpudra-tests")
    finally:
        await api.close()


@pytest_asyncio.fixture(loop_scope="session")
async def namespace(kube: Kube) -> AsyncIterator[str]:
    name = await create_scratch_namespace(kube)
    try:
        yield name
    finally:
        await delete_namespace(kube, name)


FakeNodeFactory = Callable[..., Awaitable[Obj]]


@pytest_asyncio.fixture(loop_scope="session")
async def fake_nodes(kube: Kube) -> AsyncIterator[FakeNodeFactory]:
    """Factory for fake Nodes with unique names; all of them are deleted after the test."""
    created: list[str] = []

    async def make(prefix: str = "node", labels: dict[str, str] | None = None) -> Obj:
        name = f"{prefix}-{secrets.token_hex(3)}"
        node = await create_fake_node(kube, name, labels)
        created.append(name)
        return node

    try:
        yield make
    finally:
        for name in created:
            await delete_node(kube, name)
