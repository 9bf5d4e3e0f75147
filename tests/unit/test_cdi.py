"""CDI specs: content, the minimum cdiVersion, schema validity, and the spec directory's files."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from cdispec import load_and_validate, validate_cdi_spec
from plugin_fixtures import DRIVER, NODE, claim, devices, fake_root, result

from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.plugin.cdi import CdiDir, cdi_spec, claim_uid_of, minimum_version, spec_file_name
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.driverfiles import DriverFiles, DriverFilesCache
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback, read_mig_cap_minor
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim
from gpudra_driver.plugin.plan import plan_prepare

UID = "0c1d2e3f-0000-4000-8000-000000000001"


def prepared(*results, uid: str = UID, profile: str = "dgx-h100") -> PreparedClaim:
    return plan_prepare(ClaimRef("ns", "c1", uid), claim(uid, results=list(results)), devices(profile),
                        Checkpoint("b"), node=NODE, driver=DRIVER).claim


@pytest.fixture
def root() -> DriverRoot:
    return fake_root("dgx-h100")


@pytest.fixture
def files(root: DriverRoot) -> DriverFiles:
    return DriverFilesCache(root).current()


def test_gpu_claim_spec_names_the_gpu_node_uuid_and_the_drivers_user_space(root: DriverRoot,
                                                                         files: DriverFiles) -> None:
    spec = validate_cdi_spec(cdi_spec(prepared(result("gpu-3"), result("gpu-5")), DRIVER, files))
    gpus = devices()
    assert spec["kind"] == "k8s.gpu.gpudra.io/claim"
    assert spec["cdiVersion"] == "0.5.0"  # hostPath (and the device names start with a digit)
    dev = f"{root.host}/dev"
    assert spec["devices"] == [
        {"name": f"{UID}-gpu-3", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia3", "hostPath": f"{dev}/nvidia3"}]}},
        {"name": f"{UID}-gpu-5", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia5", "hostPath": f"{dev}/nvidia5"}]}},
    ]
    common = spec["containerEdits"]
    assert common["env"] == [f"NVIDIA_VISIBLE_DEVICES={gpus['gpu-3'].uuid},{gpus['gpu-5'].uuid}",
                             "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"]
    assert common["deviceNodes"] == [{"path": p, "hostPath": root.host + p} for p in (
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")]
    mounts = {m["containerPath"]: m["hostPath"] for m in common["mounts"]}
    lib = "/usr/lib/x86_64-linux-gnu"
    version = files.version
    for name in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"):
        assert mounts[f"{lib}/{name}.{version}"] == f"{root.host}{lib}/{name}.{version}"
        # no nvidia-cdi-hook in this root: the soname is mounted too, from the resolved file
        assert mounts[f"{lib}/{name}.1"] == f"{root.host}{lib}/{name}.{version}"
    assert mounts[f"{lib}/libcuda.so"] == f"{root.host}{lib}/libcuda.so.{version}"
    assert mounts["/usr/bin/nvidia-smi"] == f"{root.host}/usr/bin/nvidia-smi"
    assert f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin" in mounts
    assert all(m["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"] for m in common["mounts"])
    assert "hooks" not in common


def test_devices_of_different_requests_name_only_their_own_request_gpus(files: DriverFiles) -> None:
    """A container that references one request of the claim gets only that request's devices
    (and the spec-wide edits): NVIDIA_VISIBLE_DEVICES must not name the other request's GPUs."""
    claim = prepared(result("gpu-1", request="train"), result("gpu-2", request="train"),
                     result("gpu-6", request="serve"))
    spec = validate_cdi_spec(cdi_spec(claim, DRIVER, files))
    gpus = devices()
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in spec["containerEdits"]["env"])
    env = {d["name"].rsplit("-", 2)[-2] + "-" + d["name"].rsplit("-", 1)[-1]: d["containerEdits"]["env"]
           for d in spec["devices"]}
    train = f"NVIDIA_VISIBLE_DEVICES={gpus['gpu-1'].uuid},{gpus['gpu-2'].uuid}"
    assert env == {"gpu-1": [train], "gpu-2": [train], "gpu-6": [f"NVIDIA_VISIBLE_DEVICES={gpus['gpu-6'].uuid}"]}
    # Whatever a container is given (one request, or the whole claim), CDI applies the edits of its
    # devices in order and the last value of a variable wins: it names no GPU the container lacks.
    for given in (["gpu-1", "gpu-2"], ["gpu-6"], ["gpu-1", "gpu-2", "gpu-6"]):
        last = [e for name in given for e in env[name]][-1]
        named = set(last.split("=", 1)[1].split(","))
        assert named and named <= {gpus[name].uuid for name in given}


@pytest.mark.parametrize("hooked", [False, True], ids=["no-hook", "nvidia-cdi-hook"])
def test_the_spec_file_is_exactly_the_compact_json_of_the_spec(files: DriverFiles, hooked: bool) -> None:
    """encode_spec splices the spec-wide edits' JSON, encoded once per view, into the claim's."""
    from gpudra_driver.plugin.cdi import encode_spec

    if hooked:
        files = dataclasses.replace(files, hook="/usr/bin/nvidia-cdi-hook")
    for claim in (prepared(result("gpu-3")),
                  prepared(result("gpu-1", request="train"), result("gpu-6", request="serve")),
                  prepared(result("gpu-4"), uid="0c1d2e3f-0000-4000-8000-0000000000ff")):
        expected = json.dumps(cdi_spec(claim, DRIVER, files), separators=(",", ":")).encode() + b"\n"
        assert encode_spec(claim, DRIVER, files) == expected


def test_spec_version_is_the_minimum_never_newer(files: DriverFiles) -> None:
    letter_uid = "a" + UID[1:]
    on_host_dev = dataclasses.replace(files, device_root="")  # nodes in the host's /dev: no hostPath
    assert cdi_spec(prepared(result("gpu-0"), uid=letter_uid), DRIVER, on_host_dev)["cdiVersion"] == "0.3.0"
    rooted = cdi_spec(prepared(result("gpu-0"), uid=letter_uid), DRIVER,
                      dataclasses.replace(files, device_root="/run/nvidia/driver"))
    assert rooted["cdiVersion"] == "0.5.0"  # hostPath needs 0.5.0
    assert rooted["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}]
    assert {"path": "/dev/nvidiactl", "hostPath": "/run/nvidia/driver/dev/nvidiactl"} in \
        rooted["containerEdits"]["deviceNodes"]


@pytest.mark.parametrize(("spec", "version"), [
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}, "0.3.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"mounts": [
        {"hostPath": "/a", "containerPath": "/b", "type": "bind"}]}}]}, "0.4.0"),
    ({"kind": "a.b/c", "devices": [{"name": "0x", "containerEdits": {"env": ["A=1"]}}]}, "0.5.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"deviceNodes": [
        {"path": "/dev/x", "hostPath": "/h/dev/x"}]}}]}, "0.5.0"),
    ({"kind": "a.b/c.d", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}, "0.6.0"),
    ({"kind": "a.b/c", "annotations": {"k": "v"}, "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]},
     "0.6.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"additionalGids": [5]}}]}, "0.7.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"intelRdt": {}}}]}, "0.7.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"intelRdt": {"schemata": ["L3:0=f"]}}}]}, "1.1.0"),
    ({"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"netDevices": [
        {"hostInterfaceName": "eth1", "name": "net1"}]}}]}, "1.1.0"),
])
def test_minimum_version_follows_the_cdi_rules(spec, version: str) -> None:
    assert minimum_version(spec) == version


def test_mig_spec_has_parent_and_capability_nodes() -> None:
    root = fake_root("a100-80gb-mig")
    spec = validate_cdi_spec(cdi_spec(prepared(result("gpu-0-mig-1g10gb-9-0"), profile="a100-80gb-mig"), DRIVER,
                                      DriverFilesCache(root).current()))
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": p, "hostPath": root.host + p}
        for p in ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap84", "/dev/nvidia-caps/nvidia-cap85")]
    assert spec["containerEdits"]["env"][0].startswith("NVIDIA_VISIBLE_DEVICES=MIG-")


@pytest.mark.parametrize("claim", [
    pytest.param(lambda: prepared(result("gpu-3"), result("gpu-5")), id="gpus"),
    pytest.param(lambda: prepared(result("gpu-1", request="a"), result("gpu-6", request="b")), id="per-request"),
    pytest.param(lambda: prepared(result("gpu-0-mig-1g10gb-9-0"), profile="a100-80gb-mig"), id="mig"),
])
def test_specs_hold_only_edits_that_cdi_applies_idempotently(claim, files: DriverFiles) -> None:  # type: ignore[no-untyped-def]
    """Kubelets 1.35 and 1.36 pass a claim's CDI IDs twice after a restart (kubernetes#140471), and
    containerd 1.7 and CRI-O inject them as given: the CDI library then applies each device's
    edits twice. Device nodes are replaced by path, env variables by name and mounts by container
    path, so the container ends up as with one injection; hooks would run twice and duplicated net
    devices fail the container (container-device-interface, ``ContainerEdits.Apply``). Spec-wide
    edits are applied once per spec however often its devices are named (``Cache.InjectDevices``),
    so the hooks live there only."""
    with_hook = dataclasses.replace(files, hook="/usr/bin/nvidia-cdi-hook")
    spec = cdi_spec(claim(), DRIVER, with_hook)
    assert spec["containerEdits"]["hooks"]
    for edits in [spec["containerEdits"], *(device["containerEdits"] for device in spec["devices"])]:
        allowed = {"deviceNodes", "env", "mounts"} | ({"hooks"} if edits is spec["containerEdits"] else set())
        assert set(edits) <= allowed, edits.keys()
        paths = [m["containerPath"] for m in edits.get("mounts", [])]
        assert len(set(paths)) == len(paths)
        assert len({node["path"] for node in edits.get("deviceNodes", [])}) == len(edits.get("deviceNodes", []))
        names = [entry.split("=", 1)[0] for entry in edits.get("env", [])]
        assert len(set(names)) == len(names)


def test_mig_capability_minors_come_from_the_driver_and_fall_back_to_its_layout(tmp_path: Path) -> None:
    # /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, ...
    assert [mig_cap_minor_fallback(0, 0, None), mig_cap_minor_fallback(0, 0, 0), mig_cap_minor_fallback(0, 1, None),
            mig_cap_minor_fallback(1, 0, None)] == [3, 4, 12, 138]
    with pytest.raises(ValueError):
        mig_cap_minor_fallback(0, 15, None)
    gi = tmp_path / "driver/nvidia/capabilities/gpu2/mig/gi7"
    (gi / "ci1").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 301\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (gi / "ci1" / "access").write_text("DeviceFileMinor: 303\nDeviceFileMode: 292\n")
    resolve = read_mig_cap_minor(tmp_path)
    assert (resolve(2, 7, None), resolve(2, 7, 1), resolve(0, 0, None)) == (301, 303, 3)


def test_a_claim_without_devices_has_no_spec(files: DriverFiles) -> None:
    with pytest.raises(ValueError, match="no devices"):
        cdi_spec(PreparedClaim(ClaimRef("ns", "c", UID), ()), DRIVER, files)


def test_spec_files_are_written_whole_found_and_removed(tmp_path: Path, root: DriverRoot) -> None:
    cdi = CdiDir(tmp_path / "cdi", DRIVER, DriverFilesCache(root))
    foreign = tmp_path / "cdi" / "nvidia.com-gpu.yaml"
    path = cdi.write(prepared(result("gpu-1")))
    foreign.write_text("cdiVersion: 0.3.0\n")
    assert path.name == f"k8s.gpu.gpudra.io-claim_{UID}.json" == spec_file_name(DRIVER, UID)
    assert load_and_validate(path)["devices"][0]["name"] == f"{UID}-gpu-1"
    assert sorted(os.listdir(cdi.path)) == sorted([path.name, foreign.name])  # no temp file left
    assert cdi.claim_uids() == {UID}
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert cdi.remove(UID) and not cdi.remove(UID)
    assert cdi.claim_uids() == set() and foreign.exists()


def test_interrupted_writes_leave_only_temp_files_that_are_cleaned(tmp_path: Path, root: DriverRoot) -> None:
    cdi = CdiDir(tmp_path, DRIVER, DriverFilesCache(root))
    (tmp_path / f".{spec_file_name(DRIVER, UID)}.tmp-1234").write_text("{")
    (tmp_path / ".other.tmp-1").write_text("x")
    assert cdi.claim_uids() == set()
    assert cdi.remove_temp_files() == 1
    assert os.listdir(tmp_path) == [".other.tmp-1"]


def test_an_unwritable_cdi_directory_raises_oserror_and_writes_nothing(tmp_path: Path, root: DriverRoot) -> None:
    blocker = tmp_path / "cdi"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        CdiDir(blocker, DRIVER, DriverFilesCache(root)).write(prepared(result("gpu-1")))
    assert os.listdir(tmp_path) == ["cdi"]


def test_claim_uid_of_recognises_only_this_drivers_specs(files: DriverFiles) -> None:
    assert claim_uid_of(DRIVER, f"k8s.gpu.gpudra.io-claim_{UID}.json") == UID
    assert claim_uid_of(DRIVER, f"k8s.other.io-claim_{UID}.json") is None
    assert claim_uid_of(DRIVER, "k8s.gpu.gpudra.io-claim_.json") is None
    assert claim_uid_of(DRIVER, f"k8s.gpu.gpudra.io-claim_{UID}.yaml") is None
    assert json.loads(json.dumps(cdi_spec(prepared(result("gpu-2")), DRIVER, files)))  # plain JSON types only


def test_the_devices_a_spec_names_are_read_back_and_an_unreadable_spec_names_none(tmp_path: Path, root: DriverRoot) -> None:
    cdi = CdiDir(tmp_path, DRIVER, DriverFilesCache(root))
    cdi.write(prepared(result("gpu-1"), result("gpu-4")))
    assert sorted(cdi.device_names(UID)) == ["gpu-1", "gpu-4"]
    cdi.spec_path(UID).write_text("{torn")
    assert cdi.device_names(UID) is None and cdi.device_names("0c1d2e3f-0000-4000-8000-0000000000ff") is None
