"""`gpudra-dev`: the development commands, from a checkout (`make demo` runs `gpudra-dev demo`)."""

from __future__ import annotations

import argparse
import sys

from gpudra.cli import add_subcommands

SUBCOMMANDS: dict[str, str] = {
    "demo": "gpudra_dev.demo_cmd",
    "local-cluster": "gpudra_dev.localcluster.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gpudra-dev", description="gpudra's development commands: a local "
                                     "cluster with simulated GPU nodes, the demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(sub, SUBCOMMANDS, [argv[0]] if argv and argv[0] in SUBCOMMANDS else list(SUBCOMMANDS))
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
