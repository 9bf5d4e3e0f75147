"""`gpudra operator`: run the kopf operator (one replica; see docs/design.md for why standalone)."""

from __future__ import annotations

import argparse
import logging
import os
import socket


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the GpuDraConfig operator")
    parser.add_argument("--liveness-port", type=int, default=int(os.environ.get("GPUDRA_LIVENESS_PORT", "8080")),
                        help="serve kopf's /healthz on this port; 0 disables it (default: %(default)s)")
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
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.drift_interval is not None:  # read when the handlers module is imported
        os.environ["GPUDRA_DRIFT_INTERVAL"] = str(args.drift_interval)
    if args.gc_delete_rate is not None:
        os.environ["GPUDRA_GC_DELETE_RATE"] = str(args.gc_delete_rate)
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()])
    # The API client logs whole response bodies at DEBUG: too much even for --verbose.
    logging.getLogger("kubernetes_asyncio").setLevel(logging.INFO)
    from . import metrics

    metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    scope: dict[str, object] = {"namespaces": [args.namespace]} if args.namespace else {"clusterwide": True}
    # kopf would name itself after the OS user (getpass), which fails for a UID without a passwd
    # entry, such as the Deployment's 65532: the host name (the pod's) instead, or kopf's POD_ID.
    identity = os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}"
    kopf.run(standalone=True, liveness_endpoint=liveness, identity=identity, **scope)  # type: ignore[arg-type]
    return 0
