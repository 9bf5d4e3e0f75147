"""gpudra-allocator is the cluster's own release of Kubernetes' DRA code: against the real control
plane of each release (CI runs this on 1.35, 1.36 and 1.37), its default feature gates are the ones
the release's components start with (kube-apiserver's ``kubernetes_feature_enabled`` metric; the
scheduler is the same release), and its CEL judges a selector's cost as the API server does.

The cost check: the API server refuses a DeviceClass whose selector's estimated cost exceeds
1,000,000 ("too complex, exceeds cost limit"). Each family (tests/celcases.py) is a selector with a
size parameter ``n`` whose cost grows with ``n``, each exercising other cost rules (device paths and
their declared sizes, string and regex functions, quantities, the list and set extensions, macros,
``cel.bind``, conditionals, ``has()``). The helper's ``compile`` gives the largest ``n`` within the
limit; the API server must accept the selector at that ``n`` and refuse it at ``n + 1``: one cost
unit off anywhere on the way shows."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from kubernetes_asyncio.client.exceptions import ApiException

from celcases import FAMILIES, SINCE
from gpudra_core.kubeapi import Kube
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries

TOO_COMPLEX = "too complex, exceeds cost limit"


async def cost(helper: AllocatorHelper, expression: str) -> int:
    ((compiled,), limit) = await helper.compile([expression])
    assert limit == 1_000_000
    return compiled.max_cost


async def largest_within_limit(helper: AllocatorHelper, family: Callable[[int], str]) -> int:
    """The largest n whose estimate is within the limit (the cost grows with n); 0 when even n=1 is
    over it (an unbounded size: the API server must refuse n=1 then)."""
    async def within(n: int) -> bool:
        return await cost(helper, family(n)) <= 1_000_000

    if not await within(1):
        return 0
    low, high = 1, 2
    while await within(high):
        low, high = high, high * 2
        assert high < 2**40, f"the family never reaches the limit: {family(high)[:200]}"
    while high - low > 1:
        middle = (low + high) // 2
        if await within(middle):
            low = middle
        else:
            high = middle
    return low


def device_class(name: str, expression: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]}}


async def api_server_verdict(kube: Kube, name: str, expression: str) -> str | None:
    """None: accepted (dry run); else the API server's message."""
    try:
        await kube.create(device_class(name, expression), dry_run=True)
    except ApiException as error:
        return str(error.body)
    return None


async def test_the_helpers_estimate_draws_the_api_servers_line_for_every_family(kube: Kube) -> None:
    minor = await kube.server_minor()
    assert minor is not None
    families = {name: family for name, family in FAMILIES.items() if SINCE.get(name, 0) <= minor}
    async with AllocatorHelper(minor) as helper:
        assert helper.note is None, helper.note
        boundaries = {name: await largest_within_limit(helper, family) for name, family in families.items()}
        estimates = {name: (await cost(helper, family(max(n, 1))), await cost(helper, family(n + 1)))
                     for (name, family), n in zip(families.items(), boundaries.values())}
    verdicts = await asyncio.gather(*(
        asyncio.gather(api_server_verdict(kube, f"cost-{index}-in", family(max(boundaries[name], 1))),
                       api_server_verdict(kube, f"cost-{index}-out", family(boundaries[name] + 1)))
        for index, (name, family) in enumerate(families.items())))
    disagreements = []
    for (name, family), (inside, outside) in zip(families.items(), verdicts):
        n = boundaries[name]
        if n and inside is not None:
            disagreements.append(f"{name}: n={n} (estimate {estimates[name][0]}) refused: {inside[:300]}")
        if outside is None or TOO_COMPLEX not in outside:
            disagreements.append(f"{name}: n={n + 1} (estimate {estimates[name][1]}) not refused for cost: "
                                 f"{(outside or 'accepted')[:300]}")
    assert not disagreements, "\n".join(disagreements)


def api_server_gates(cluster: ControlPlane) -> dict[str, bool]:
    """The DRA feature gates kube-apiserver runs with, from its kubernetes_feature_enabled metric."""
    metrics = subprocess.run([str(find_binaries() / "kubectl"), "--kubeconfig", str(cluster.kubeconfig),
                              "get", "--raw", "/metrics"], capture_output=True, text=True, timeout=60, check=True,
                             env={**os.environ, "HOME": str(Path(cluster.kubeconfig).parent)}).stdout
    pattern = re.compile(r'^kubernetes_feature_enabled\{name="(DRA\w+)",stage="\w*"\} (\d)', re.M)
    return {name: value == "1" for name, value in pattern.findall(metrics)}


async def test_the_helpers_default_gates_are_the_releases(kube: Kube, cluster: ControlPlane) -> None:
    minor = await kube.server_minor()
    async with AllocatorHelper(minor) as helper:
        features = await helper.features()
    version = (await kube.request("GET", "/version"))["gitVersion"]
    assert version.lstrip("v").startswith(features["release"]), (version, features["release"])
    running = api_server_gates(cluster)
    assert running, "kube-apiserver reported no DRA feature gates"
    differ = {gate: (on, running.get(gate)) for gate, on in features["defaults"].items() if running.get(gate) != on}
    assert not differ, f"helper default vs kube-apiserver {version}: {differ}"
