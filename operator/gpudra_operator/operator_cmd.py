"""`gpudra operator`: run the kopf operator; with leader election (the default), only while this
replica holds the operator Lease (docs/ha.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Mapping
from typing import Any

from gpudra_operator.leaderelection import LEASE_NAME, Timing

log = logging.getLogger("gpudra.operator")


def holder_identity(environ: Mapping[str, str], hostname: str, pid: int) -> str:
    """This replica's name for kopf and as the Lease's holder. kopf would name itself after the OS
    user (getpass), which fails for a UID without a passwd entry, such as the Deployment's 65532:
    the pod's name instead (``POD_NAME``, from the downward API; else the host name), or kopf's
    ``POD_ID``. Not the host name alone: on the host network every replica of a node has the
    node's, and PID 1, and two replicas with one name would both hold the Lease."""
    return environ.get("POD_ID") or f"{environ.get('POD_NAME') or hostname}/{pid}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the GpuDraConfig operator")
    parser.add_argument("--liveness-port", type=int, default=int(os.environ.get("GPUDRA_LIVENESS_PORT", "8080")),
                        help="serve /healthz on this port (the active replica and standbys); 0 disables it "
                             "(default: %(default)s)")
    parser.add_argument("--drift-interval", type=float, default=None,
                        help="seconds between drift repairs (default: $GPUDRA_DRIFT_INTERVAL or 60)")
    parser.add_argument("--gc-delete-rate", type=float, default=None,
                        help="ResourceSlice GC deletes per second, all configs together; 0 = unlimited "
                             "(default: $GPUDRA_GC_DELETE_RATE or 50)")
    parser.add_argument("--log-format", choices=["plain", "full", "json"], default="full")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("GPUDRA_METRICS_PORT") or 0),
                        help="serve Prometheus /metrics on this port; 0 disables (default: $GPUDRA_METRICS_PORT or 0)")
    parser.add_argument("--namespace", default=os.environ.get("GPUDRA_WATCH_NAMESPACE") or None,
                        help="watch agent DaemonSets only in this namespace (the shipped RBAC grants DaemonSets "
                             "in gpudra-system only); GpuDraConfigs and DeviceClasses are cluster-scoped and "
                             "always watched cluster-wide (default: $GPUDRA_WATCH_NAMESPACE, else all namespaces)")
    timing = Timing()
    election = parser.add_argument_group("leader election (docs/ha.md)")
    election.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                          help=f"run only while holding the Lease {LEASE_NAME}, so that several replicas "
                               "never write at once (default: on)")
    election.add_argument("--leader-elect-namespace", default=None,
                          help="the Lease's namespace (default: $POD_NAMESPACE, else the pod's own namespace, "
                               "else default)")
    election.add_argument("--leader-elect-lease-duration", type=float, default=timing.lease_duration,
                          help="a standby takes over this long after the Lease was last renewed (default: %(default)ss)")
    election.add_argument("--leader-elect-renew-deadline", type=float, default=timing.renew_deadline,
                          help="the active replica exits when it could not renew for this long (default: %(default)ss)")
    election.add_argument("--leader-elect-retry-period", type=float, default=timing.retry_period,
                          help="between renewals, and between a standby's tries (default: %(default)ss)")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.drift_interval is not None:  # read when the handlers module is imported
        os.environ["GPUDRA_DRIFT_INTERVAL"] = str(args.drift_interval)
    if args.gc_delete_rate is not None:
        os.environ["GPUDRA_GC_DELETE_RATE"] = str(args.gc_delete_rate)
    timing = Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                    args.leader_elect_retry_period)
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers (a standby has them ready too)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()])
    # The API client logs whole response bodies at DEBUG: too much even for --verbose.
    logging.getLogger("kubernetes_asyncio").setLevel(logging.INFO)
    from . import metrics

    metrics.serve(args.metrics_port)
    return asyncio.run(_run(args, timing))


async def _run(args: argparse.Namespace, timing: Timing) -> int:
    import kopf

    from gpudra_core.kubeapi import Kube, connect

    from gpudra_operator.handlers import FIELD_MANAGER
    from gpudra_operator.liveness import serve_health
    from gpudra_operator.leaderelection import LeaseElector, namespace_in_cluster, run_elected

    identity = holder_identity(os.environ, socket.gethostname(), os.getpid())
    scope: dict[str, Any] = {"namespaces": [args.namespace]} if args.namespace else {"clusterwide": True}
    stop, kopf_ready = asyncio.Event(), asyncio.Event()
    role = {"role": "standby" if args.leader_elect else "active", "identity": identity}

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    async def lead() -> None:
        """kopf.operator(), except that SIGTERM keeps setting ``stop``: kopf's own handlers
        would leave its waiter on ``stop`` pending, and kopf waits 5 s for such tasks."""
        role["role"] = "active"
        ignored = asyncio.all_tasks()
        tasks = await kopf.spawn_tasks(standalone=True, identity=identity, stop_flag=stop,  # type: ignore[arg-type]
                                       ready_flag=kopf_ready, memo=kopf.Memo(stopping=stop), **scope)
        on_signals()
        try:
            await kopf.run_tasks(tasks, ignored=ignored)
        except Exception:
            if not stop.is_set():
                raise
            # kopf stops its root tasks (its API session among them) before the handlers still in
            # flight, and re-raises what those then fail with: a status patch on the closed session
            # (aiohttp's "assert self._connector is not None"). The work is not lost: the next leader
            # reconciles every config again. A stop asked for is a clean stop.
            log.warning("a handler in flight failed while the operator stopped; the next leader reconciles again",
                        exc_info=True)

    def health() -> tuple[bool, dict[str, Any]]:
        return role["role"] == "standby" or kopf_ready.is_set(), role

    runner = await serve_health(args.liveness_port, health) if args.liveness_port else None
    try:
        if not args.leader_elect:
            await lead()
            return 0
        on_signals()
        namespace = args.leader_elect_namespace or os.environ.get("POD_NAMESPACE") or namespace_in_cluster() or "default"
        api = await connect(os.environ.get("KUBECONFIG"))
        try:
            await run_elected(LeaseElector(Kube(api, FIELD_MANAGER), namespace, identity, timing), lead, stop)
        finally:
            await api.close()
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
