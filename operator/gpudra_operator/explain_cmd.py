"""`gpudra explain pod|claim <namespace>/<name>`: why a claim or a pod's claims are Pending.

Reads the live cluster (read-only) and answers with Kubernetes' own DRA allocator of the cluster's
release (gpudra-allocator): whether and where the claims fit, or the error that stops the
scheduler. Then it explains: per request, per node, how many published devices pass the
DeviceClass's selectors, then the request's, which selector rejects a sample device and the
device's actual value, how many are tainted, held by other claims or short of room (a shared
device's capacity, a partitionable device's counters), and whether what is left covers the
request; then one line of conclusion. Also `kubectl gpudra explain`.

RBAC: get on the pod and on resourceclaims in its namespace, get on the deviceclasses it names,
list on resourceslices (cluster-scoped). Optional, for a complete answer: list nodes (node
selection), list resourceclaims in every namespace (devices held elsewhere), get the namespace
(the admin-access label). See docs/explain.md.

Exit status: 0 with the verdict (whether or not the claim can be allocated); 1 when the pod or
claim does not exist, its requests are another driver's, a selector does not compile, the API
refuses a read, the cluster cannot be reached, gpudra-allocator is missing or refuses a feature
gate, with one line on stderr; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

DEFAULT_DRIVER = "gpu.gpudra.io"
_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool, as --feature-gates reads it
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def feature_gates(text: str) -> dict[str, bool]:
    """``Name=true,Other=false``, as kube-scheduler's --feature-gates takes it."""
    gates: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or value.strip() not in _TRUE + _FALSE:
            raise argparse.ArgumentTypeError(f"{item!r} is not Name=true or Name=false")
        gates[name.strip()] = value.strip() in _TRUE
    return gates


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="why a pod's or a claim's devices are (not) allocated, from the live cluster",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    parser.add_argument("kind", choices=["pod", "claim"], help="what to explain")
    parser.add_argument("ref", metavar="NAMESPACE/NAME",
                        help="the pod or ResourceClaim (a bare NAME is looked up in --namespace)")
    parser.add_argument("-n", "--namespace", default="default", help="namespace of a bare NAME (default: %(default)s)")
    parser.add_argument("-o", "--output", choices=["text", "yaml", "json"], default="text")
    parser.add_argument("--driver", default=DEFAULT_DRIVER, help="the DRA driver name (default: %(default)s)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    parser.add_argument("--feature-gates", type=feature_gates, default={}, metavar="Name=true,Other=false",
                        help="the DRA feature gates the cluster's kube-scheduler was started with, over its release's "
                             "defaults (default: none)")
    parser.add_argument("--filter-timeout", type=float, default=None, metavar="SECONDS",
                        help="the time kube-scheduler's DynamicResources plugin gives one node (its filterTimeout "
                             "argument; default: the release's, 10 s with DRASchedulerFilterTimeout on; 0: none)")
    parser.set_defaults(run=run)


def _split(ref: str, default_namespace: str) -> tuple[str, str]:
    namespace, sep, name = ref.partition("/")
    if not sep:
        return default_namespace, ref
    if not namespace or not name or "/" in name:
        raise ValueError(f"{ref!r} is not NAMESPACE/NAME")
    return namespace, name


async def _explain(args: argparse.Namespace, namespace: str, name: str) -> str:
    from gpudra_core.kubeapi import Kube, connect
    from gpudra_operator.explain import explain_live
    from gpudra_operator.explain.report import as_json, as_text, as_yaml

    api = await connect(args.kubeconfig)
    try:
        verdict = await explain_live(Kube(api, field_manager="gpudra-explain"), args.kind, namespace, name,
                                     args.driver, feature_gates=args.feature_gates, filter_timeout=args.filter_timeout)
    finally:
        await api.close()
    return {"text": as_text, "yaml": as_yaml, "json": as_json}[args.output](verdict)


def run(args: argparse.Namespace) -> int:
    import yaml
    from kubernetes_asyncio.config import ConfigException

    from gpudra_core.kubeapi import NETWORK_ERRORS, error_message
    from gpudra_operator.allocatorhelper import AllocatorError, AllocatorUnavailable
    from gpudra_operator.explain import ExplainInputError

    try:
        if args.kubeconfig is not None and not os.path.isfile(args.kubeconfig):
            raise ValueError(f"kubeconfig {args.kubeconfig}: no such file")
        namespace, name = _split(args.ref, args.namespace)
        sys.stdout.write(asyncio.run(_explain(args, namespace, name)))
    except (ValueError, ExplainInputError, AllocatorUnavailable, AllocatorError) as error:
        print(f"gpudra explain: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except (ConfigException, yaml.YAMLError) as error:
        print(f"gpudra explain: no usable kubeconfig: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except NETWORK_ERRORS as error:
        print(f"gpudra explain: cannot reach the API server: {error_message(error) or type(error).__name__}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - a user's command says what failed in one line, never a traceback
        print(f"gpudra explain: failed: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    return 0
