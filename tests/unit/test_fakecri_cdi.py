"""The fake CRI runtime's CDI resolution (tests/fakecri/runtime.py ``resolve_cdi``): the official CDI
library's injection (``cdi-validate --inject``) of all a container's names into one OCI spec, read
back as env, device nodes, mounts and hooks; unknown names and broken spec files as a runtime
treats them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cdispec import cdi_validate, validate_cdi_spec

from fakecri.runtime import CdiEdits, resolve_cdi

KIND = "k8s.gpu.gpudra.io/claim"
UID = "0c1d2e3f-0000-4000-8000-00000000000a"


def char_device(path: Path) -> Path:
    """A real character device node (major 195, like /dev/nvidia0) at ``path``."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    except PermissionError:  # never skipped to green: make test runs as root, as CI does
        pytest.fail("creating a device node needs CAP_MKNOD: run `make test` as root", pytrace=False)
    return path


def write_spec(directory: Path, name: str, spec: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(validate_cdi_spec(spec)))
    return path


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    """A spec directory with one claim spec: spec-wide env and a library mount, two GPU devices
    whose nodes' host paths are real device nodes under tmp_path."""
    host = tmp_path / "host"
    host.mkdir()
    lib = host / "libcuda.so.550.54.15"
    lib.write_bytes(b"")
    nodes = [char_device(host / f"nvidia{i}") for i in range(2)]
    write_spec(tmp_path / "cdi", f"k8s.gpu.gpudra.io-claim_{UID}.json", {
        "cdiVersion": "0.5.0", "kind": KIND,
        "containerEdits": {
            "env": ["NVIDIA_DRIVER_CAPABILITIES=all"],
            "mounts": [{"hostPath": str(lib), "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                        "options": ["ro", "nosuid", "nodev", "bind"]}],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]}],
        },
        "devices": [{"name": f"{UID}-gpu-{i}", "containerEdits": {
            "env": [f"GPU{i}=GPU-{i}"],
            "deviceNodes": [{"path": f"/dev/nvidia{i}", "hostPath": str(node)}]}}
            for i, node in enumerate(nodes)],
    })
    return tmp_path / "cdi"


def test_one_device_edits(spec_dir: Path) -> None:
    edits = resolve_cdi([f"{KIND}={UID}-gpu-0"], [spec_dir])
    host_lib = spec_dir.parent / "host" / "libcuda.so.550.54.15"
    assert edits.env == {"NVIDIA_DRIVER_CAPABILITIES": "all", "GPU0": "GPU-0"}
    assert edits.device_nodes == ["/dev/nvidia0"]
    assert edits.mounts == {"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15": str(host_lib)}
    assert edits.hooks == [["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]]


def test_spec_wide_edits_apply_once_for_two_devices(spec_dir: Path) -> None:
    edits = resolve_cdi([f"{KIND}={UID}-gpu-0", f"{KIND}={UID}-gpu-1"], [spec_dir])
    assert edits.env == {"NVIDIA_DRIVER_CAPABILITIES": "all", "GPU0": "GPU-0", "GPU1": "GPU-1"}
    assert edits.device_nodes == ["/dev/nvidia0", "/dev/nvidia1"]
    assert list(edits.mounts) == ["/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"]
    assert len(edits.hooks) == 1, edits.hooks  # the spec's hook once, not once per device
    # CdiEdits.mounts is keyed by container path, so it would hide a repeat: the OCI spec itself
    # has the spec-wide mount once.
    injected = subprocess.run([str(cdi_validate()), "--inject", f"{KIND}={UID}-gpu-0,{KIND}={UID}-gpu-1",
                               "--spec-dir", str(spec_dir)], capture_output=True, text=True, check=True)
    assert [m["destination"] for m in json.loads(injected.stdout)["mounts"]] == [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"]


def test_no_names_no_edits(spec_dir: Path) -> None:
    assert resolve_cdi([], [spec_dir]) == CdiEdits()


def test_unknown_name_raises_lookup_error(spec_dir: Path) -> None:
    unknown = f"{KIND}={UID}-gpu-7"
    with pytest.raises(LookupError, match="unresolvable CDI device") as raised:
        resolve_cdi([f"{KIND}={UID}-gpu-0", unknown], [spec_dir])
    assert unknown in str(raised.value)
    assert f"{KIND}={UID}-gpu-0," not in str(raised.value)  # only the name that does not resolve


def test_broken_spec_breaks_only_its_own_devices(spec_dir: Path, tmp_path: Path) -> None:
    (spec_dir / "z-broken.json").write_text('{"cdiVersion": "0.5.0", "kind": "example.com/nic", "devices": [')
    other = tmp_path / "other"
    other.mkdir()
    (other / "bad.yaml").write_text("cdiVersion: 0.5.0\nkind: example.com/nic\ndevices: [{name: eth0}]\n")
    edits = resolve_cdi([f"{KIND}={UID}-gpu-1"], [spec_dir, other])
    assert edits.device_nodes == ["/dev/nvidia1"]
    assert edits.env["GPU1"] == "GPU-1"
    with pytest.raises(LookupError, match="unresolvable CDI device") as raised:
        resolve_cdi(["example.com/nic=eth0"], [spec_dir, other])
    assert "example.com/nic=eth0" in str(raised.value)


def test_missing_host_device_node_fails_injection(spec_dir: Path) -> None:
    (spec_dir.parent / "host" / "nvidia1").unlink()
    assert resolve_cdi([f"{KIND}={UID}-gpu-0"], [spec_dir]).device_nodes == ["/dev/nvidia0"]
    with pytest.raises(ValueError, match="failed to stat CDI host device .*nvidia1"):
        resolve_cdi([f"{KIND}={UID}-gpu-1"], [spec_dir])
