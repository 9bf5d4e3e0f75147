#!/usr/bin/env python3
"""Copies the GpuDraConfig CRD's spec schema (crds/gpudraconfig.yaml) into the chart's
values.schema.json as definitions.gpuDraConfigSpec, which config.spec and the agent's and operator's
tolerations and resources refer to: Helm then checks those values as the API server will.

Usage: hack/chart-schema.py [--check]   (make chart-schema; --check: exit 1 if the file is stale)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "gpudraconfig.yaml"
SCHEMA = REPO / "manifests" / "helm" / "gpudra" / "values.schema.json"


def crd_spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]  # one served version: its spec is what config.spec must be
    return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def with_crd_spec(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "definitions": {**schema["definitions"], "gpuDraConfigSpec": spec}}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    current = SCHEMA.read_text()
    wanted = render(with_crd_spec(json.loads(current), crd_spec_schema(yaml.safe_load(CRD.read_text()))))
    if current == wanted:
        return 0
    if "--check" in argv:
        print(f"{SCHEMA.relative_to(REPO)} is stale (the CRD's spec schema changed, or it was edited by hand "
              "out of its canonical form): run make chart-schema", file=sys.stderr)
        return 1
    SCHEMA.write_text(wanted)
    print(f"wrote {SCHEMA.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
