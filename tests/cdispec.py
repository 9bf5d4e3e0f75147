"""Validation of every CDI spec the tests see: the CDI JSON schema (tests/cdi/schema.json) plus the
rules the CDI library checks beyond the schema (pkg/cdi/spec.go, device.go, version.go)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).resolve().parent / "cdi" / "schema.json"
_ORDER = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]


@cache
def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_cdi_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Raise AssertionError/ValidationError unless ``spec`` is a spec a CDI runtime would load."""
    from gpudra_driver.plugin.cdi import minimum_version

    _validator().validate(spec)
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names)), f"duplicate CDI device names {names}"
    for device in spec["devices"]:
        edits = device["containerEdits"]
        assert any(edits.get(k) for k in edits), f"device {device['name']}: empty device edits"
    needed = minimum_version(spec)
    assert _ORDER.index(spec["cdiVersion"]) >= _ORDER.index(needed), (
        f"cdiVersion {spec['cdiVersion']} is lower than the {needed} its content needs")
    assert spec["cdiVersion"] == needed, f"cdiVersion {spec['cdiVersion']} is newer than needed ({needed})"
    return spec


def load_and_validate(path: Path) -> dict[str, Any]:
    return validate_cdi_spec(json.loads(path.read_text()))
