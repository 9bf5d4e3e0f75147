"""The one `gpudra` command line. Each subcommand lives in the module that owns its concern and
registers itself here through ``add_parser(subparsers)``; imports stay lazy so `gpudra discover`
on a node never pays for kopf or the API client, and each image lists only the subcommands of the
components it carries (the agent image has no operator, the operator image no agent)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "discover": "gpudra_driver.discover_cmd",
    "agent": "gpudra_driver.agent_cmd",
    "mps-supervisor": "gpudra_driver.plugin.sharing.mps.supervisor",
    "operator": "gpudra_operator.operator_cmd",
    "render": "gpudra_operator.render_cmd",
    "explain": "gpudra_operator.explain_cmd",
    "status": "gpudra_operator.status_cmd",
    "uninstall": "gpudra_operator.uninstall_cmd",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (the node agent then
    never loads the operator's modules: every import is resident memory on every GPU node)."""
    parser = argparse.ArgumentParser(prog="gpudra", description="GPU Dynamic Resource Allocation for "
                                     "Kubernetes: the operator, the node agent and their tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(sub, SUBCOMMANDS, [only] if only in SUBCOMMANDS else list(SUBCOMMANDS))
    return parser


def installed(module: str) -> bool:
    """Whether the component that owns ``module`` is installed here (an image carries one)."""
    return importlib.util.find_spec(module.split(".", 1)[0]) is not None


def add_subcommands(sub: argparse._SubParsersAction, modules: dict[str, str], names: list[str]) -> None:
    """Register ``names`` from ``modules`` (subcommand -> module); a subcommand whose component is
    not installed says so when run."""
    for name in names:
        module = modules[name]
        if installed(module):
            importlib.import_module(module).add_parser(sub)
            continue
        parser = sub.add_parser(name, help=f"(not installed here: {module.split('.', 1)[0]})")
        parser.set_defaults(run=lambda _args, module=module, name=name: _not_installed(name, module))


def _not_installed(name: str, module: str) -> int:
    print(f"gpudra {name}: {module.split('.', 1)[0]} is not installed here (this image carries another "
          "component); run it where that component is, or pip install gpudra", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return int(args.run(args) or 0)


# The subcommands `kubectl gpudra ...` offers: the ones that read a cluster on a user's behalf.
KUBECTL_SUBCOMMANDS = ("explain", "status", "uninstall")


def kubectl_plugin(argv: list[str] | None = None) -> int:
    """`kubectl-gpudra`, the kubectl plugin (`kubectl gpudra explain ...`)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kubectl gpudra", description="gpudra's kubectl plugin.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(sub, SUBCOMMANDS, list(KUBECTL_SUBCOMMANDS))
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
