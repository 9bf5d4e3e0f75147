"""Kubernetes' own DRA CEL for tests that check gpudra's Python against it: gpudra-allocator's
``match`` op (operator/gpudra-allocator, k8s.io/dynamic-resource-allocation/cel as kube-scheduler
runs it) of a release. Used where gpudra itself still parses what CEL parses (quantities:
gpudra_core.quantity against ``isQuantity``/``quantity``). Without the binary a test fails with
the command that builds it (gpudra_operator.allocatorhelper's message); it never skips."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from typing import Any

from gpudra_operator.allocatorhelper import AllocatorHelper, Outcome


def ask(queries: Iterable[tuple[str, Mapping[str, Any]]], minor: int | None = None) -> list[Outcome]:
    """One outcome per (expression, ResourceSlice device with its ``driver``) query, from the
    helper of Kubernetes 1.<minor> (default: the oldest supported)."""
    pairs = [(expression, json.dumps(device, sort_keys=True)) for expression, device in queries]
    expressions = list(dict.fromkeys(e for e, _ in pairs))
    devices = list(dict.fromkeys(d for _, d in pairs))

    async def run() -> list[list[Outcome]]:
        async with AllocatorHelper(minor, timeout=300) as helper:
            inputs = []
            for text in devices:
                device = json.loads(text)
                driver = str(device.pop("driver"))
                inputs.append((driver, {"name": "d", **device}))
            return (await helper.match(expressions, inputs))[1]

    rows = asyncio.run(run())
    column = {e: i for i, e in enumerate(expressions)}
    row = {d: i for i, d in enumerate(devices)}
    return [rows[row[d]][column[e]] for e, d in pairs]
