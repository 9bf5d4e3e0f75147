"""`gpudra uninstall`: remove every GpuDraConfig while the operator still runs, and wait until
their DeviceClasses, agents and ResourceSlices are gone. The Helm chart's pre-delete hook runs it
(templates/uninstall-hook.yaml); `kubectl gpudra uninstall` does the same before `kubectl delete -k`.

1. Refuse (exit 1, naming them) while pods hold claims allocated from the configs' drivers, unless
   ``--force``: uninstalling under them leaves their claims prepared on their nodes, which the
   kubelet cannot unprepare until gpudra is installed again (docs/deploy.md#uninstall).
2. Delete the configs with foreground propagation: each stays, with its deletionTimestamp, until
   the garbage collector has removed its DeviceClasses and DaemonSets. The agents, seeing their
   config being deleted, remove their own node's slices and files as they stop
   (gpudra_driver.uninstall); once they are gone, the operator's teardown removes the driver's
   slices left on any node (gpudra_operator.teardown).
3. Wait, up to ``--timeout``, until the configs and their drivers' slices are gone; past it, exit 1
   and say what is left.

RBAC (the hook's ClusterRole): list and delete gpudraconfigs, list resourceclaims and
resourceslices. Every request has the client's deadline; the waits use the monotonic clock.
Exit status: 0 done (or nothing to do); 1 refused, timed out or an API error, with the reason on
stderr; 2 for usage errors."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_operator.spec import GpuDraConfig

POLL_INTERVAL = 1.0  # seconds between looks while waiting (the API server is the clock's subject)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("uninstall", help="delete every GpuDraConfig and wait until what they "
                                                     "created is gone (before removing the operator)")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="kubeconfig file (default: $KUBECONFIG, else the in-cluster ServiceAccount)")
    parser.add_argument("--agent-namespace", default=None,
                        help="only the GpuDraConfigs whose agents run in this namespace (those an operator "
                             "installed for this namespace serves; default: every GpuDraConfig)")
    parser.add_argument("--force", action="store_true",
                        help="go ahead even while pods hold claims of the configs' drivers (they keep running; "
                             "their claims stay prepared on their nodes until gpudra is installed again)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds to wait for the configs and their slices to go (default: %(default)s)")
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class Holder:
    """A pod that holds a claim allocated from one of the drivers."""
    pod: str  # namespace/name
    claim: str  # namespace/name
    drivers: tuple[str, ...]

    def __str__(self) -> str:
        return f"pod {self.pod} (claim {self.claim})"


def holders(claims: Iterable[Mapping[str, Any]], drivers: set[str]) -> list[Holder]:
    """The pods that claims allocated from ``drivers`` are reserved for. Pure."""
    found: list[Holder] = []
    for claim in claims:
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        used = tuple(sorted({r.get("driver", "") for r in results} & drivers))
        if not used:
            continue
        meta = claim.get("metadata") or {}
        namespace = meta.get("namespace", "")
        for consumer in status.get("reservedFor") or []:
            if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
                found.append(Holder(f"{namespace}/{consumer.get('name', '')}", f"{namespace}/{meta.get('name', '')}",
                                    used))
    return sorted(found, key=lambda h: (h.pod, h.claim))


def refusal(found: list[Holder], shown: int = 20) -> str:
    """The message that stops an uninstall under running pods."""
    pods = sorted({h.pod for h in found})
    listed = "; ".join(str(h) for h in found[:shown]) + (f"; and {len(found) - shown} more" if len(found) > shown else "")
    return (f"refusing to uninstall: {len(pods)} pod(s) still use GPUs of gpudra: {listed}. Delete these pods "
            "first, or uninstall with --force (Helm: --set uninstall.force=true): the pods keep running, their "
            "claims stay prepared on their nodes, and once they end the kubelet cannot unprepare them until "
            "gpudra is installed again (docs/deploy.md#uninstall)")


def selected(configs: Iterable[Mapping[str, Any]], agent_namespace: str | None) -> list[GpuDraConfig]:
    """The configs to remove: all, or those whose agents run in ``agent_namespace``. Pure."""
    parsed = [GpuDraConfig.from_body(c) for c in configs]
    return [c for c in parsed if agent_namespace is None or c.spec.agent.namespace == agent_namespace]


def run(args: argparse.Namespace) -> int:
    from gpudra_core.kubeapi import NETWORK_ERRORS, error_message
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return asyncio.run(_uninstall(args))
    except ApiException as error:
        print(f"gpudra uninstall: the API server refused: {error.status} {error_message(error)}", file=sys.stderr)
    except NETWORK_ERRORS as error:
        print(f"gpudra uninstall: the API server cannot be reached: {error!r}", file=sys.stderr)
    return 1


def say(message: str) -> None:
    print(f"gpudra uninstall: {message}", flush=True)


async def _uninstall(args: argparse.Namespace) -> int:
    from gpudra_core.kubeapi import Kube, connect, resource_type
    from kubernetes_asyncio.client.exceptions import ApiException

    config_type = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
    claim_type = resource_type("resource.k8s.io/v1", "ResourceClaim")
    slice_type = resource_type("resource.k8s.io/v1", "ResourceSlice")
    api = await connect(args.kubeconfig)
    kube = Kube(api, "gpudra-uninstall")
    try:
        try:
            configs = selected([c async for c in kube.list(config_type)], args.agent_namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            say("the GpuDraConfig CRD is not installed: nothing to remove")
            return 0
        if not configs:
            say("no GpuDraConfig to remove")
            return 0
        drivers = {c.spec.driver_name for c in configs}
        found = holders([c async for c in kube.list(claim_type)], drivers)
        if found and not args.force:
            print(f"gpudra uninstall: {refusal(found)}", file=sys.stderr, flush=True)
            return 1
        if found:
            say(f"--force: {len(found)} claim reservation(s) of running pods stay prepared on their nodes: "
                + "; ".join(str(h) for h in found))
        for config in configs:
            # Foreground: the config stays until the garbage collector removed what it owns.
            await kube.delete(config_type, config.name, uid=config.uid or None, propagation="Foreground")
        say(f"deleted GpuDraConfig(s) {', '.join(c.name for c in configs)}; waiting for their DeviceClasses, "
            f"agents and ResourceSlices to go (up to {args.timeout:g}s)")
        deadline = time.monotonic() + args.timeout
        names = {c.name for c in configs}
        while True:
            left = [c async for c in kube.list(config_type) if c["metadata"]["name"] in names]
            slices = {d: [s async for s in kube.list(slice_type, field_selector=f"spec.driver={d}", metadata_only=True)]
                      for d in sorted(drivers)}
            slices = {d: items for d, items in slices.items() if items}
            if not left and not slices:
                say(f"done: GpuDraConfig(s) {', '.join(sorted(names))} and everything they created are gone")
                return 0
            if time.monotonic() >= deadline:
                print(f"gpudra uninstall: {still_there(left, slices, args.timeout)}", file=sys.stderr, flush=True)
                return 1
            await asyncio.sleep(POLL_INTERVAL)  # polling the API server, not synchronising with ourselves
    finally:
        await api.close()


def still_there(left: Sequence[Mapping[str, Any]], slices: Mapping[str, Sequence[Any]], timeout: float) -> str:
    """What an uninstall that timed out leaves, and where to look. Pure."""
    parts = [f"GpuDraConfig {c['metadata']['name']} (finalizers: {', '.join(c['metadata'].get('finalizers') or []) or 'none'})"
             for c in left]
    parts += [f"{len(items)} ResourceSlice(s) of driver {driver}" for driver, items in slices.items()]
    return (f"after {timeout:g}s still there: {'; '.join(parts)}. Is the operator running (kubectl -n <operator "
            "namespace> logs deploy/gpudra-operator)? Are agent pods stuck terminating on an unreachable node? "
            "docs/deploy.md#uninstall")
