"""One component per image: after ``pip install --no-deps gpudra``, keep the command line, the
shared core and ``COMPONENT`` only, and print the requirements that component needs (the wheel's
``<component>-image`` extra), for pip to install next (images/*.Dockerfile).

``pip install gpudra`` still brings both components and all their requirements (the kubectl plugin,
`gpudra render`, a workstation); only the images are narrowed, so that the agent on every GPU node
carries no operator, kopf or Jinja2, and the operator no gRPC, NVML bindings or uvloop.

    python3 -m gpudra.component agent > requirements.txt"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from pathlib import Path

DISTRIBUTION = "gpudra"
# component -> the package it keeps; the other component's is removed
PACKAGES = {"agent": "gpudra_driver", "operator": "gpudra_operator"}


def requirements(component: str, requires: list[str]) -> list[str]:
    """The requirement specifiers of the ``<component>-image`` extra, markers dropped."""
    marker = f'extra == "{component}-image"'
    return [r.split(";", 1)[0].strip() for r in requires if marker in r.replace("'", '"')]


def narrow(component: str) -> list[str]:
    """Remove the other component's package (its files and its lines in the distribution's
    RECORD) and return the component's requirements."""
    if component not in PACKAGES:
        raise SystemExit(f"usage: python3 -m gpudra.component {'|'.join(PACKAGES)}")
    distribution = importlib.metadata.distribution(DISTRIBUTION)
    (other,) = (p for c, p in PACKAGES.items() if c != component)
    site = Path(str(distribution.locate_file("")))
    shutil.rmtree(site / other)
    record = next(Path(str(distribution.locate_file(f))) for f in distribution.files or () if f.name == "RECORD")
    kept = [line for line in record.read_text().splitlines() if not line.startswith(f"{other}/")]
    record.write_text("\n".join(kept) + "\n")
    return requirements(component, distribution.requires or [])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python3 -m gpudra.component {'|'.join(PACKAGES)}", file=sys.stderr)
        return 2
    print("\n".join(narrow(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
