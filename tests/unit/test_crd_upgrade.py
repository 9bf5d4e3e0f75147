"""The GpuDraConfig CRD against the previous release's (the commit hack/previous-release pins, read
from git): an upgrade must keep every stored object valid and every field users set, and a rollback
must find the version it stored in (docs/upgrade.md, "CRD versions")."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD = "crds/gpudraconfig.yaml"


def pinned_commit() -> str:
    pin = dict(line.split("=", 1) for line in (REPO / "hack" / "previous-release").read_text().splitlines()
               if line and not line.startswith("#"))
    return pin["commit"]


def previous_crd() -> dict[str, Any]:
    commit = pinned_commit()
    proc = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{CRD}"], capture_output=True, text=True)
    assert proc.returncode == 0, (f"cannot read {CRD} at the previous release {commit} ({proc.stderr.strip()}): "
                                  f"a shallow clone lacks it; git -C {REPO} fetch --unshallow")
    crd: dict[str, Any] = yaml.safe_load(proc.stdout)
    return crd


def current_crd() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((REPO / CRD).read_text())
    return crd


def versions(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in crd["spec"]["versions"]}


def field_paths(schema: dict[str, Any], path: str = "") -> Iterator[str]:
    yield path or "."
    for name, sub in (schema.get("properties") or {}).items():
        yield from field_paths(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from field_paths(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from field_paths(schema["additionalProperties"], f"{path}{{}}")


def required(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, str, bool]]:
    """(path, required field, whether it has a default) for every object in the schema."""
    properties = schema.get("properties") or {}
    for name in schema.get("required") or []:
        yield path or ".", name, "default" in (properties.get(name) or {})
    for name, sub in properties.items():
        yield from required(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from required(schema["items"], f"{path}[]")


def test_every_version_the_previous_release_served_is_served_and_storage_did_not_move_without_conversion() -> None:
    old, new = versions(previous_crd()), versions(current_crd())
    assert {n for n, v in old.items() if v.get("served")} <= {n for n, v in new.items() if v.get("served")}
    (old_storage,) = [n for n, v in old.items() if v.get("storage")]
    (new_storage,) = [n for n, v in new.items() if v.get("storage")]
    if new_storage != old_storage:
        conversion = current_crd()["spec"].get("conversion", {}).get("strategy", "None")
        assert new[old_storage].get("served") and conversion == "Webhook", (
            f"storage moved {old_storage} -> {new_storage}: serve {old_storage} and convert with a webhook")


def test_no_field_of_the_previous_release_is_dropped() -> None:
    old, new = versions(previous_crd()), versions(current_crd())
    for name, version in old.items():
        before = set(field_paths(version["schema"]["openAPIV3Schema"]))
        after = set(field_paths(new[name]["schema"]["openAPIV3Schema"]))
        assert before <= after, f"{name}: fields the previous release had are gone: {sorted(before - after)}"


def test_no_new_required_field_without_a_default() -> None:
    # A field required now that was not before would make stored objects fail their next update.
    old, new = versions(previous_crd()), versions(current_crd())
    for name, version in new.items():
        if name not in old:
            continue
        schema = old[name]["schema"]["openAPIV3Schema"]
        had = {(p, f) for p, f, _ in required(schema)}
        existed = set(field_paths(schema))  # a new optional object may require fields of its own
        added = [(p, f) for p, f, defaulted in required(version["schema"]["openAPIV3Schema"])
                 if p in existed and (p, f) not in had and not defaulted]
        assert not added, f"{name}: newly required without a default: {added}"


def test_the_field_walk_sees_nested_and_list_fields() -> None:
    paths = set(field_paths(current_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    assert {".spec.agent.tolerations[]", ".spec.deviceClasses[].name", ".status.conditions[]"} <= paths, sorted(paths)[:20]
