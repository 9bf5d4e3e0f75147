"""Dynamic MIG at prepare and unprepare (DeviceState on disk, the simulated NVML's instances shared
through its state directory as on a node): the instance is created at the allocated placement
after its intent is recorded, the CDI spec names the MIG device's nodes, unprepare destroys it;
and a crash at every step, then a restart, leaves no instance that no record names and loses
none that one does."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from cdispec import load_and_validate
from plugin_fixtures import DRIVER, NODE, driver_files, result
from test_device_state import Crash, CrashAt, items

from gpudra_dev.localcluster.mockstate import mig_devices
from gpudra_driver.discovery import scan
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.cdi import CdiDir, metadata_dir
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback, node_devices
from gpudra_driver.plugin.faults import POINTS
from gpudra_driver.plugin.miginstances import MigInstances
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.state import DeviceState

PROFILE = "h100-dynamic-mig"
A, B = "0c1d2e3f-0000-4000-8000-00000000000a", "0c1d2e3f-0000-4000-8000-00000000000b"
REF_A, REF_B = ClaimRef("ns", "a", A), ClaimRef("ns", "b", B)


def nvml(tmp_path: Path, profile: str = PROFILE) -> FakeNvml:
    return FakeNvml(load_profile(profile), tmp_path / "nvml-state")


def instances(tmp_path: Path) -> list[tuple[int, int]]:
    """(GPU instance, compute instance) of every MIG device on GPU 0, as NVML lists them now."""
    return mig_devices(nvml(tmp_path))


def make(tmp_path: Path, fault: CrashAt | None = None, profile: str = PROFILE) -> DeviceState:
    cdi = CdiDir(tmp_path / "cdi", DRIVER, driver_files(PROFILE), metadata_root=metadata_dir(tmp_path / "cdi", DRIVER))
    state = DeviceState(tmp_path / "plugin", cdi, driver=DRIVER,
                        node=NODE, boot_id="boot-1", fault=fault if fault is not None else CrashAt(),
                        mig=MigInstances(lambda: nvml(tmp_path, profile), mig_cap_minor_fallback))
    state.recover()
    rescan(state, tmp_path, profile)
    return state


def rescan(state: DeviceState, tmp_path: Path, profile: str = PROFILE) -> None:
    """What the agent's rescan does: discovery, knowing the instances and whole GPUs the checkpoint names."""
    found = scan(nvml(tmp_path, profile), mig="dynamic", owned=state.owned_mig_instances(),
                 mig_mode_off=state.mig_mode_off_gpus())
    assert found.warnings == [], found.warnings
    state.set_devices(node_devices(found.devices))


def claim(uid: str, name: str, *devices: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ns", "uid": uid}, "spec": {},
            "status": {"allocation": {"devices": {"results": [result(d, request="mig") for d in devices]},
                                      "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                                          {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}}


async def test_prepare_creates_the_instance_at_the_placement_and_unprepare_destroys_it(tmp_path: Path) -> None:
    state = make(tmp_path)
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4"))))
    assert out[A].error is None, out[A].error
    (device,) = out[A].claim.devices
    assert device.mig is not None and (device.mig.start, device.mig.size, device.mig.gi, device.mig.ci) == (4, 4, 2, 0)
    assert instances(tmp_path) == [(2, 0)]
    assert device.uuid.startswith("MIG-")
    cap_gi, cap_ci = mig_cap_minor_fallback(0, 2, None), mig_cap_minor_fallback(0, 2, 0)
    spec = load_and_validate(state.cdi.spec_path(A))
    root = driver_files(PROFILE).root.host
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": p, "hostPath": f"{root}{p}"}
        for p in ("/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{cap_gi}", f"/dev/nvidia-caps/nvidia-cap{cap_ci}")]
    assert f"NVIDIA_VISIBLE_DEVICES={device.uuid}" in spec["containerEdits"]["env"]
    saved, _ = ckpt.load(state.checkpoint_path, "boot-1")
    assert saved.claims[A].state == ckpt.COMPLETED and saved.claims[A].claim.devices[0].mig == device.mig
    assert '"version":5' in state.checkpoint_path.read_text()  # an older agent refuses it, never drops the instance
    # (4 for the instance, 5 for its device metadata)
    # its device metadata: the placement's attributes, and the instance prepare made
    (metadata, _) = (metadata_dir(tmp_path / "cdi", DRIVER) / f"{A}_mig.json").read_text().splitlines()
    (attributes,) = [d["attributes"] for d in json.loads(metadata)["requests"][0]["devices"]]
    assert (attributes["uuid"], attributes["gpuInstanceId"], attributes["computeInstanceId"]) == (
        {"string": device.uuid}, {"int": 2}, {"int": 0})
    assert attributes["profile"] == {"string": "3g.40gb"}
    assert attributes["parentUUID"] == {"string": device.mig.parent_uuid}

    again = await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4"))))
    assert again[A] == out[A] and instances(tmp_path) == [(2, 0)]  # idempotent: nothing made twice

    assert await state.unprepare([REF_A]) == {A: None}
    assert instances(tmp_path) == [] and not state.cdi.exists(A)
    assert not os.listdir(metadata_dir(tmp_path / "cdi", DRIVER))
    assert await state.unprepare([REF_A]) == {A: None}


async def test_a_placement_nvml_refuses_fails_its_claim_only(tmp_path: Path) -> None:
    state = make(tmp_path)
    # the scheduler would never overlap these; a stale allocation might: NVML is the last word
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-4g40gb-at0")))))[A].error is None
    out = await state.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-1g10gb-at2")),
                                    (ClaimRef("ns", "c", "0c1d2e3f-0000-4000-8000-00000000000c"),
                                     claim("0c1d2e3f-0000-4000-8000-00000000000c", "c", "gpu-0-mig-1g10gb-at6"))))
    assert "InsufficientResources" in (out[B].error or "") and "1g.10gb at memory slice 2" in (out[B].error or "")
    assert out["0c1d2e3f-0000-4000-8000-00000000000c"].error is None
    saved, _ = ckpt.load(state.checkpoint_path, "boot-1")
    assert set(saved.claims) == {A, "0c1d2e3f-0000-4000-8000-00000000000c"}
    assert not state.cdi.exists(B) and len(instances(tmp_path)) == 2


async def test_an_injected_nvml_failure_leaves_nothing_behind(tmp_path: Path) -> None:
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "driver/gpudra_driver/profiles" /
                          f"{PROFILE}.yaml").read_text())
    doc["gpus"][0]["fail"] = {"nvmlGpuInstanceCreateComputeInstance": "Unknown"}
    profile = tmp_path / "failing.yaml"
    profile.write_text(yaml.safe_dump(doc))
    state = make(tmp_path, profile=str(profile))
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-2g20gb-at2"))))
    assert "creating the MIG instance 2g.20gb at memory slice 2" in (out[A].error or "")
    assert instances(tmp_path) == []  # the GPU instance made before the failure was destroyed again
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {} and not state.cdi.exists(A)


async def test_shared_placements_are_refused_with_the_reason(tmp_path: Path) -> None:
    state = make(tmp_path)  # the whole GPU's refusals: test_mig_whole_gpu.py
    shared = claim(B, "b", "gpu-0-mig-1g10gb-at0")
    shared["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "requests": ["mig"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
                                         "sharing": {"strategy": "MPS"}}}}]
    out = await state.prepare(items((REF_B, shared)))
    assert "is a dynamic MIG placement: sharing it (MPS) is not supported yet" in (out[B].error or ""), out[B].error
    assert instances(tmp_path) == []


@pytest.mark.parametrize("point", [p for p in POINTS if not p.startswith("unprepare") and p != "after-mig-mode-off"])
async def test_a_crash_anywhere_in_prepare_leaves_no_unrecorded_instance(tmp_path: Path, point: str) -> None:
    state = make(tmp_path, CrashAt())
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at0")))))[A].error is None
    state.fault.arm(point)
    with pytest.raises(Crash):
        await state.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-2g20gb-at4"))))
    restarted = make(tmp_path)  # start-up reconciliation
    claims = ckpt.load(restarted.checkpoint_path, "boot-1")[0].claims
    committed = point == "after-checkpoint-completed"
    assert set(claims) == ({A, B} if committed else {A})
    assert instances(tmp_path) == ([(1, 0), (5, 0)] if committed else [(1, 0)])  # A's kept, B's iff recorded done
    assert restarted.cdi.claim_uids() == set(claims)
    assert sorted(os.listdir(tmp_path / "plugin")) == ["checkpoint.json", "serialize.lock"]
    assert {name.partition("_")[0] for name in os.listdir(metadata_dir(tmp_path / "cdi", DRIVER))} == set(claims)  # B's files iff committed
    out = await restarted.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-2g20gb-at4"))))
    assert out[B].error is None and instances(tmp_path) == [(1, 0), (5, 0)]
    assert await restarted.unprepare([REF_A, REF_B]) == {A: None, B: None} and instances(tmp_path) == []


async def test_a_live_peer_rolls_back_a_crashed_peers_half_made_instance(tmp_path: Path) -> None:
    crashed = make(tmp_path, CrashAt("after-mig-instance"))
    peer = make(tmp_path)  # a rolling update: two instances on one node
    with pytest.raises(Crash):
        await crashed.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-7g80gb-at0"))))
    assert instances(tmp_path) == [(0, 0)]  # made, its IDs not recorded yet
    out = await peer.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-4g40gb-at0"))))
    assert out[B].error is None and instances(tmp_path) == [(1, 0)]  # the 7g rolled back, then the 4g made
    assert set(ckpt.load(peer.checkpoint_path, "boot-1")[0].claims) == {B}
