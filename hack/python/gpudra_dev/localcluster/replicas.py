"""Operator replicas as local subprocesses, each connecting as a user of its own (so the audit log
tells their requests apart) and electing one active replica through the Lease, as the Deployment's
pods do. The HA tests and the failover bench stand on it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudra_core.kubeapi import Kube

from gpudra_operator.leaderelection import LEASE, LEASE_NAME
from .controlplane import HOST, ControlPlane, free_port
from .operatorproc import OperatorProcess, start_operator
from .tcpproxy import TcpProxy
from .waiting import wait_for


@dataclass
class Replica:
    user: str
    operator: OperatorProcess
    health_port: int
    metrics_port: int

    @property
    def identity(self) -> str:
        """The Lease holder it writes: operator_cmd's host name / PID (setpriv execs: same PID)."""
        return f"{socket.gethostname()}/{self.operator.process.pid}"

    def role(self) -> str | None:
        """"active" or "standby", from its /healthz (None: not answering)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as response:
                return str(json.loads(response.read())["role"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return None


class Replicas:
    """Start replicas with ``start``; ``stop_all`` stops what is left (SIGTERM: they release)."""

    def __init__(self, plane: ControlPlane, kube: Kube, workdir: Path, lease_namespace: str,
                 env: dict[str, str] | None = None, args: Sequence[str] = ()) -> None:
        self.plane, self.kube, self.workdir = plane, kube, workdir
        self.lease_namespace = lease_namespace
        self.env, self.args = env or {}, tuple(args)
        self.started: list[Replica] = []

    def start(self, user: str, server: str | None = None) -> Replica:
        kubeconfig = self.plane.user_kubeconfig(self.workdir / f"{user}.kubeconfig", user, server=server)
        health, metrics = free_port(), free_port()
        operator = start_operator(kubeconfig=kubeconfig, log_path=self.workdir / f"{user}.log",
                                  args=("--liveness-port", str(health), "--metrics-port", str(metrics), *self.args),
                                  env={"POD_NAMESPACE": self.lease_namespace, **self.env})
        replica = Replica(user, operator, health, metrics)
        self.started.append(replica)
        return replica

    async def holder(self) -> str | None:
        lease = await self.kube.get(LEASE, LEASE_NAME, self.lease_namespace)
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    async def wait_role(self, replica: Replica, role: str, timeout: float = 30) -> None:
        async def probe() -> bool:
            assert replica.operator.process.poll() is None, f"{replica.user} exited:\n{replica.operator.log_tail()}"
            return await asyncio.to_thread(replica.role) == role

        await wait_for(probe, timeout=timeout, what=f"{replica.user} to be {role}", interval=0.02)

    async def wait_holder(self, replica: Replica, timeout: float) -> float:
        """Seconds until ``replica`` holds the Lease."""
        started = time.monotonic()

        async def holds() -> bool:
            return await self.holder() == replica.identity

        await wait_for(holds, timeout=timeout, what=f"{replica.user} ({replica.identity}) to hold the Lease",
                       interval=0.02)
        return time.monotonic() - started

    async def pair(self, active_user: str = "operator-a", standby_user: str = "operator-b",
                   proxy: TcpProxy | None = None) -> tuple[Replica, Replica]:
        """An active replica (through ``proxy`` when given), then a standby."""
        active = self.start(active_user, server=f"https://{HOST}:{proxy.port}" if proxy else None)
        await self.wait_holder(active, timeout=30)
        await self.wait_role(active, "active")
        standby = self.start(standby_user)
        await self.wait_role(standby, "standby")
        return active, standby

    def stop_all(self) -> None:
        for replica in self.started:
            replica.operator.stop()
