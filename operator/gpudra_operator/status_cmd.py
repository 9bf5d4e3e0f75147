"""`gpudra status`: whether gpudra is installed and working, read from the live cluster.

Checks, each printed on a line of its own:

* the operator: its Lease (``gpudra-operator`` in the operator's namespace) has a holder, and the
  holder renews it while this command watches (a Lease whose holder died keeps its name until it
  expires; a renewal proves a live leader without comparing anyone's clock);
* each GpuDraConfig (or the one named): ``Ready=True`` for its current generation, all of its
  agents ready and updated, and ResourceSlices of its driver from as many nodes as it has ready
  agents.

With ``--wait``, failing checks are asked again until they pass or the time is up (a fresh install
or upgrade converges). The chart's ``helm test`` runs this in the operator image.

RBAC: get on the Lease, list on gpudraconfigs and resourceslices.

Exit status: 0 when every check passes; 1 when one fails (its line says why) or the cluster cannot
be read; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.crd import GROUP, VERSION
from gpudra_operator.leaderelection import LEASE, LEASE_NAME

CONFIG = resource_type(f"{GROUP}/{VERSION}", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Check:
    what: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}: {self.detail}"


def _condition(config: Obj, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in (config.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def config_checks(config: Obj, slice_nodes: set[str]) -> list[Check]:
    """The checks of one GpuDraConfig, given the nodes that publish ResourceSlices of its driver. Pure."""
    name = config["metadata"]["name"]
    generation = config["metadata"].get("generation")
    status = config.get("status") or {}
    ready = _condition(config, "Ready")
    if ready is None:
        checks = [Check(f"GpuDraConfig {name}", False, "no Ready condition yet (is the operator running?)")]
    elif ready.get("observedGeneration") != generation:
        checks = [Check(f"GpuDraConfig {name}", False,
                        f"Ready is for generation {ready.get('observedGeneration')}, the spec is at {generation}")]
    else:
        ok = ready.get("status") == "True"
        checks = [Check(f"GpuDraConfig {name}", ok,
                        "Ready" if ok else f"not Ready: {ready.get('reason')}: {ready.get('message')}")]
    agents = status.get("agents") or {}
    desired, ready_agents, updated = (int(agents.get(k) or 0) for k in ("desired", "ready", "updated"))
    checks.append(Check(f"GpuDraConfig {name} agents", desired > 0 and ready_agents == desired and updated == desired,
                        f"{ready_agents} ready, {updated} updated of {desired}"
                        + (" (no node matches spec.agent.nodeSelector?)" if desired == 0 else "")))
    driver = (config.get("spec") or {}).get("driverName", "")
    checks.append(Check(f"GpuDraConfig {name} ResourceSlices", len(slice_nodes) >= ready_agents > 0,
                        f"driver {driver} published by {len(slice_nodes)} node(s), {ready_agents} agent(s) ready"))
    return checks


def lease_check(first: Obj | None, last: Obj | None, watched: float) -> Check:
    """The operator's Lease as read at the start and at the end of ``watched`` seconds. Pure."""
    what = "operator"
    if first is None or last is None:
        return Check(what, False, f"no Lease {LEASE_NAME} (is the operator installed in this namespace?)")
    holder = (last.get("spec") or {}).get("holderIdentity")
    if not holder:
        return Check(what, False, f"Lease {LEASE_NAME} has no holder: no operator replica leads")
    renewed = (first.get("spec") or {}).get("renewTime") != (last.get("spec") or {}).get("renewTime")
    if not renewed:
        return Check(what, False, f"Lease {LEASE_NAME} held by {holder} was not renewed in {watched:.0f} s")
    return Check(what, True, f"{holder} leads (renewed its Lease while watched)")


async def watch_lease(kube: Kube, operator_namespace: str, lease_wait: float) -> Check:
    """The Lease read, then read again until its holder renewed it or the wait is over."""
    first = await kube.get(LEASE, LEASE_NAME, operator_namespace)
    started = time.monotonic()
    duration = float(((first or {}).get("spec") or {}).get("leaseDurationSeconds") or 15)
    last = first
    while first is not None and time.monotonic() - started < min(lease_wait, duration + POLL_SECONDS):
        await asyncio.sleep(POLL_SECONDS)
        last = await kube.get(LEASE, LEASE_NAME, operator_namespace)
        if lease_check(first, last, 0).ok:
            break
    return lease_check(first, last, time.monotonic() - started)


async def gather(kube: Kube, operator_namespace: str, config_name: str | None, lease_wait: float,
                 leader: Check | None = None) -> list[Check]:
    """Every check; ``leader``, a passed Lease check of an earlier round, is not watched again."""
    checks = [leader if leader is not None and leader.ok else await watch_lease(kube, operator_namespace, lease_wait)]
    if config_name is not None:
        found = await kube.get(CONFIG, config_name)
        configs = [found] if found is not None else []
        if not configs:
            return [*checks, Check(f"GpuDraConfig {config_name}", False, "not found")]
    else:
        configs = [c async for c in kube.list(CONFIG)]
        if not configs:
            return [*checks, Check("GpuDraConfigs", False, "none: apply one (manifests/samples/gpudraconfig.yaml)")]
    for config in configs:
        driver = (config.get("spec") or {}).get("driverName", "")
        nodes = {s["spec"].get("nodeName") async for s in kube.list(SLICE, field_selector=f"spec.driver={driver}")}
        checks += config_checks(config, {n for n in nodes if n})
    return checks


def report(checks: Sequence[Check]) -> str:
    return "\n".join(check.line() for check in checks)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="whether gpudra is installed and working, from the live cluster",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=None, help="one GpuDraConfig (default: every one)")
    parser.add_argument("--operator-namespace", default="gpudra-operator",
                        help="the operator's namespace, where its Lease is (default: %(default)s)")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="ask failing checks again until they pass or this many seconds have passed (default: 0)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.wait < 0:
        print("gpudra status: --wait must be 0 or more seconds", file=sys.stderr)
        return 2
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    try:
        api = await connect(args.kubeconfig)
    except Exception as error:  # noqa: BLE001 - one line, not a traceback
        print(f"gpudra status: cannot reach the cluster: {error}", file=sys.stderr)
        return 1
    kube = Kube(api, field_manager="gpudra-status")
    deadline = time.monotonic() + args.wait
    checks: list[Check] = []
    try:
        while True:
            try:
                checks = await gather(kube, args.operator_namespace, args.config, lease_wait=max(args.wait, 20.0),
                                      leader=checks[0] if checks else None)
            except Exception as error:  # noqa: BLE001 - an API refusal or a lost connection, said in one line
                checks = [Check("cluster", False, f"{type(error).__name__}: {error}")]
            if all(c.ok for c in checks) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_SECONDS)
    finally:
        await api.close()
    print(report(checks))
    return 0 if all(c.ok for c in checks) else 1
