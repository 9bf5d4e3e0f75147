"""Dynamic MIG's whole GPU (DeviceState on disk, the simulated NVML sharing its instances and MIG
mode through its state directory as on a node): discovery publishes it beside the placements
where MIG mode switches without a reset, and the same devices while a claim of it holds MIG mode
off; prepare records the intent, refuses a GPU with an instance or a switch that would only be
pending, turns MIG mode off and writes the whole GPU's spec; unprepare turns it on again before
the entry goes; a crash at every step leaves MIG mode on unless a completed record holds it off."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from cdispec import load_and_validate
from plugin_fixtures import DRIVER, driver_files
from test_device_state import Crash, CrashAt, items
from test_mig_prepare import PROFILE, A, B, REF_A, REF_B, claim, instances, make, nvml, rescan

from gpudra_core.migpartitions import partition_gpu
from gpudra_driver.discovery import read_mig_geometry, scan
from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.cdi import metadata_dir
from gpudra_driver.plugin.devicenodes import DYNAMIC_WHOLE_GPU, node_devices
from gpudra_driver.plugin.faults import POINTS
from gpudra_driver.plugin.miginstances import MigInstanceError

ON, OFF = 1, 0
UUID0 = "GPU-3f1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f60"


def mig_mode(tmp_path: Path, index: int = 0) -> tuple[int, int]:
    n = nvml(tmp_path)
    n.nvmlInit()
    try:
        return tuple(n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(index)))  # type: ignore[return-value]
    finally:
        n.nvmlShutdown()


def profile_with(tmp_path: Path, **gpu0: Any) -> str:
    """The shipped H100 profile with GPU 0 changed."""
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "driver/gpudra_driver/profiles" /
                          f"{PROFILE}.yaml").read_text())
    doc["gpus"][0].update(gpu0)
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# -- discovery --------------------------------------------------------------------------------------

def test_discovery_publishes_the_same_devices_while_a_claim_holds_mig_mode_off(tmp_path: Path) -> None:
    before = scan(nvml(tmp_path), mig="dynamic").devices
    assert before[0].name == "gpu-0" and before[0].type == "gpu" and before[0].consumes_counters
    assert sum(d.type == "gpu" for d in before) == 2 and len(before) == 2 * 26
    n = nvml(tmp_path)
    n.nvmlInit()
    geometry = read_mig_geometry(n, n.nvmlDeviceGetHandleByIndex(0))
    n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(0), OFF)
    n.nvmlShutdown()
    # not ours: a MIG-disabled GPU is a plain whole GPU, with the reason
    other = scan(nvml(tmp_path), mig="dynamic")
    assert [d.name for d in other.devices if d.attr("parentIndex") != 1][:1] == ["gpu-0"]
    assert not [d for d in other.devices if d.name == "gpu-0"][0].consumes_counters
    assert any("MIG mode is disabled" in w for w in other.warnings)
    # ours, from NVML's answers, or from the geometry recorded where NVML does not report it
    assert scan(nvml(tmp_path), mig="dynamic", mig_mode_off={UUID0: None}).devices == before
    silent = profile_with(tmp_path, fail={"nvmlDeviceGetGpuInstanceProfileInfo": "NotSupported"})
    failing = scan(nvml(tmp_path, silent), mig="dynamic", mig_mode_off={UUID0: geometry})
    assert failing.devices[:26] == before[:26] and failing.warnings == []
    unreadable = scan(nvml(tmp_path, silent), mig="dynamic", mig_mode_off={UUID0: None})
    assert not [d for d in unreadable.devices if d.attr("parentIndex") == 0 or d.name == "gpu-0"]
    assert any("MIG mode is off for a claim of the whole GPU" in w for w in unreadable.warnings)
    # mode "static" too: a claim's whole GPU stays as it was allocated
    assert scan(nvml(tmp_path), mig="static", mig_mode_off={UUID0: geometry}).devices[:26] == before[:26]


def test_an_ampere_gpu_offers_no_whole_gpu(tmp_path: Path) -> None:
    found = scan(nvml(tmp_path, profile_with(tmp_path, architecture="AMPERE")), mig="dynamic")
    assert found.warnings == []
    assert [d.name for d in found.devices if d.type == "gpu"] == ["gpu-1"]  # the Hopper one only
    assert len(found.devices) == 25 + 26


# -- prepare and unprepare --------------------------------------------------------------------------

async def test_prepare_turns_mig_mode_off_and_unprepare_on_again(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert state.devices is not None and state.devices["gpu-0"].kind == DYNAMIC_WHOLE_GPU
    published = scan(nvml(tmp_path), mig="dynamic").devices
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert out[A].error is None, out[A].error
    assert mig_mode(tmp_path) == (OFF, OFF) and mig_mode(tmp_path, 1) == (ON, ON)
    (device,) = out[A].claim.devices
    assert device.uuid == UUID0 and device.device_nodes == ("/dev/nvidia0",) and device.mig is None
    spec = load_and_validate(state.cdi.spec_path(A))
    root = driver_files(PROFILE).root.host
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0",
                                                                    "hostPath": f"{root}/dev/nvidia0"}]
    assert f"NVIDIA_VISIBLE_DEVICES={UUID0}" in spec["containerEdits"]["env"]
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0].claims[A]
    assert saved.state == ckpt.COMPLETED and saved.claim.devices[0].mig_mode_off is not None
    assert saved.claim.devices[0].mig_mode_off.geometry  # the geometry, read while MIG mode was on
    assert '"version":5' in state.checkpoint_path.read_text()  # 4 for MIG mode off, 5 for device metadata
    # the rescan, MIG mode off: the same devices and counters, so the slice does not change under it
    rescan_devices = scan(nvml(tmp_path), mig="dynamic", owned=state.owned_mig_instances(),
                          mig_mode_off=state.mig_mode_off_gpus())
    assert rescan_devices.devices == published and rescan_devices.warnings == []
    again = await state.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert again[A] == out[A]  # idempotent
    assert await state.unprepare([REF_A]) == {A: None}
    assert mig_mode(tmp_path) == (ON, ON) and not state.cdi.exists(A) and state.mig_mode_off_gpus() == {}
    assert await state.unprepare([REF_A]) == {A: None}
    rescan(state, tmp_path)  # and placements are made again
    assert (await state.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-7g80gb-at0")))))[B].error is None


async def test_a_gpu_with_an_instance_is_refused_and_keeps_mig_mode_on(tmp_path: Path) -> None:
    state = make(tmp_path)
    # a stale allocation: the scheduler never gives both, NVML's state is the last word
    assert (await state.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-1g10gb-at3")))))[B].error is None
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert "GPU " + UUID0 + " has 1 MIG GPU instance(s)" in (out[A].error or ""), out[A].error
    assert mig_mode(tmp_path) == (ON, ON) and instances(tmp_path) == [(10, 0)]
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {B} and not state.cdi.exists(A)


async def test_a_switch_that_would_only_be_pending_is_taken_back_and_refused(tmp_path: Path) -> None:
    ampere = profile_with(tmp_path, architecture="AMPERE")
    state = make(tmp_path, profile=ampere)
    # as if published whole (it is not, on Ampere): the GPU answers as an A100 does
    state.set_devices(node_devices(partition_gpu(scan(nvml(tmp_path), mig="dynamic").devices[0],
                                                 _geometry(tmp_path), whole=True)))
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert "turning MIG mode off would only be pending until a GPU reset (activation status RESET_REQUIRED" in (
        out[A].error or ""), out[A].error
    assert mig_mode(tmp_path) == (ON, ON)  # no change left pending
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {} and not state.cdi.exists(A)


def _geometry(tmp_path: Path) -> Any:
    n = nvml(tmp_path)
    n.nvmlInit()
    try:
        return read_mig_geometry(n, n.nvmlDeviceGetHandleByIndex(0))
    finally:
        n.nvmlShutdown()


async def test_unprepare_keeps_the_claim_while_mig_mode_cannot_go_back_on(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state = make(tmp_path)
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0")))))[A].error is None
    assert state.mig.switch is not None
    turn_on = state.mig.switch.turn_on

    def busy(uuid: str) -> None:
        raise MigInstanceError(f"GPU {uuid}: MIG mode is not on again yet (activation status IN_USE)")

    monkeypatch.setattr(state.mig.switch, "turn_on", busy)
    failed = await state.unprepare([REF_A])
    assert "MIG mode is not on again yet" in (failed[A] or "")
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {A} and state.cdi.exists(A)
    monkeypatch.setattr(state.mig.switch, "turn_on", turn_on)
    assert await state.unprepare([REF_A]) == {A: None} and mig_mode(tmp_path) == (ON, ON)


# -- crashes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("point", [p for p in POINTS if not p.startswith("unprepare") and p != "after-mig-instance"])
async def test_a_crash_anywhere_in_prepare_leaves_mig_mode_on_unless_recorded_off(tmp_path: Path, point: str) -> None:
    state = make(tmp_path, CrashAt())
    assert (await state.prepare(items((REF_B, claim(B, "b", "gpu-1-mig-3g40gb-at0")))))[B].error is None
    state.fault.arm(point)
    with pytest.raises(Crash):
        await state.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    if point in ("after-mig-mode-off", "after-cdi-write"):
        assert mig_mode(tmp_path) == (OFF, OFF)  # off, and a PrepareStarted record says so
    restarted = make(tmp_path)  # start-up reconciliation, then a rescan as the agent's
    claims = ckpt.load(restarted.checkpoint_path, "boot-1")[0].claims
    committed = point == "after-checkpoint-completed"
    assert set(claims) == ({A, B} if committed else {B})
    assert mig_mode(tmp_path) == ((OFF, OFF) if committed else (ON, ON))
    assert restarted.cdi.claim_uids() == set(claims) and mig_mode(tmp_path, 1) == (ON, ON)
    assert sorted(os.listdir(tmp_path / "plugin")) == ["checkpoint.json", "serialize.lock"]
    assert {name.partition("_")[0] for name in os.listdir(metadata_dir(tmp_path / "cdi", DRIVER))} == set(claims)
    out = await restarted.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert out[A].error is None and mig_mode(tmp_path) == (OFF, OFF)
    assert await restarted.unprepare([REF_A, REF_B]) == {A: None, B: None}
    assert mig_mode(tmp_path) == (ON, ON) and instances(tmp_path) == []


async def test_a_crash_in_unprepare_leaves_mig_mode_on(tmp_path: Path) -> None:
    state = make(tmp_path, CrashAt())
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0")))))[A].error is None
    state.fault.arm("unprepare-after-checkpoint")
    with pytest.raises(Crash):
        await state.unprepare([REF_A])
    assert mig_mode(tmp_path) == (ON, ON)  # on again before the entry went
    restarted = make(tmp_path)
    assert ckpt.load(restarted.checkpoint_path, "boot-1")[0].claims == {} and restarted.cdi.claim_uids() == set()


async def test_a_live_peer_turns_mig_mode_back_on_for_a_crashed_peers_prepare(tmp_path: Path) -> None:
    crashed = make(tmp_path, CrashAt("after-mig-mode-off"))
    peer = make(tmp_path)  # a rolling update: two instances on one node
    with pytest.raises(Crash):
        await crashed.prepare(items((REF_A, claim(A, "a", "gpu-0"))))
    assert mig_mode(tmp_path) == (OFF, OFF)
    rescan(peer, tmp_path)  # the half-done record keeps the GPU published as before
    out = await peer.prepare(items((REF_B, claim(B, "b", "gpu-0-mig-4g40gb-at0"))))
    assert out[B].error is None and mig_mode(tmp_path) == (ON, ON) and instances(tmp_path) == [(1, 0)]
    assert set(ckpt.load(peer.checkpoint_path, "boot-1")[0].claims) == {B}
