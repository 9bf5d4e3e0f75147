"""`gpudra explain` against the real kube-scheduler: random cases (tests/explaincases.py: inventories
from the GPU profiles, classes from the templates, claims with random selectors, counts, All,
firstAvailable and matchAttribute, some devices held by another claim) applied to the real control
plane. The holders' pods are scheduled first; then for every case and node, a claim and a pod
pinned to that node; explain reads each pod from the live cluster (through the
command's own reads) while a scheduling gate holds it, then the gate is lifted and the scheduler
decides. Explain's verdict must be the scheduler's for every pod: scheduled or not, so the node set
of every claim agrees too, CEL error cases included.

CI runs GPUDRA_EXPLAIN_CASES (default 80) cases from GPUDRA_EXPLAIN_SEED (default 2026) in about a
minute; `make explain-diff` runs 300."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from explaincases import Case, generate
from schedpods import pinned_pod, scheduling_outcome
from gpudra_driver.kubeapi import Kube, Obj, resource_type
from gpudra_operator.explain import explain_snapshot
from gpudra_operator.explain.gather import read_snapshot
from gpudra_operator.localcluster.objects import create_fake_node, delete_node
from gpudra_operator.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
GATE = "gpudra.io/explain-first"
SEED = int(os.environ.get("GPUDRA_EXPLAIN_SEED", "2026"))
CASES = int(os.environ.get("GPUDRA_EXPLAIN_CASES", "80"))


def pod_name(case: Case, node_index: int) -> str:
    return f"c{case.index}-n{node_index}"


def _decided(pod: Obj) -> bool | None:
    outcome = scheduling_outcome(pod)
    return None if outcome is None else outcome[0]


def claim_object(name: str, namespace: str, spec: Obj) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def decisions_for(kube: Kube, namespace: str, names: Mapping[str, Any]) -> Callable[[], Awaitable[dict[str, bool] | None]]:
    """A probe: every named pod's scheduling outcome, once the scheduler has decided on all."""
    async def probe() -> dict[str, bool] | None:
        live = {p["metadata"]["name"]: _decided(p) async for p in kube.list(POD, namespace)}
        return {name: bool(live[name]) for name in names} if all(live.get(n) is not None for n in names) else None
    return probe


async def bounded(limit: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(job: Any) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(job) for job in jobs))


async def test_explain_agrees_with_the_scheduler_on_random_cases(kube: Kube, namespace: str) -> None:
    run_id = secrets.token_hex(3)
    cases = generate(SEED, CASES, run_id)
    nodes = [name for case in cases for name in case.nodes]
    pods = {pod_name(case, i): (case, node) for case in cases for i, node in enumerate(case.nodes)}
    started = asyncio.get_running_loop().time()
    try:
        await bounded(8, [create_fake_node(kube, name) for name in nodes])
        await bounded(8, [kube.create(s) for case in cases for s in case.slices]
                      + [kube.create(case.device_class) for case in cases])
        holders = {f"h{case.index}-n{i}": (case, node) for case in cases if case.holder_spec
                   for i, node in enumerate(case.nodes)}
        await bounded(8, [kube.create(claim_object(name, namespace, case.holder_spec))  # type: ignore[arg-type]
                          for name, (case, _) in holders.items()])
        await bounded(8, [kube.create(pinned_pod(name, namespace, node, name))
                          for name, (_, node) in holders.items()])
        held = await wait_for(decisions_for(kube, namespace, holders), timeout=120, interval=0.5,
                              what=f"the scheduler's decision on {len(holders)} holder pods")
        await bounded(8, [kube.create(claim_object(name, namespace, case.claim_spec)) for name, (case, _) in pods.items()])
        await bounded(8, [kube.create(pinned_pod(name, namespace, node, name, gate=GATE)) for name, (_, node) in pods.items()])

        # Explain each pod as `gpudra explain pod` would, while its gate holds it.
        verdicts = dict(zip(pods, await bounded(4, [
            _explain(kube, namespace, name, case.driver) for name, (case, _) in pods.items()])))
        await bounded(8, [kube.patch(POD, name, {"spec": {"schedulingGates": None}}, namespace=namespace)
                          for name in pods])

        decisions = await wait_for(decisions_for(kube, namespace, pods), timeout=120, interval=0.5,
                                   what=f"the scheduler's decision on {len(pods)} pods")
        # An unschedulable pod the scheduler would have placed once its informers caught up
        # would show up bound now: read once more after every decision is in.
        final = {p["metadata"]["name"]: _decided(p) async for p in kube.list(POD, namespace)}

        mismatches = []
        for name, (case, _) in pods.items():
            satisfiable, conclusion = verdicts[name]
            if satisfiable != decisions[name] or final[name] != decisions[name]:
                live = await kube.get(POD, name, namespace)
                message = next((c.get("message") for c in (live or {}).get("status", {}).get("conditions") or []
                                if c.get("type") == "PodScheduled"), "")
                mismatches.append(f"{name} ({case.description}, spec {case.claim_spec}): explain says "
                                  f"{satisfiable} ({conclusion}), the scheduler {decisions[name]} "
                                  f"(then {final[name]}): {message}")
        scheduled = sum(decisions.values())
        errors = sum(verdicts[n][1].startswith("the scheduler stops with an error") for n in pods)
        in_use = sum("in use by" in verdicts[n][1] for n in pods)
        print(f"\n[explain-diff] seed {SEED}: {len(cases)} cases, {len(pods)} pods, {scheduled} scheduled, "
              f"{len(pods) - scheduled} not, {errors} of them on a CEL or allocator error, {in_use} blocked by "
              f"devices in use ({sum(held.values())} of {len(held)} holders scheduled first); "
              f"{asyncio.get_running_loop().time() - started:.1f}s")
        assert not mismatches, "explain disagrees with the scheduler:\n" + "\n".join(mismatches)
        # The generator must exercise both outcomes and the error path, or the test proves little.
        assert 0 < scheduled < len(pods) and errors > 0 and in_use > 0
    finally:
        for case in cases:
            async for found in kube.list(SLICE, field_selector=f"spec.driver={case.driver}"):
                await kube.delete(SLICE, found["metadata"]["name"])
            await kube.delete(DEVICE_CLASS, case.device_class["metadata"]["name"])
        await bounded(8, [delete_node(kube, name) for name in nodes])


async def _explain(kube: Kube, namespace: str, name: str, driver: str) -> tuple[bool, str]:
    snapshot = await read_snapshot(kube, "pod", namespace, name, driver)
    verdict = explain_snapshot(snapshot, driver)
    return verdict.satisfiable, verdict.conclusion
