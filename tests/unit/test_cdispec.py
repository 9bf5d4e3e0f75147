"""The tests' CDI spec validation itself (tests/cdispec.py and the autouse ``cdi_writes`` fixture):
the pinned official schema with its defs.json, the extra strict rules, the independent cdiVersion
rules, the fetch's pin and fallbacks, the official CDI Go library (cdi-validate: loading, the cache,
injection against real device nodes), and that a bad spec written in-process fails the test."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import cdispec
import jsonschema
import pytest
from plugin_fixtures import driver_files
from cdispec import (SCHEMA_MODULE, SCHEMA_VERSION, SCHEMA_ZIP_SHA256, CdiToolsUnavailable, SchemaUnavailable,
                     fetch_schema, load_and_validate, official_validator, required_version, validate_cdi_spec,
                     validate_with_cdi_library)

from gpudra_driver.plugin import cdi as cdi_module
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim, PreparedDevice

UID = "0c1d2e3f-0000-4000-8000-000000000001"
SPEC: dict[str, Any] = {
    "cdiVersion": "0.5.0", "kind": "k8s.gpu.gpudra.io/claim",
    "devices": [{"name": f"{UID}-gpu-3", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia3"}]}}],
    "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-1"], "deviceNodes": [{"path": "/dev/nvidiactl"}]},
}


def edited(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec.update(changes)
    return spec


def test_the_official_schema_is_the_pinned_module_and_its_defs_are_resolved() -> None:
    files = fetch_schema()
    zip_path = cdispec.schema_dir() / f"{SCHEMA_VERSION}.zip"
    assert hashlib.sha256(zip_path.read_bytes()).hexdigest() == SCHEMA_ZIP_SHA256
    assert {n: (cdispec.schema_dir() / n).read_bytes() for n in files} == files
    official = official_validator()
    assert list(official.iter_errors(SPEC)) == []
    # Checked only through schema.json's $ref into defs.json (a uint32 uid, string annotations).
    bad_node = edited(devices=[{"name": "x", "annotations": {"a": 1},
                                "containerEdits": {"deviceNodes": [{"path": "/dev/x", "uid": -1}]}}])
    assert sorted(e.message for e in official.iter_errors(bad_node)) == [
        "-1 is less than the minimum of 0", "1 is not of type 'string'"]
    with pytest.raises(jsonschema.ValidationError, match="'devices' is a required property"):
        validate_cdi_spec({"cdiVersion": "0.3.0", "kind": "a.b/c"})


@pytest.mark.parametrize(("spec", "message"), [
    (edited(extra=1), "Additional properties are not allowed"),  # the CDI loader parses strictly
    (edited(containerEdits={"deviceNodes": [{"hostPath": "/dev/x"}]}), "'path' is a required property"),
    (edited(devices=[{"name": f"{UID}-a", "containerEdits": {"env": ["A=1"]}}] * 2), "duplicate CDI device names"),
    (edited(devices=[{"name": f"{UID}-a", "containerEdits": {"env": []}}]), "empty device edits"),
])
def test_extra_rules_reject_what_the_official_schema_lets_through(spec: dict[str, Any], message: str) -> None:
    # The spec-wide edits are not declared in the official schema.json: unchecked by it alone.
    assert list(official_validator().iter_errors(spec)) == []
    with pytest.raises((AssertionError, jsonschema.ValidationError), match=message):
        validate_cdi_spec(spec)


def env_only(**fields: Any) -> dict[str, Any]:
    return {"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}], **fields}


@pytest.mark.parametrize(("spec", "version"), [
    (env_only(), "0.3.0"),
    (env_only(containerEdits={"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]}), "0.4.0"),
    (env_only(containerEdits={"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": ""}]}), "0.3.0"),
    (env_only(devices=[{"name": "0x", "containerEdits": {"env": ["A=1"]}}]), "0.5.0"),
    (env_only(containerEdits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/h/dev/x"}]}), "0.5.0"),
    (env_only(kind="a.b/c.d"), "0.6.0"),
    (env_only(kind="/c.d"), "0.3.0"),  # no vendor: not a qualified kind, so not the 0.6.0 rule
    (env_only(annotations={"k": "v"}), "0.6.0"),
    (env_only(devices=[{"name": "x", "annotations": {"k": "v"}, "containerEdits": {"env": ["A=1"]}}]), "0.6.0"),
    (env_only(annotations={}), "0.3.0"),
    (env_only(containerEdits={"intelRdt": {}}), "0.7.0"),  # a non-nil pointer, however empty
    (env_only(devices=[{"name": "x", "containerEdits": {"additionalGids": [5]}}]), "0.7.0"),
    (env_only(containerEdits={"intelRdt": {"enableMonitoring": True}}), "1.1.0"),
    (env_only(devices=[{"name": "0x", "containerEdits": {"netDevices": [
        {"hostInterfaceName": "eth1", "name": "net1"}]}}]), "1.1.0"),
])
def test_required_version_follows_the_cdi_version_history(spec: dict[str, Any], version: str) -> None:
    assert required_version(spec)[0] == version


@pytest.mark.parametrize("declared", ["0.3.0", "0.6.0", "1.1.0"])
def test_a_spec_must_declare_exactly_the_version_its_content_needs(declared: str) -> None:
    with pytest.raises(AssertionError, match=rf"cdiVersion {declared}, but its content needs exactly 0.5.0 "
                                             r"\(a device name not starting with a letter\)"):
        validate_cdi_spec(edited(cdiVersion=declared))


def proxy_with(root: Path, zip_bytes: bytes) -> str:
    """A file:// Go module proxy serving ``zip_bytes`` as the pinned version's zip."""
    versions = root / SCHEMA_MODULE / "@v"
    versions.mkdir(parents=True)
    (versions / f"{SCHEMA_VERSION}.zip").write_bytes(zip_bytes)
    return root.as_uri()


def test_the_fetch_checks_the_pin_falls_back_along_goproxy_and_repairs_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = fetch_schema()
    good_zip = (cdispec.schema_dir() / f"{SCHEMA_VERSION}.zip").read_bytes()
    good = proxy_with(tmp_path / "good", good_zip)
    tampered = proxy_with(tmp_path / "tampered", good_zip + b"tampered")
    cache = tmp_path / "cache"
    monkeypatch.setenv("GPUDRA_CACHE", str(cache))

    monkeypatch.setenv("GOPROXY", f"{tampered},{(tmp_path / 'absent').as_uri()}")
    with pytest.raises(SchemaUnavailable) as refused:
        fetch_schema()
    message = str(refused.value)
    assert f"pinned {SCHEMA_ZIP_SHA256}" in message and "No such file" in message
    assert message.endswith(cdispec.fix_command()) and "tests/cdispec.py" in cdispec.fix_command()
    assert not (cache / "cdi-schema" / SCHEMA_VERSION / f"{SCHEMA_VERSION}.zip").exists()

    monkeypatch.setenv("GOPROXY", f"direct|{tampered}|{good}")
    assert fetch_schema() == real
    directory = cache / "cdi-schema" / SCHEMA_VERSION
    assert sorted(p.name for p in directory.iterdir()) == ["defs.json", "schema.json", f"{SCHEMA_VERSION}.zip"]

    (directory / "defs.json").write_text("{}")  # an edited extract is put back from the verified zip
    (directory / f"{SCHEMA_VERSION}.zip").write_bytes(b"truncated")  # a bad zip is fetched again
    shutil.rmtree(tmp_path / "tampered")
    assert fetch_schema() == real and (directory / "defs.json").read_bytes() == real["defs.json"]
    assert (directory / f"{SCHEMA_VERSION}.zip").read_bytes() == good_zip


def test_goproxy_off_fails_with_the_command_instead_of_skipping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDRA_CACHE", str(tmp_path))
    monkeypatch.setenv("GOPROXY", "off")
    with pytest.raises(SchemaUnavailable, match="GOPROXY=off allows no download"):
        fetch_schema()


def test_every_spec_written_in_process_is_validated_as_it_is_written(
        cdi_writes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = PreparedDevice(("gpu",), "node-a", "gpu-3", "GPU-1", ("/dev/nvidia3",),
                            f"k8s.gpu.gpudra.io/claim={UID}-gpu-3")
    claim = PreparedClaim(ClaimRef("ns", "c1", UID), (device,))
    cdi = CdiDir(tmp_path, "gpu.gpudra.io", driver_files())
    assert cdi_writes.validated == [cdi.write(claim)] and cdi_writes.invalid == []

    # A driver that declared a newer cdiVersion than its content needs: caught at the write.
    monkeypatch.setattr(cdi_module, "minimum_version", lambda spec: "1.1.0")
    path = cdi.write(claim)
    (problem,) = cdi_writes.invalid
    assert problem.startswith(f"{path}: AssertionError: cdiVersion 1.1.0, but its content needs exactly 0.5.0")
    cdi_writes.invalid.clear()  # seen: this test is about the fixture noticing it


# The official CDI Go library (hack/cdi-tools' cdi-validate), which load_and_validate runs last.

def make_nodes(root: Path, *paths: str) -> None:
    """Real character device nodes (the NVIDIA major, 195) at ``root/<path>``: injecting a device
    makes the CDI library stat each node's host path."""
    for minor, path in enumerate(paths):
        node = root / path.lstrip("/")
        node.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, minor))
        os.chmod(node, 0o666)  # as the driver makes them (mknod's mode is masked by the umask)


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(json.dumps(spec))
    return path


def library_spec(root: Path, name: str = "gpu-0") -> dict[str, Any]:
    return {"cdiVersion": "0.5.0", "kind": "k8s.gpu.gpudra.io/claim",
            "devices": [{"name": name, "containerEdits": {
                "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": str(root / "dev/nvidia0")}],
                "env": ["NVIDIA_VISIBLE_DEVICES=GPU-0"]}}],
            "containerEdits": {
                "env": ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"],
                "mounts": [{"hostPath": str(root / "usr/bin/nvidia-smi"), "containerPath": "/usr/bin/nvidia-smi",
                            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}],
                "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                           "args": ["nvidia-cdi-hook", "update-ldcache"]}]}}


def test_the_library_injects_a_good_spec_and_returns_what_the_container_gets(tmp_path: Path) -> None:
    make_nodes(tmp_path, "/dev/nvidia0")
    path = write_spec(tmp_path / "k8s.gpu.gpudra.io-claim_a.json", library_spec(tmp_path))
    assert load_and_validate(path)["devices"][0]["name"] == "gpu-0"  # all layers, the library last
    injected = validate_with_cdi_library([path])
    assert list(injected) == ["k8s.gpu.gpudra.io/claim=gpu-0"]
    oci = injected["k8s.gpu.gpudra.io/claim=gpu-0"]
    # the type, numbers and mode come from the node on the host
    assert oci["linux"]["devices"] == [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
                                        "fileMode": 0o666}]
    assert oci["linux"]["resources"]["devices"] == [
        {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"}]
    assert oci["process"]["env"] == ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu",
                                     "NVIDIA_VISIBLE_DEVICES=GPU-0"]
    assert oci["mounts"] == [{"destination": "/usr/bin/nvidia-smi", "source": str(tmp_path / "usr/bin/nvidia-smi"),
                              "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}]
    assert oci["hooks"] == {"createContainer": [{"path": "/usr/bin/nvidia-cdi-hook",
                                                 "args": ["nvidia-cdi-hook", "update-ldcache"]}]}


def test_the_library_fails_a_device_node_missing_on_the_host(tmp_path: Path) -> None:
    path = write_spec(tmp_path / "spec.json", library_spec(tmp_path))  # no node made
    with pytest.raises(AssertionError) as failed:
        validate_with_cdi_library([path])
    message = str(failed.value)
    assert f"{path}: device k8s.gpu.gpudra.io/claim=gpu-0: " in message
    assert f'failed to stat CDI host device "{tmp_path}/dev/nvidia0": no such file or directory' in message
    with pytest.raises(AssertionError, match="failed to stat CDI host device"):
        load_and_validate(path)  # the schema layers accept it; the library does not


def test_the_library_fails_one_device_name_defined_by_two_specs_of_a_kind(tmp_path: Path) -> None:
    make_nodes(tmp_path, "/dev/nvidia0")
    first = write_spec(tmp_path / "a.json", library_spec(tmp_path))
    second = write_spec(tmp_path / "b.json", library_spec(tmp_path))
    assert validate_with_cdi_library([first]) and validate_with_cdi_library([second])  # each alone is good
    with pytest.raises(AssertionError) as failed:
        validate_with_cdi_library([first, second])
    message = str(failed.value)
    assert f'conflicting device "k8s.gpu.gpudra.io/claim=gpu-0" (specs "{second}", "{first}")' in message
    assert f"{first}: device k8s.gpu.gpudra.io/claim=gpu-0: not resolvable in the CDI cache" in message
    third = write_spec(tmp_path / "c.json", library_spec(tmp_path, name="gpu-1"))
    assert sorted(validate_with_cdi_library([first, third])) == [
        "k8s.gpu.gpudra.io/claim=gpu-0", "k8s.gpu.gpudra.io/claim=gpu-1"]


def test_the_library_fails_an_unknown_field(tmp_path: Path) -> None:
    make_nodes(tmp_path, "/dev/nvidia0")
    spec = library_spec(tmp_path)
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostpath"] = "/dev/x"  # a misspelt hostPath
    path = write_spec(tmp_path / "spec.json", spec)
    with pytest.raises(AssertionError, match=rf"{path}: failed to parse CDI Spec .*field hostpath not found"):
        validate_with_cdi_library([path])


def test_without_cdi_validate_it_fails_with_the_command_instead_of_skipping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_nodes(tmp_path, "/dev/nvidia0")
    path = write_spec(tmp_path / "spec.json", library_spec(tmp_path))
    monkeypatch.setenv("GPUDRA_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("GPUDRA_CDI_TOOLS_DIR", str(tmp_path / "nothing-here"))
    with pytest.raises(CdiToolsUnavailable, match=r"(?s)cdi-validate .* is not built.*make cdi-tools$"):
        validate_with_cdi_library([path])
