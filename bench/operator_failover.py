"""Operator failover with the default leader-election settings (10 s lease, 7 s renew deadline,
2 s retry), two `gpudra operator` replicas on this bench's own control plane, each round with a
fresh standby:

- SIGKILL: the active replica killed at a random point of its renewal period, a spec change
  (three DeviceClasses) made at once; the time
  to the standby holding the Lease, and to the change converged (Ready at the new generation, every
  class as the new spec says). Target: converged within 15 s.
- SIGTERM: the active replica stopped gracefully (it releases the Lease), the same change; the time
  to the standby holding the Lease (target: under 2 s) and to the change converged.
- partition: the active replica reaches the API server through a proxy that stops forwarding;
  the time to that replica exiting (it fences itself at its renew deadline) and to the standby
  holding the Lease, which must come later.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

from bench import Context, Result, at_most
from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.leaderelection import LEASE, LEASE_NAME, LOST_LEASE_EXIT, Timing
from gpudra_dev.localcluster.controlplane import HOST, ControlPlane, find_binaries
from gpudra_dev.localcluster.objects import install_crd
from gpudra_dev.localcluster.replicas import Replica, Replicas
from gpudra_dev.localcluster.tcpproxy import TcpProxy
from gpudra_dev.localcluster.waiting import wait_for

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
ROUNDS = int(os.environ.get("BENCH_FAILOVER_ROUNDS", "5"))
LEASE_NAMESPACE, NAME = "gpudra-operator", "failover"
CLASSES = [f"failover-c{i}.gpudra.io" for i in range(3)]
TIMING = Timing()
FAILOVER_TARGET, HANDOVER_TARGET = 15.0, 2.0


def spec(memory: str) -> Obj:
    return {"driverName": "failover.gpudra.io",
            "agent": {"namespace": NAME, "nodeSelector": {"bench": "none"}},
            "deviceClasses": [{"name": c, "template": "min-memory", "parameters": {"memory": memory}} for c in CLASSES],
            "resourceSliceGC": {"interval": "1h"}}


async def converged(kube: Kube, memory: str) -> bool:
    live = await kube.get(CONFIG, NAME)
    ready = next((c for c in ((live or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    if not live or not ready or ready["status"] != "True" \
            or live["status"].get("observedGeneration") != live["metadata"]["generation"]:
        return False
    classes = await asyncio.gather(*(kube.get(DEVICE_CLASS, c) for c in CLASSES))
    return all(c and f'quantity("{memory}")' in c["spec"]["selectors"][0]["cel"]["expression"] for c in classes)


class Rounds:
    def __init__(self, kube: Kube, replicas: Replicas) -> None:
        self.kube, self.replicas = kube, replicas
        self.memory = 64
        self.count = 0

    def next_user(self) -> str:
        self.count += 1
        return f"operator-{self.count}"

    async def change(self) -> str:
        """Change every class; the memory the converged classes must show."""
        self.memory += 1
        await self.kube.patch(CONFIG, NAME, {"spec": spec(f"{self.memory}Gi")})
        return f"{self.memory}Gi"

    async def until_converged(self, memory: str, timeout: float) -> None:
        await wait_for(lambda: converged(self.kube, memory), timeout=timeout, what=f"the change to {memory}",
                       interval=0.02)

    async def at_a_random_phase(self) -> None:
        """Return at a uniformly random point of the holder's renewal period. Starting a replica
        starves the holder's loop on 2 vCPUs, so right after one the holder has always just
        renewed, the worst case for a SIGKILL (the full lease duration to wait)."""
        renewed = await self._renew_time()

        async def renewed_again() -> bool:
            return await self._renew_time() != renewed

        await wait_for(renewed_again, timeout=TIMING.renew_deadline, what="a renewal", interval=0.01)
        await asyncio.sleep(random.uniform(0, TIMING.retry_period))  # the sampled phase itself

    async def _renew_time(self) -> str | None:
        lease = await self.kube.get(LEASE, LEASE_NAME, LEASE_NAMESPACE)
        return ((lease or {}).get("spec") or {}).get("renewTime")

    async def stop(self, active: Replica, standby: Replica, sig: int) -> tuple[float, float]:
        """Signal the active replica, change the spec: (seconds to the standby holding the Lease,
        seconds to the change converged)."""
        await self.at_a_random_phase()
        started = time.monotonic()
        active.operator.process.send_signal(sig)
        memory = await self.change()
        await self.replicas.wait_holder(standby, timeout=TIMING.lease_duration + 20)
        held = time.monotonic() - started
        await self.until_converged(memory, timeout=30)
        return held, time.monotonic() - started

    async def cut(self, plane: ControlPlane) -> tuple[float, float]:
        """A new active replica behind a proxy, a standby, then the cut: (seconds to the cut-off
        replica exiting, seconds to the standby holding the Lease)."""
        proxy = TcpProxy(HOST, plane.apiserver_port)
        await proxy.start()
        try:
            active, standby = await self.replicas.pair(self.next_user(), self.next_user(), proxy=proxy)
            await self.until_converged(f"{self.memory}Gi", timeout=30)
            started = time.monotonic()
            proxy.partition()

            async def exited() -> bool:
                return active.operator.process.poll() is not None

            await wait_for(exited, timeout=TIMING.renew_deadline + 10, what="the cut-off replica to exit", interval=0.02)
            fenced = time.monotonic() - started
            assert active.operator.process.returncode == LOST_LEASE_EXIT, active.operator.log_tail()
            await self.replicas.wait_holder(standby, timeout=TIMING.lease_duration + 10)
            held = time.monotonic() - started
            assert fenced < held, (fenced, held)
            await self.until_converged(await self.change(), timeout=30)
            standby.operator.stop()  # release, for the next round
            return fenced, held
        finally:
            await proxy.close()


async def run_bench(ctx: Context) -> dict[str, Any]:
    workdir = ctx.workdir("operator_failover")
    plane = ControlPlane(find_binaries(), workdir / "cluster")
    await asyncio.to_thread(plane.start)
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, "bench")
    replicas = Replicas(plane, kube, workdir, LEASE_NAMESPACE)
    try:
        await install_crd(kube)
        for namespace in (LEASE_NAMESPACE, NAME):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                           "metadata": {"name": "gpudra-agent", "namespace": NAME}})
        rounds = Rounds(kube, replicas)
        active, standby = await replicas.pair(rounds.next_user(), rounds.next_user())
        await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": NAME},
                           "spec": spec("64Gi")})
        await rounds.until_converged("64Gi", timeout=60)
        results: dict[str, list[float]] = {k: [] for k in ("kill_held", "kill_converged", "term_held",
                                                           "term_converged", "cut_fenced", "cut_held")}
        for sig, prefix in ((signal.SIGKILL, "kill"), (signal.SIGTERM, "term")):
            for _ in range(ROUNDS):
                held, done = await rounds.stop(active, standby, sig)
                results[f"{prefix}_held"].append(held)
                results[f"{prefix}_converged"].append(done)
                active, standby = standby, replicas.start(rounds.next_user())
                await replicas.wait_role(standby, "standby")
        active.operator.stop()
        standby.operator.stop()
        await kube.delete(LEASE, LEASE_NAME, LEASE_NAMESPACE)
        for _ in range(max(1, ROUNDS // 2)):
            fenced, held = await rounds.cut(plane)
            results["cut_fenced"].append(fenced)
            results["cut_held"].append(held)
        return results
    finally:
        replicas.stop_all()
        await api.close()
        await asyncio.to_thread(plane.stop)


def _spread(samples: list[float]) -> str:
    return f"median {statistics.median(samples):.2f}s, min {min(samples):.2f}s, max {max(samples):.2f}s, " \
           f"n={len(samples)}: " + ", ".join(f"{s:.2f}" for s in samples)


async def run(ctx: Context) -> list[Result]:
    r = await run_bench(ctx)
    return [
        at_most("SIGKILL -> change converged (max)", max(r["kill_converged"]), "s", FAILOVER_TARGET,
                _spread(r["kill_converged"])),
        Result("SIGKILL -> standby holds the Lease (max)", max(r["kill_held"]), "s", note=_spread(r["kill_held"])),
        at_most("SIGTERM -> standby holds the Lease (max)", max(r["term_held"]), "s", HANDOVER_TARGET,
                _spread(r["term_held"])),
        Result("SIGTERM -> change converged (max)", max(r["term_converged"]), "s", note=_spread(r["term_converged"])),
        at_most("partition -> cut-off replica exits (max)", max(r["cut_fenced"]), "s", TIMING.renew_deadline + 0.5,
                _spread(r["cut_fenced"])),
        Result("partition -> standby holds the Lease (min)", min(r["cut_held"]), "s",
               note=_spread(r["cut_held"]) + "; always after the cut-off replica exited"),
    ]


if __name__ == "__main__":
    sys.exit(__import__("bench.__main__", fromlist=["main"]).main(["operator_failover"]))
