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
    "operator": "gpudra_operator.operator_cmd",
    "render": "gpudra_operator.render_cmd",
    "demo": "gpudra_operator.demo_cmd",
    "local-cluster": "gpudra_operator.localcluster.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpudra", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
