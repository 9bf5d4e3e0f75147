"""The GpuDraConfig CRD as data: the package copy of ``crds/gpudraconfig.yaml`` (kept
byte-identical by a unit test) and a pure structural defaulter that applies its ``default:`` values
the way the API server does, for objects that never went through one (``gpudra render`` on a file,
unit tests)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

CRD_FILE = "gpudraconfig.yaml"
GROUP = "gpudra.io"
VERSION = "v1alpha1"
PLURAL = "gpudraconfigs"
CRD_NAME = f"{PLURAL}.{GROUP}"


def crd_text() -> str:
    return (resources.files("gpudra_operator") / "crds" / CRD_FILE).read_text("utf-8")


@cache
def _crd() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(crd_text())


def load_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (a fresh copy each call)."""
    return copy.deepcopy(_crd())


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served version."""
    (version,) = [v for v in _crd()["spec"]["versions"] if v["name"] == VERSION]
    return copy.deepcopy(version["schema"]["openAPIV3Schema"])


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with the schema's ``default:``s filled in, recursively, without modifying the
    input: a missing property with a default gets it (and then its own nested defaults), like
    structural defaulting in the API server. ``null`` is left alone (not pruned)."""
    if isinstance(value, Mapping):
        props: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out: dict[str, Any] = dict(value)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
        for key in list(out):
            sub = props.get(key) if key in props else extra if isinstance(extra, Mapping) else None
            if sub is not None and out[key] is not None:
                out[key] = apply_defaults(sub, out[key])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def default_object(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A GpuDraConfig object with the CRD's defaults applied."""
    return apply_defaults(openapi_schema(), obj)
