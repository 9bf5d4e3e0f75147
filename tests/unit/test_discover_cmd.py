from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpudra_driver import discover_cmd
from gpudra_dev.localcluster.fakedriverroot import make_driver_root


def gpudra(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gpudra")
    discover_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["discover", *argv])
    return args.run(args)


def test_yaml_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpudra("--nvml", "fake:dgx-h100", "--node-name", "gpu-node-1", "-o", "yaml") == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["node"] == "gpu-node-1" and doc["driver"] == "gpu.gpudra.io"
    assert [d["name"] for d in doc["devices"]] == [f"gpu-{i}" for i in range(8)]
    [s] = doc["resourceSlices"]
    assert s["metadata"]["name"] == "gpu-node-1-gpu-gpudra-io-0"
    assert s["spec"]["nodeName"] == "gpu-node-1"
    assert s["spec"]["devices"][0]["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert s["spec"]["devices"][0]["capacity"]["memory"] == {"value": "81559Mi"}
    assert "ownerReferences" not in s["metadata"]
    assert doc["warnings"] == []


def test_json_output_with_owner_and_driver(capsys: pytest.CaptureFixture[str]) -> None:
    rc = gpudra("--nvml", "fake:a100-80gb-mig", "--node-name", "n1", "--node-uid", "uid-1",
                "--driver", "gpu.example.com", "--generation", "4", "-o", "json")
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    [s] = doc["resourceSlices"]
    assert s["metadata"]["name"] == "n1-gpu-example-com-0"
    assert s["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert s["spec"]["pool"] == {"name": "n1", "generation": 4, "resourceSliceCount": 1}
    assert [d["attributes"]["profile"]["string"] for d in doc["devices"]] == ["3g.40gb", "1g.10gb", "1g.10gb"]


def test_table_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "from-env")
    monkeypatch.setenv("GPUDRA_NVML", "fake:l4x2")
    assert gpudra() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "PRODUCT", "MEMORY(GiB)", "CC", "UUID", "HEALTH"]
    assert lines[1].split() == ["gpu-0", "gpu", "NVIDIA", "L4", "22.5", "8.9", "GPU-62d683dd-a608-5810-9a31-ff06c70237fb",
                                "healthy"]
    assert lines[2].split()[0] == "gpu-1"
    assert lines[-2] == "2 device(s) in 1 ResourceSlice(s) for node from-env, driver gpu.gpudra.io"
    assert lines[-1] == "health: 2 healthy, 0 unhealthy, 0 unmonitored; shareable: 0 (several claims at once)"


def test_health_shows_what_one_probe_finds(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from gpudra_dev.localcluster import mockstate

    root = tmp_path / "root"  # the simulator reads injected health from the root's state directory
    mockstate.set_recovery_action(root, "GPU-6992fa00-c02c-5e2f-a617-96ce040c16ef", 2)
    assert gpudra("--nvml", "fake:l4x2", "--driver-root", str(root), "--node-name", "n") == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[-1] == "healthy" and rows[2].split()[-2:] == ["unhealthy", "(recovery-action=node-reboot)"]
    assert gpudra("--nvml", "fake:l4x2", "--driver-root", str(root), "--node-name", "n", "-o", "json") == 0
    devices = json.loads(capsys.readouterr().out)["devices"]
    assert "taints" not in devices[0]
    assert [(t["key"], t["value"], t["effect"]) for t in devices[1]["taints"]] == [
        ("gpu.gpudra.io/recovery-action", "node-reboot", "NoSchedule")]
    assert gpudra("--nvml", "fake:l4x2", "--driver-root", str(root), "--node-name", "n", "--no-health") == 0
    assert "HEALTH" not in capsys.readouterr().out


def test_mig_rows_name_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpudra("--nvml", "fake:a100-80gb-mig", "--node-name", "n") == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:6] == ["gpu-0-mig-3g40gb-2-0", "mig", "NVIDIA", "A100-SXM4-80GB", "MIG", "3g.40gb"]
    assert "39.2" in row.split() and "8.0" in row.split()


def test_nvml_unavailable_is_one_line_and_nonzero(
    capsys: pytest.CaptureFixture[str], profile_file: Callable[..., Path]
) -> None:
    path = profile_file("l4x2", lambda doc: doc.update(initError="DriverNotLoaded"))
    assert gpudra("--nvml", f"fake:{path}", "--node-name", "n") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("gpudra discover: NVML unavailable:")
    assert "kernel driver is not loaded" in err


def test_bad_profile_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpudra("--nvml", "fake:nope", "--node-name", "n") == 2
    assert "unknown NVML profile 'nope'" in capsys.readouterr().err


def test_warnings_go_to_stderr(capsys: pytest.CaptureFixture[str], profile_file: Callable[..., Path]) -> None:
    path = profile_file("l4x2", lambda doc: doc["gpus"][0].update(fail=True))
    assert gpudra("--nvml", f"fake:{path}", "--node-name", "n", "-o", "json") == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [d["name"] for d in doc["devices"]] == ["gpu-1"]
    assert doc["warnings"] == ["GPU 0 skipped: nvmlDeviceGetUUID failed: Unknown Error"]
    assert err == "warning: GPU 0 skipped: nvmlDeviceGetUUID failed: Unknown Error\n"


def test_importing_the_command_is_cheap() -> None:
    code = (
        "import sys, gpudra_driver.discover_cmd\n"
        "heavy = [m for m in ('pynvml', 'yaml', 'gpudra_driver.discovery', 'gpudra_driver.nvml.fake') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the real pynvml on a fake driver root (the mock libnvidia-ml.so.1 built by `make mock-nvml`) ---

def discover_real(*argv: str) -> subprocess.CompletedProcess[str]:
    """`gpudra discover --nvml real` as its own process: pynvml keeps one library per process."""
    return subprocess.run([sys.executable, "-m", "gpudra.cli", "discover", "--nvml", "real", *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "GPUDRA_NVML": ""})


@pytest.mark.parametrize("profile", ["dgx-h100", "a100-80gb-mig"])
def test_real_nvml_from_a_driver_root_finds_what_the_simulator_describes(tmp_path: Path, profile: str) -> None:
    root = make_driver_root(tmp_path / "root", profile)
    done = discover_real("--driver-root", str(root), "--node-name", "n", "-o", "json")
    assert done.returncode == 0, done.stderr
    simulated = subprocess.run([sys.executable, "-m", "gpudra.cli", "discover", "--nvml", f"fake:{profile}",
                                "--node-name", "n", "-o", "json"], capture_output=True, text=True, check=True)
    real, fake = json.loads(done.stdout), json.loads(simulated.stdout)
    assert real["devices"] and real["devices"] == fake["devices"]
    assert real["resourceSlices"] == fake["resourceSlices"]


def test_a_driver_root_without_nvml_names_the_root_and_every_path_searched(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    done = discover_real("--driver-root", str(tmp_path), "--node-name", "n")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"gpudra discover: libnvidia-ml.so.1 was not found in driver root {tmp_path}")
    assert f"{tmp_path}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in done.stderr
    assert f"{tmp_path}/usr/lib64/libnvidia-ml.so.1" in done.stderr
    missing = discover_real("--driver-root", str(tmp_path / "nope"), "--node-name", "n")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    # on a machine without an NVIDIA GPU on its PCI bus that is said too, so nobody debugs a driver
    # on a CPU node; on a GPU machine it must not be
    from gpudra_driver.discovery import nvidia_gpus_on_pci

    assert done.stderr.count("\n") == 1
    assert ("(no NVIDIA GPU on this node: no PCI device of vendor 10de" in done.stderr) == (nvidia_gpus_on_pci() == [])


@pytest.mark.parametrize(("error", "hint"), [("DriverNotLoaded", "kernel driver is not loaded"),
                                             ("NoPermission", "no permission"),
                                             ("LibRmVersionMismatch", "different versions")])
def test_nvml_init_failures_on_a_node_are_one_line_and_exit_1(tmp_path: Path, profile_file: Callable[..., Path],
                                                             error: str, hint: str) -> None:
    root = make_driver_root(tmp_path / "root", str(profile_file("l4x2", lambda doc: doc.update(initError=error))),
                            device_nodes=False)
    done = discover_real("--driver-root", str(root), "--node-name", "n")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("gpudra discover: NVML unavailable:") and hint in done.stderr
    if error == "LibRmVersionMismatch":  # which library, and which kernel module where it can tell
        assert str(root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.104.05") in done.stderr


def test_a_library_of_another_architecture_exits_1_before_loading(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "root", "l4x2", device_nodes=False)
    library = root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.104.05"
    data = bytearray(library.read_bytes())
    data[18:20] = (183).to_bytes(2, "little")  # e_machine: EM_AARCH64
    library.write_bytes(bytes(data))
    done = discover_real("--driver-root", str(root), "--node-name", "n")
    assert done.returncode == 1 and "64-bit aarch64 library" in done.stderr and str(library) in done.stderr


def test_consumable_capacity_flags_show_what_the_agent_would_publish(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpudra("--nvml", "fake:a100-80gb-mig", "--consumable-memory-step", "1Gi", "--consumable-shares", "4",
                  "-o", "yaml") == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    # the MIG-enabled A100 publishes MIG devices only: partitions are never shared
    assert not any(d.get("allowMultipleAllocations") for d in doc["devices"])
    assert gpudra("--nvml", "fake:dgx-h100", "--consumable-memory-step", "1Gi", "--consumable-shares", "4",
                  "-o", "yaml") == 0
    [slice_] = yaml.safe_load(capsys.readouterr().out)["resourceSlices"]
    device = slice_["spec"]["devices"][0]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "79Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}}
    assert device["capacity"]["shares"]["value"] == "4"
    assert gpudra("--nvml", "fake:l4x2", "--consumable-memory-step", "16Gi") == 0
    out, err = capsys.readouterr()
    assert "consumable capacity: 0 GPU(s) published for sharing (none), memory in steps of 16Gi" in out
    assert err.count("published unshared, one claim at a time") == 2
    assert gpudra("--nvml", "fake:l4x2", "--consumable-shares", "2") == 2
    assert "--consumable-shares needs --consumable-memory-step" in capsys.readouterr().err


def test_the_summary_counts_as_the_config_status_counts_the_slices(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    """`gpudra discover`, the agent's metrics and `kubectl get gdc -o wide` read health and sharing
    the same way: the summary line equals what the operator counts in the slices discover prints."""
    from gpudra_dev.localcluster import mockstate
    from gpudra_operator.classcounts import unmatched_slice

    root = tmp_path / "root"
    mockstate.set_recovery_action(root, "GPU-6992fa00-c02c-5e2f-a617-96ce040c16ef", 2)
    args = ("--nvml", "fake:l4x2", "--driver-root", str(root), "--node-name", "n", "--consumable-memory-step", "1Gi")
    assert gpudra(*args) == 0
    line = capsys.readouterr().out.splitlines()[-2]
    assert line == "health: 1 healthy, 1 unhealthy, 0 unmonitored; shareable: 2 (several claims at once)"
    assert gpudra(*args, "-o", "json") == 0
    kept = [unmatched_slice("gpu.gpudra.io", s) for s in json.loads(capsys.readouterr().out)["resourceSlices"]]
    devices = sum(len(k.devices) for k in kept)
    unhealthy, unmonitored = sum(k.unhealthy for k in kept), sum(k.unmonitored for k in kept)
    assert (devices - unhealthy - unmonitored, unhealthy, unmonitored, sum(k.shareable for k in kept)) == (1, 1, 0, 2)
