"""A GPU reset or a driver reload under prepared dynamic MIG claims (plugin/migrepair.py): every
instance of the GPU gone, MIG mode kept, the checkpoint naming instances that are not there. The
kubelet's repeated prepare and the agent's check make each claim's instance again at its recorded
placement and rewrite its CDI spec with the new UUID; unprepare destroys nothing that is not the
claim's; a crash between the record and the commit loses nothing. DeviceState on disk, the
simulated NVML's instances shared through its state directory as on a node (``reset_gpu`` does what
the mock ``nvidia-smi -r`` does)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
from pathlib import Path

import pytest
from cdispec import load_and_validate
from test_device_state import Crash, CrashAt, items
from test_mig_prepare import A, B, REF_A, REF_B, claim, instances, make, nvml

from gpudra_driver.nvml.fake import load_profile, mig_uuid
from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback
from gpudra_driver.migevents import Reporter
from gpudra_driver.plugin.migrepair import Outcome, awaiting_instance, lost_devices, message, remade
from gpudra_driver.plugin.model import ClaimRef, MigPlacement, PreparedClaim, PreparedDevice

GPU0 = load_profile("h100-dynamic-mig").gpus[0].uuid


def reset(tmp_path: Path) -> None:
    nvml(tmp_path).reset_gpu(GPU0)
    assert instances(tmp_path) == []


def foreign(tmp_path: Path, profile_id: int, start: int, size: int, ci_index: int) -> str:
    """An instance someone else makes through NVML (nvidia-smi mig -cgi ... -C): its MIG device's UUID."""
    n = nvml(tmp_path)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByUUID(GPU0)
    gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(n.c_nvmlGpuInstancePlacement_t(start, size)))
    info = n.nvmlGpuInstanceGetInfo(gi)
    ci_profile = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_index, 0).id
    ci = n.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
    uuid = mig_uuid(GPU0, info.id, n.nvmlComputeInstanceGetInfo(ci).id, 1)
    n.nvmlShutdown()
    return uuid


def metadata_uuid(state: object, uid: str) -> str:
    """The UUID the claim's device metadata file (request "mig") gives its one device."""
    path = state.cdi.metadata_root / f"{uid}_mig.json"  # type: ignore[attr-defined]
    (device,) = json.loads(path.read_text().splitlines()[0])["requests"][0]["devices"]
    return str(device["attributes"]["uuid"]["string"])


def spec_uuid(state: object, uid: str) -> str:
    spec = load_and_validate(state.cdi.spec_path(uid))  # type: ignore[attr-defined]
    (env,) = [e for e in spec["containerEdits"]["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    return env.split("=", 1)[1]


def recorded(state: object, uid: str) -> PreparedClaim:
    entry = ckpt.load(state.checkpoint_path, "boot-1")[0].claims[uid]  # type: ignore[attr-defined]
    assert entry.state == ckpt.COMPLETED
    return entry.claim


# -- the pure decisions ----------------------------------------------------------------------------

def _device(name: str, gi: int | None = 2) -> PreparedDevice:
    return PreparedDevice(("mig",), "node", name, f"MIG-{name}", ("/dev/nvidia0",), f"k8s/claim={name}",
                          mig=MigPlacement(GPU0, "3g.40gb", 4, 4, 0, gi, None if gi is None else 0))


def test_the_lost_devices_the_record_before_nvml_and_the_claim_made_again() -> None:
    whole = PreparedDevice(("gpu",), "node", "gpu-1", "GPU-1", ("/dev/nvidia1",), "k8s/claim=gpu-1")
    claim = PreparedClaim(ClaimRef("ns", "c", A), (_device("p1"), _device("p2"), whole))
    assert lost_devices(claim, {"p1": "missing", "p2": "present"}) == (["p1"], [])
    assert lost_devices(claim, {"p1": "foreign", "p2": "missing"}) == (["p2"], ["p1"])
    assert lost_devices(claim, {"p1": "present", "p2": "present"}) == ([], [])
    # before NVML: the lost device's IDs cleared (found by its place), all else as it was
    record = awaiting_instance(claim, ["p1"])
    assert record.devices[0].mig == dataclasses.replace(claim.devices[0].mig, gi=None, ci=None)  # type: ignore[arg-type]
    assert record.devices[1:] == claim.devices[1:] and record.devices[0].uuid == "MIG-p1"
    made = (dataclasses.replace(claim.devices[0].mig, gi=2, ci=0), "MIG-new", ("/dev/nvidia0", "/dev/x"))  # type: ignore[arg-type]
    fixed = remade(record, {"p1": made})
    assert (fixed.devices[0].uuid, fixed.devices[0].device_nodes, fixed.devices[0].mig) == ("MIG-new", made[2], made[0])
    assert fixed.devices[1:] == claim.devices[1:]
    text = message(Outcome(fixed, ("p1",)))
    assert text.startswith(f"ResourceClaim ns/c: the MIG instance of p1 (3g.40gb at memory slice 4 of GPU {GPU0}) "
                           "is gone (a GPU reset or an NVIDIA driver reload destroys every MIG instance")
    assert "made again at its placement as MIG-new" in text and "restart them" in text
    assert message(Outcome(claim, ("p1",), error="NotSupported")).endswith("could not be made again: NotSupported")


# -- on disk, against the simulated NVML -----------------------------------------------------------

async def test_the_kubelets_repeated_prepare_makes_the_instance_again_with_a_new_uuid(tmp_path: Path) -> None:
    state = make(tmp_path)
    first = (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A]
    assert first.error is None and instances(tmp_path) == [(2, 0)]
    old = first.claim.devices[0]  # type: ignore[union-attr]
    reset(tmp_path)

    again = (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A]
    assert again.error is None, again.error
    (device,) = again.claim.devices  # type: ignore[union-attr]
    assert instances(tmp_path) == [(2, 0)]  # back at its placement: memory slices 4-7
    assert device.mig == old.mig and device.uuid == mig_uuid(GPU0, 2, 0, 1) != old.uuid
    assert device.device_nodes == ("/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{mig_cap_minor_fallback(0, 2, None)}",
                                   f"/dev/nvidia-caps/nvidia-cap{mig_cap_minor_fallback(0, 2, 0)}")
    assert spec_uuid(state, A) == device.uuid and recorded(state, A) == again.claim
    assert metadata_uuid(state, A) == device.uuid  # its device metadata names the new instance too
    # idempotent: the instance is there now
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A] == again
    assert instances(tmp_path) == [(2, 0)]
    (found,) = await state.check_mig_instances()  # the prepare's finding, for the agent's Events
    assert found.lost == ("gpu-0-mig-3g40gb-at4",) and found.error is None
    assert await state.check_mig_instances() == []
    assert await state.unprepare([REF_A]) == {A: None} and instances(tmp_path) == []


async def test_the_agents_check_makes_every_lost_instance_again(tmp_path: Path) -> None:
    state = make(tmp_path)
    out = await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")),
                                    (REF_B, claim(B, "b", "gpu-0-mig-1g10gb-at0"))))
    assert out[A].error is None and out[B].error is None
    assert await state.check_mig_instances() == []  # all there: nothing said, nothing written
    reset(tmp_path)
    found = sorted(await state.check_mig_instances(), key=lambda o: o.claim.ref.name)
    assert [(o.claim.uid, o.lost, o.error) for o in found] == [
        (A, ("gpu-0-mig-3g40gb-at4",), None), (B, ("gpu-0-mig-1g10gb-at0",), None)]
    assert instances(tmp_path) == [(2, 0), (7, 0)]
    assert spec_uuid(state, A) == mig_uuid(GPU0, 2, 0, 1) and spec_uuid(state, B) == mig_uuid(GPU0, 7, 0, 1)
    assert recorded(state, B).devices[0].uuid == mig_uuid(GPU0, 7, 0, 1)
    assert await state.check_mig_instances() == []


async def test_unprepare_after_a_reset_destroys_nothing_that_is_not_the_claims(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A].error is None
    reset(tmp_path)
    # someone else fills the GPU after the reset: the same profile at the same place (NVML gives it
    # the claim's old GPU instance ID), and another elsewhere
    same_place = foreign(tmp_path, 9, 4, 4, 2)
    elsewhere = foreign(tmp_path, 14, 0, 2, 1)
    assert instances(tmp_path) == [(2, 0), (3, 0)]
    assert same_place != recorded(state, A).devices[0].uuid

    (found,) = await state.check_mig_instances()  # not taken over, not made: said why
    assert found.lost == ("gpu-0-mig-3g40gb-at4",) and "an instance someone else made holds its placement" in (found.error or "")
    again = (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A]
    assert "could not be made again: an instance someone else made" in (again.error or ""), again.error
    assert await state.unprepare([REF_A]) == {A: None}
    assert instances(tmp_path) == [(2, 0), (3, 0)] and not state.cdi.exists(A)
    assert set(mig_uuids(tmp_path)) == {same_place, elsewhere}


def mig_uuids(tmp_path: Path) -> list[str]:
    """The UUIDs of GPU 0's MIG devices, as NVML lists them now."""
    n = nvml(tmp_path)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByUUID(GPU0)
    out = []
    for slot in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out.append(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)))
        except n.NVMLError:
            continue
    n.nvmlShutdown()
    return out


async def test_an_instance_nvml_refuses_to_make_again_leaves_the_claim_as_it_was(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A].error is None
    before = recorded(state, A)
    reset(tmp_path)
    foreign(tmp_path, 14, 4, 2, 1)  # overlaps the claim's slices 4-7 with another profile
    (found,) = await state.check_mig_instances()
    assert "InsufficientResources" in (found.error or "") and "could not be made again" in message(found)
    assert recorded(state, A) == before and instances(tmp_path) == [(5, 0)]
    assert await state.unprepare([REF_A]) == {A: None} and instances(tmp_path) == [(5, 0)]  # not the claim's


async def test_a_crash_between_the_record_and_the_commit_loses_nothing(tmp_path: Path) -> None:
    state = make(tmp_path, CrashAt())
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A].error is None
    reset(tmp_path)
    state.fault.arm("after-mig-instance")  # type: ignore[attr-defined]
    with pytest.raises(Crash):
        await state.check_mig_instances()
    record = recorded(state, A)  # still prepared: its IDs cleared, the instance made but not recorded
    assert record.devices[0].mig is not None and record.devices[0].mig.gi is None
    assert instances(tmp_path) == [(2, 0)]

    restarted = make(tmp_path)  # start-up keeps the completed claim and its spec
    assert restarted.cdi.exists(A)
    (found,) = await restarted.check_mig_instances()  # takes over the instance the crash left
    assert found.error is None and instances(tmp_path) == [(2, 0)]
    assert recorded(restarted, A).devices[0].mig.gi == 2  # type: ignore[union-attr]
    assert spec_uuid(restarted, A) == mig_uuid(GPU0, 2, 0, 1)


async def test_unprepare_of_a_claim_whose_instance_was_being_made_again_destroys_it(tmp_path: Path) -> None:
    state = make(tmp_path, CrashAt())
    assert (await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4")))))[A].error is None
    reset(tmp_path)
    state.fault.arm("after-mig-instance")  # type: ignore[attr-defined]
    with pytest.raises(Crash):
        await state.prepare(items((REF_A, claim(A, "a", "gpu-0-mig-3g40gb-at4"))))
    restarted = make(tmp_path)
    assert await restarted.unprepare([REF_A]) == {A: None}
    assert instances(tmp_path) == [] and not restarted.cdi.exists(A)


async def test_each_finding_is_said_once_on_the_node_and_the_claims_pods() -> None:
    posted: list[tuple[str, ...]] = []

    async def post(kind: str, reason: str, text: str) -> None:
        posted.append(("node", kind, reason, text))

    async def post_on_pod(ns: str, name: str, uid: str, kind: str, reason: str, text: str) -> None:
        posted.append((f"pod {ns}/{name} {uid}", kind, reason, text))

    async def get_claim(ns: str, name: str) -> dict[str, object]:
        return {"metadata": {"uid": A}, "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}]}}

    report = Reporter(post, get_claim, post_on_pod)
    claim = PreparedClaim(ClaimRef("ns", "c", A), (_device("p1"),))
    refused = Outcome(claim, ("p1",), error="an instance someone else made holds its placement now")
    await report([refused])
    await report([refused])  # found again at the next check, or by a retried prepare: said once
    assert [p[:3] for p in posted] == [("node", "Warning", "MigInstanceLost"), ("pod ns/p u1", "Warning", "MigInstanceLost")]
    await report([Outcome(claim, ("p1",))])  # made again since: said
    assert len(posted) == 4 and "made again at its placement as MIG-p1" in posted[-1][3]
