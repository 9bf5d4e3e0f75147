"""Operator convergence against `kubectl apply --server-side` of the same objects, measured in the
same run on the same control plane; and the API requests of one drift tick on a converged config.

- create: GpuDraConfig with 10 DeviceClasses created -> Ready=True with every child present
- change: a spec change touching all 10 classes and the DaemonSet -> converged (Ready at the new
  generation, every child updated)
- baseline: `kubectl apply --server-side` of the rendered objects (a fresh set for "create", the
  changed set for "change"), process start included, as a user would run it
- drift tick: one reconcile of the converged config through a request-counting client
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench import Context, Result, at_most
from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.crd import default_object
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_dev.localcluster.objects import install_crd
from gpudra_dev.localcluster.operatorproc import start_operator
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.render import render

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
NAMESPACE = "gpudra-system"


def config_body(name: str, memory: str, image: str) -> Obj:
    classes = [{"name": f"{name}-c{i}.gpudra.io", "template": "min-memory", "parameters": {"memory": memory}}
               for i in range(10)]
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
            "spec": {"driverName": f"{name}.gpudra.io",
                     "agent": {"namespace": f"{name}-ns", "image": image, "nodeSelector": {"bench": "none"}},
                     "deviceClasses": classes}}


class CountingKube(Kube):
    """Counts every request by HTTP verb (watches included) — the operator's own adapter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: Counter[str] = Counter()

    async def request(self, method: str, path: str, **kwargs: Any) -> Obj:  # type: ignore[override]
        self.counts[method] += 1
        return await super().request(method, path, **kwargs)


def kubectl_apply(plane: ControlPlane, objects: list[Obj], workdir: Path) -> float:
    path = workdir / f"objects-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    started = time.perf_counter()
    plane.kubectl("apply", "--server-side", "--field-manager=bench", "-f", str(path))
    return time.perf_counter() - started


async def converged(kube: Kube, body: Obj, memory: str, image: str) -> bool:
    name = body["metadata"]["name"]
    live = await kube.get(CONFIG, name)  # cheap first: children are read only once status says Ready
    if live is None:
        return False
    ready = next((c for c in (live.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    if not ready or ready["status"] != "True" or ready.get("observedGeneration") != live["metadata"]["generation"]:
        return False
    # every child at once: the observer's own latency is not the operator's
    ds, *classes = await asyncio.gather(kube.get(DAEMONSET, "gpudra-agent", f"{name}-ns"),
                                        *(kube.get(DEVICE_CLASS, c["name"]) for c in body["spec"]["deviceClasses"]))
    if not ds or ds["spec"]["template"]["spec"]["containers"][0]["image"] != image:
        return False
    return all(live and f'quantity("{memory}")' in live["spec"]["selectors"][0]["cel"]["expression"]
               for live in classes)


async def run_bench(workdir: Path) -> dict[str, Any]:
    plane = ControlPlane(find_binaries(), workdir / "cluster")
    await asyncio.to_thread(plane.start)
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, "bench")
    operator = None
    try:
        await install_crd(kube)
        operator = start_operator(kubeconfig=plane.kubeconfig, log_path=workdir / "operator.log",
                                  env={"GPUDRA_DRIFT_INTERVAL": "3600"})
        create_op, create_kubectl, change_op, change_kubectl = [], [], [], []
        for round_ in range(-1, ROUNDS):  # round -1 warms up the operator (kopf start, first watch)
            for prefix in ("op", "kc"):
                await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"{prefix}{round_}-ns"}})
                await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                                   "metadata": {"name": "gpudra-agent", "namespace": f"{prefix}{round_}-ns"}})
            body = config_body(f"op{round_}", "64Gi", "example.com/gpudra:1")
            started = time.perf_counter()
            await kube.create(body)
            await wait_for(lambda: converged(kube, body, "64Gi", "example.com/gpudra:1"), timeout=60,
                           what="operator create", interval=0.01)
            create_op.append(time.perf_counter() - started)

            changed = config_body(f"op{round_}", "80Gi", "example.com/gpudra:2")
            started = time.perf_counter()
            await kube.patch(CONFIG, f"op{round_}", {"spec": changed["spec"]})
            await wait_for(lambda: converged(kube, changed, "80Gi", "example.com/gpudra:2"), timeout=60,
                           what="operator change", interval=0.01)
            change_op.append(time.perf_counter() - started)

            # The same objects, applied by kubectl: a fresh set, then the changed set.
            live = default_object(config_body(f"kc{round_}", "64Gi", "example.com/gpudra:1"))
            live["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
            objects = [_strip_owner(o) for o in render(live).objects]
            create_kubectl.append(await asyncio.to_thread(kubectl_apply, plane, objects, workdir))
            live = default_object(config_body(f"kc{round_}", "80Gi", "example.com/gpudra:2"))
            objects = [_strip_owner(o) for o in render(live).objects]
            change_kubectl.append(await asyncio.to_thread(kubectl_apply, plane, objects, workdir))
            if round_ < 0:
                for series in (create_op, create_kubectl, change_op, change_kubectl):
                    series.clear()

        # One drift tick on a converged config, through a counting client.
        counting = CountingKube(api, "gpudra-operator")
        reconciler = Reconciler(counting, EventRecorder(counting))
        converged_config = await kube.get(CONFIG, "op0")
        assert converged_config is not None
        outcome = await reconciler.reconcile(converged_config)
        assert outcome is not None
        tick = dict(counting.counts)
        writes = sum(n for verb, n in tick.items() if verb != "GET")
        return {
            "rounds": ROUNDS,
            "create_operator_s": statistics.median(create_op),
            "create_kubectl_s": statistics.median(create_kubectl),
            "create_ratio": statistics.median(create_op) / statistics.median(create_kubectl),
            "change_operator_s": statistics.median(change_op),
            "change_kubectl_s": statistics.median(change_kubectl),
            "change_ratio": statistics.median(change_op) / statistics.median(change_kubectl),
            "drift_tick_requests": tick,
            "drift_tick_writes": writes,
            "drift_tick_applied": outcome.applied,
        }
    finally:
        if operator is not None:
            operator.stop()
            kept = Path(tempfile.gettempdir()) / "gpudra-bench-operator.log"
            kept.write_bytes((workdir / "operator.log").read_bytes())
        await api.close()
        await asyncio.to_thread(plane.stop)


def _strip_owner(obj: Obj) -> Obj:
    obj["metadata"].pop("ownerReferences", None)  # no such uid exists: the GC would delete them
    return obj


async def run(ctx: Context) -> list[Result]:
    """The runner's entry (`python -m bench operator_reconcile`); its own control plane, as the
    operator under test watches cluster-wide."""
    result = await run_bench(ctx.workdir("operator_reconcile"))
    kubectl = "kubectl apply --server-side of the same objects"
    return [
        at_most("create -> Ready, 10 classes", result["create_ratio"], "x kubectl", 1.5,
                f"operator {result['create_operator_s']:.3f}s vs {kubectl} {result['create_kubectl_s']:.3f}s, "
                f"median of {result['rounds']}"),
        at_most("spec change -> converged", result["change_ratio"], "x kubectl", 1.5,
                f"operator {result['change_operator_s']:.3f}s vs {kubectl} {result['change_kubectl_s']:.3f}s"),
        Result("drift tick requests", sum(result["drift_tick_requests"].values()), "requests",
               note=f"{result['drift_tick_requests']} on a converged config with 10 classes"),
        at_most("drift tick writes", result["drift_tick_writes"], "requests", 0, "reads only"),
    ]


if __name__ == "__main__":
    sys.exit(__import__("bench.__main__", fromlist=["main"]).main(["operator_reconcile"]))
