"""The one `gpudra` command line. Each subcommand lives in the module that owns its concern and
registers itself here through ``add_parser(subparsers)``; imports stay lazy so `gpudra discover`
on a node never pays for kopf or the API client."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "discover": "gpudra_driver.discover_cmd",
    "agent": "gpudra_driver.agent_cmd",
    "mps-supervisor": "gpudra_driver.mpssupervisor",
    "operator": "gpudra_operator.operator_cmd",
    "render": "gpudra_operator.render_cmd",
    "explain": "gpudra_operator.explain_cmd",
    "demo": "gpudra_operator.demo_cmd",
    "local-cluster": "gpudra_operator.localcluster.cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (the node agent then
    never loads the operator's modules: every import is resident memory on every GPU node)."""
    parser = argparse.ArgumentParser(prog="gpudra", description="GPU Dynamic Resource Allocation for "
                                     "Kubernetes: the operator, the node agent and their tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [only] if only in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return int(args.run(args) or 0)


# The subcommands `kubectl gpudra ...` offers: the ones that read a cluster on a user's behalf.
KUBECTL_SUBCOMMANDS = ("explain",)


def kubectl_plugin(argv: list[str] | None = None) -> int:
    """`kubectl-gpudra`, the kubectl plugin (`kubectl gpudra explain ...`)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kubectl gpudra", description="gpudra's kubectl plugin.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in KUBECTL_SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
