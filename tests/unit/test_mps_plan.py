"""MPS: planning a claim's sharing (limits, refusals naming the field), the daemon it asks for, and
the files and edits derived from it. All pure; the daemons themselves run in the integration tests
(tests/integration/test_mps.py) against the mock nvidia-cuda-mps-control."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver.plugin.sharing import plan as gpusettings

from gpudra_driver.plugin.sharing.mps import plan as mps
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import MPS, ClaimError, ClaimRef
from gpudra_driver.plugin.plan import plan_prepare

UID = "0c1d2e3f-0000-4000-8000-0000000000aa"
REF = ClaimRef("ns", "c1", UID)
GIB = 2**30


def with_mps(obj: dict[str, Any], **settings: Any) -> dict[str, Any]:
    obj["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
                                         "sharing": {"strategy": "MPS", "mps": settings}}}}]
    return obj


def plan(obj: dict[str, Any], node_devices: Any = None) -> Any:
    return plan_prepare(REF, obj, node_devices or devices(), Checkpoint("boot"), node=NODE, driver=DRIVER).claim


def test_limits_per_device_become_one_daemon_for_the_claims_gpus() -> None:
    prepared = plan(with_mps(claim(UID, results=[result("gpu-1"), result("gpu-3")]), activeThreadPercentage=40,
                             pinnedMemoryLimit="8Gi", perDevice={"gpu-3": {"pinnedMemoryLimit": "16Gi"}}))
    uuids = {d.device: d.uuid for d in prepared.devices}
    spec = mps.daemon_for(prepared)
    assert spec == mps.DaemonSpec(UID, (uuids["gpu-1"], uuids["gpu-3"]), 40,
                                  tuple(sorted([(uuids["gpu-1"], 8192), (uuids["gpu-3"], 16384)])))
    assert spec.commands()[0] == "set_default_active_thread_percentage 40"
    assert mps.DaemonSpec.from_json(__import__("json").loads(spec.encode())) == spec
    # whole GPUs: EXCLUSIVE_PROCESS while the claim holds them
    assert {gpusettings.device_settings(d) for d in prepared.devices} == {gpusettings.GpuSettings(3, 0)}


def test_a_share_of_a_gpu_is_limited_to_what_it_was_granted_and_keeps_the_gpu_default() -> None:
    gpu = devices()["gpu-2"]
    obj = with_mps(claim(UID, results=[result("gpu-2", shareID="s1", consumedCapacity={"memory": "20Gi"})]))
    [device] = plan(obj).devices
    assert device.sharing.pinned_memory_limit == 20 * GIB
    assert device.sharing.active_thread_percentage == -(-20 * GIB * 100 // gpu.memory)  # its part, rounded up
    assert gpusettings.device_settings(device) is None  # other claims' servers share the GPU
    # a config asking for less than the grant keeps its own; more is capped to the grant
    less = with_mps(claim(UID, results=[result("gpu-2", shareID="s1", consumedCapacity={"memory": "20Gi"})]),
                    pinnedMemoryLimit="4Gi", activeThreadPercentage=100)
    [device] = plan(less).devices
    assert (device.sharing.pinned_memory_limit, device.sharing.active_thread_percentage) == (
        4 * GIB, mps.share_limits(20 * GIB, gpu.memory)[1])


@pytest.mark.parametrize(("settings", "message"), [
    ({"pinnedMemoryLimit": "1Ti"}, "sharing.mps.pinnedMemoryLimit: 1Ti is more than device gpu-0's memory"),
    ({"perDevice": {"gpu-0": {"pinnedMemoryLimit": "1Ti"}}},
     "sharing.mps.perDevice.gpu-0.pinnedMemoryLimit: 1Ti is more than"),
    ({"activeThreadPercentage": 0}, "sharing.mps.activeThreadPercentage: must be an integer between 1 and 100"),
    ({"perDevice": {"gpu-7": {"activeThreadPercentage": 10}}}, "sharing.mps.perDevice.gpu-7: names no device"),
])
def test_bad_mps_settings_name_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=message.replace(".", r"\.")):
        plan(with_mps(claim(UID, results=[result("gpu-0")]), **settings))


def test_one_daemon_has_one_thread_percentage() -> None:
    obj = with_mps(claim(UID, results=[result("gpu-0"), result("gpu-1")]),
                   perDevice={"gpu-0": {"activeThreadPercentage": 10}, "gpu-1": {"activeThreadPercentage": 20}})
    with pytest.raises(ClaimError, match="activeThreadPercentage differs between devices .gpu-0: 10, gpu-1: 20."):
        plan(obj)


def test_a_gpu_older_than_volta_is_refused() -> None:
    old = {name: dataclasses.replace(d, compute_capability="6.0.0") for name, d in devices().items()}
    with pytest.raises(ClaimError, match="needs compute capability 7.0 .Volta. or newer; device gpu-0 has 6.0.0"):
        plan(with_mps(claim(UID, results=[result("gpu-0")])), old)


def test_the_checkpoint_names_the_daemons_and_a_claim_without_mps_asks_for_none() -> None:
    prepared = plan(with_mps(claim(UID, results=[result("gpu-0")])))
    plain = plan(claim(UID, results=[result("gpu-0")]))
    assert mps.daemon_for(plain) is None
    assert set(mps.wanted({UID: prepared})) == {UID} and mps.wanted({UID: plain}) == {}
    assert all(d.sharing.strategy == MPS for d in prepared.devices)


def test_a_claims_shm_size_goes_to_its_daemon_and_survives_the_checkpoint() -> None:
    from gpudra_driver.plugin.model import DeviceSharing

    prepared = plan(with_mps(claim(UID, results=[result("gpu-0"), result("gpu-1")]), shmSize="256Mi"))
    assert {d.sharing.shm_size for d in prepared.devices} == {256 * 2**20}
    spec = mps.daemon_for(prepared)
    assert spec is not None and spec.shm_size == 256 * 2**20
    sharing = prepared.devices[0].sharing
    assert DeviceSharing.from_json(sharing.to_json()) == sharing
    # a claim that does not ask leaves it to the platform, and its checkpoint entry as it was
    unsized = plan(with_mps(claim(UID, results=[result("gpu-0")])))
    assert mps.daemon_for(unsized).shm_size is None  # type: ignore[union-attr]
    assert "shmSize" not in unsized.devices[0].sharing.to_json()


def test_cdi_edits_point_the_clients_at_the_claims_pipe_and_shm() -> None:
    edits = mps.cdi_edits(Path("/var/lib/kubelet/plugins/gpu.gpudra.io/mps"), UID)
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
        (f"/var/lib/kubelet/plugins/gpu.gpudra.io/mps/{UID}/pipe", "/tmp/nvidia-mps"),
        (f"/var/lib/kubelet/plugins/gpu.gpudra.io/mps/{UID}/shm", "/dev/shm")]
    # /dev/shm as container runtimes mount it: nothing executed from it
    assert edits["mounts"][1]["options"] == ["rbind", "rw", "nosuid", "nodev", "noexec"]


@pytest.mark.parametrize("bad", [{"claimUID": UID, "gpus": []}, {"claimUID": UID, "gpus": ["GPU-1"],
                                 "activeThreadPercentage": 101, "pinnedMemoryMiB": {}},
                                 {"claimUID": UID, "gpus": ["GPU-1"], "pinnedMemoryMiB": {"GPU-2": 5}}])
def test_a_malformed_daemon_spec_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        mps.DaemonSpec.from_json(bad)


def test_daemons_are_counted_by_the_state_the_supervisor_last_reported() -> None:
    statuses = {"a": {"state": "Ready"}, "b": {"state": "Failed", "message": "no GPU"}, "c": None,
                "d": {"state": "Ready"}, "e": {"state": "Exploded"}}
    assert mps.daemons_by_state(statuses) == {"Ready": 2, "Starting": 2, "Failed": 1}
    assert mps.daemons_by_state({}) == {"Ready": 0, "Starting": 0, "Failed": 0}  # every state, so a gauge drops to 0


def test_restarts_since_counts_only_the_claims_whose_daemon_restarted() -> None:
    assert mps.restarts_since({"a": 3, "b": 1, "c": 2}, {"a": 1, "b": 1}) == {"a": 2, "c": 2}
    assert mps.restarts_since({"a": 1}, {"a": 4}) == {}  # a new daemon for the claim: its count started again
