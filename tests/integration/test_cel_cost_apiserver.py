"""The selector cost estimate (gpudra_operator.cel.cost) against the real API server.

The API server refuses a DeviceClass whose selector's estimated cost exceeds 1,000,000 ("too
complex, exceeds cost limit"). Each family below is a selector with a size parameter ``n`` whose
cost grows with ``n``, each exercising other cost rules (device paths and their declared sizes,
string and regex functions, quantities, the list and set extensions, macros, ``cel.bind``,
conditionals, ``has()``). Our estimator gives the largest ``n`` within the limit; the API server
must accept the selector at that ``n`` and refuse it at ``n + 1``. Agreement at the boundary, for
every family, is what "the same estimate" means: one cost unit off anywhere on the way shows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from celcases import CAP, FAMILIES, SINCE, A
from gpudra_driver.kubeapi import Kube
from gpudra_operator.cel import compile_selector
from gpudra_operator.cel.cost import SELECTOR_MAX_COST
from gpudra_operator.cel.releases import CelRelease, release_of

TOO_COMPLEX = "too complex, exceeds cost limit"


def cost(expression: str, release: CelRelease) -> int:
    return compile_selector(expression, release).max_cost


def largest_within_limit(family: Callable[[int], str], release: CelRelease) -> int:
    """The largest n whose estimate (as ``release`` estimates) is within the limit (the cost grows
    with n); 0 when even n=1 is over it (an unbounded size: the API server must refuse n=1 then)."""
    def within(n: int) -> bool:
        return cost(family(n), release) <= SELECTOR_MAX_COST

    if not within(1):
        return 0
    low, high = 1, 2
    while within(high):
        low, high = high, high * 2
        assert high < 2**40, f"the family never reaches the limit: {family(high)[:200]}"
    while high - low > 1:
        middle = (low + high) // 2
        if within(middle):
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


async def test_the_estimate_draws_the_api_servers_line_for_every_family(kube: Kube) -> None:
    release = release_of(await kube.server_minor())
    families = {name: family for name, family in FAMILIES.items() if SINCE.get(name, 0) <= release.minor}
    boundaries = {name: largest_within_limit(family, release) for name, family in families.items()}
    verdicts = await asyncio.gather(*(
        asyncio.gather(api_server_verdict(kube, f"cost-{index}-in", family(max(boundaries[name], 1))),
                       api_server_verdict(kube, f"cost-{index}-out", family(boundaries[name] + 1)))
        for index, (name, family) in enumerate(families.items())))
    disagreements = []
    for (name, family), (inside, outside) in zip(families.items(), verdicts):
        n = boundaries[name]
        if n and inside is not None:
            disagreements.append(f"{name}: n={n} (estimate {cost(family(n), release)}) refused: {inside[:300]}")
        if outside is None or TOO_COMPLEX not in outside:
            disagreements.append(f"{name}: n={n + 1} (estimate {cost(family(n + 1), release)}) not refused for cost: "
                                 f"{(outside or 'accepted')[:300]}")
    assert not disagreements, "\n".join(disagreements)


@pytest.mark.parametrize("expression", [
    'device.driver == "gpu.gpudra.io"',
    f'{A}.productName.startsWith("NVIDIA") && {CAP}.memory.compareTo(quantity("40Gi")) >= 0',
])
async def test_everyday_selectors_are_cheap(expression: str) -> None:
    assert all(cost(expression, release_of(minor)) < 100 for minor in (35, 36, 37))
