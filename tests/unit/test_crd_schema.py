"""The GpuDraConfig CRD: one source file, a byte-identical package copy, a schema that kubectl
explain can describe, bounds for CEL costing, and samples that the schema accepts and that render
without errors. Admission (CEL rules) through the real apiserver is in
tests/integration/test_crd_admission.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpudra_operator import crd, deviceclasses
from gpudra_operator.render import render

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "crds" / "gpudraconfig.yaml"
PACKAGE_COPY = REPO / "operator" / "gpudra_operator" / "crds" / "gpudraconfig.yaml"
SAMPLES = sorted((REPO / "manifests" / "samples").glob("gpudraconfig*.yaml"))


def _schema() -> dict[str, Any]:
    return crd.openapi_schema()


def _walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node reachable through properties/items/additionalProperties (not into
    anyOf, where structural schemas forbid descriptions)."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_schema())


def test_package_copy_is_byte_identical_to_the_source() -> None:
    assert PACKAGE_COPY.read_bytes() == SOURCE.read_bytes(), (
        "operator/gpudra_operator/crds/gpudraconfig.yaml differs from crds/gpudraconfig.yaml: "
        "cp crds/gpudraconfig.yaml operator/gpudra_operator/crds/")
    assert crd.crd_text() == SOURCE.read_text()


def test_names_scope_and_version() -> None:
    obj = crd.load_crd()
    assert obj["metadata"]["name"] == "gpudraconfigs.gpudra.io" == crd.CRD_NAME
    spec = obj["spec"]
    assert spec["group"] == "gpudra.io" and spec["scope"] == "Cluster"
    assert spec["names"] == {"kind": "GpuDraConfig", "listKind": "GpuDraConfigList",
                             "plural": "gpudraconfigs", "singular": "gpudraconfig",
                             "shortNames": ["gdc"], "categories": ["gpudra"]}
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns_point_at_fields_the_schema_has() -> None:
    (version,) = crd.load_crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:5] == ["Driver", "Ready", "Agents", "Classes", "Devices"]
    assert "Age" in columns and columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    paths = {p for p, _ in _walk(_schema())}
    for column in columns.values():
        path = column["jsonPath"].split("[?", 1)[0]
        if path.startswith(".metadata"):
            continue
        assert path in paths or path + "[]" in paths, f"{column['name']}: {path} is not in the schema"
    agents = _schema()["properties"]["status"]["properties"]["agents"]["properties"]
    assert agents["summary"]["type"] == columns["Agents"]["type"] == "string"


def test_every_field_has_a_description() -> None:
    missing = [path or "<root>" for path, node in _walk(_schema())
               if "description" not in node and path not in (".metadata",)]
    assert missing == []


def test_spec_is_bounded_for_cel_costing_and_fully_structural() -> None:
    problems = []
    for path, node in _walk(_schema()["properties"]["spec"], ".spec"):
        kind = node.get("type")
        if node.get("x-kubernetes-preserve-unknown-fields"):
            if path != ".spec.agent.affinity":
                problems.append(f"{path}: preserve-unknown-fields hides it from CEL")
            continue
        if kind == "string" and "enum" not in node and "maxLength" not in node:
            problems.append(f"{path}: string without maxLength")
        if kind == "array" and "maxItems" not in node:
            problems.append(f"{path}: array without maxItems")
        if kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
            problems.append(f"{path}: map without maxProperties")
        if kind is None and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: no type")
    assert problems == []


def test_every_validation_rule_has_a_message() -> None:
    rules = [(p, r) for p, n in _walk(_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 12
    assert all(r.get("rule") and r.get("message") for _, r in rules)


def test_template_enum_matches_the_builtins_and_their_files() -> None:
    item = _schema()["properties"]["spec"]["properties"]["deviceClasses"]["items"]
    enum = item["properties"]["template"]["enum"]
    files = {p.stem for p in (REPO / "operator" / "gpudra_operator" / "templates").glob("*.j2")}
    assert set(enum) == set(deviceclasses.BUILTINS) == files


def test_device_class_names_are_a_list_map() -> None:
    classes = _schema()["properties"]["spec"]["properties"]["deviceClasses"]
    assert classes["x-kubernetes-list-type"] == "map"
    assert classes["x-kubernetes-list-map-keys"] == ["name"]
    assert classes["items"]["required"] == ["name"]


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_are_valid_and_render_cleanly(sample: Path) -> None:
    obj = yaml.safe_load(sample.read_text())
    errors = sorted(str(e.message) for e in _validator().iter_errors(obj))
    assert errors == []
    defaulted = crd.default_object(obj)
    assert list(_validator().iter_errors(defaulted)) == []
    rendered = render({**defaulted, "metadata": {**defaulted["metadata"], "uid": "u-1"}})
    assert rendered.errors == []
    assert len(rendered.device_classes) == len(obj["spec"].get("deviceClasses", []))


def test_samples_exist() -> None:
    assert {p.name for p in SAMPLES} >= {"gpudraconfig.yaml", "gpudraconfig-minimal.yaml",
                                         "gpudraconfig-mig.yaml"}
    default = yaml.safe_load((REPO / "manifests/samples/gpudraconfig.yaml").read_text())
    assert default["metadata"]["name"] == "default"
    names = [c["name"] for c in default["spec"]["deviceClasses"]]
    assert names == ["gpu.gpudra.io", "gpu-full.gpudra.io", "mig.gpudra.io", "gpu-64gi.gpudra.io"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda s: s["agent"].update(imagePullPolicy="Sometimes"), "Sometimes"),
    (lambda s: s["deviceClasses"].append({"name": "x.gpudra.io", "template": "bogus"}), "bogus"),
    (lambda s: s["agent"].update(tolerations=[{"operator": "Maybe"}]), "Maybe"),
    (lambda s: s["resourceSliceGC"].update(interval="sixty seconds"), "sixty seconds"),
    (lambda s: s["agent"]["resources"]["requests"].update(cpu="lots"), "lots"),
    (lambda s: s.update(driverName="x" * 64), "too long"),
    (lambda s: s["deviceClasses"][0].update(parameters={"memory": 64}), "64"),
])
def test_schema_rejects_malformed_samples(mutate: Any, needle: str) -> None:
    obj = yaml.safe_load((REPO / "manifests/samples/gpudraconfig.yaml").read_text())
    spec = copy.deepcopy(obj["spec"])
    mutate(spec)
    messages = " | ".join(e.message for e in _validator().iter_errors({**obj, "spec": spec}))
    assert needle in messages


def test_apply_defaults_fills_nested_defaults_without_touching_the_input() -> None:
    obj = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": "a"}}
    out = crd.default_object(obj)
    assert "spec" not in obj
    assert out["spec"]["driverName"] == "gpu.gpudra.io"
    assert out["spec"]["agent"]["updateStrategy"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert out["spec"]["resourceSliceGC"] == {"enabled": True, "interval": "60s", "gracePeriod": "5m",
                                              "dryRun": False}
    kept = crd.default_object({**obj, "spec": {"agent": {"namespace": "gpus"}}})
    assert kept["spec"]["agent"]["namespace"] == "gpus"
    assert kept["spec"]["agent"]["kubeletDir"] == "/var/lib/kubelet"
