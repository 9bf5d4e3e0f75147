"""plan_prepare: every check a claim must pass before anything is written, and idempotency."""

from __future__ import annotations

import pytest
from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PreparedClaim, PreparedDevice
from gpudra_driver.plugin.prepare import plan_prepare

UID = "0c1d2e3f-0000-4000-8000-000000000001"
OTHER = "9f9f9f9f-0000-4000-8000-000000000002"
REF = ClaimRef("ns", "c1", UID)
EMPTY = Checkpoint("boot-1")


def plan(obj, *, ref: ClaimRef = REF, devs=None, checkpoint: Checkpoint = EMPTY, node: str = NODE):
    return plan_prepare(ref, obj, devices() if devs is None else devs, checkpoint, node=node, driver=DRIVER)


def test_allocated_gpu_is_planned_with_its_device_node_uuid_and_cdi_id() -> None:
    p = plan(claim())
    assert not p.done
    (device,) = p.claim.devices
    gpu3 = devices()["gpu-3"]
    assert device == PreparedDevice(("gpu",), NODE, "gpu-3", gpu3.uuid, ("/dev/nvidia3",),
                                    f"k8s.{DRIVER}/claim={UID}-gpu-3")


def test_subrequest_names_are_stripped_and_requests_merged_per_device() -> None:
    p = plan(claim(results=[result("gpu-1", request="big/h100"), result("gpu-2", request="small")]))
    assert [(d.device, d.requests) for d in p.claim.devices] == [("gpu-1", ("big",)), ("gpu-2", ("small",))]


def test_results_of_other_drivers_are_ignored() -> None:
    p = plan(claim(results=[result("nic-0", driver="net.example.com", pool="other"), result("gpu-1")]))
    assert [d.device for d in p.claim.devices] == ["gpu-1"]


@pytest.mark.parametrize(("obj", "message"), [
    (None, "not found"),
    (claim(uid=OTHER), "the claim was replaced"),
    (claim(allocated=False), "not allocated"),
    (claim(results=[result("gpu-3", pool="node-b")]), "pool 'node-b', not this node's pool 'node-a'"),
    (claim(results=[result("gpu-99")]), "device 'gpu-99' is not a device of node node-a"),
    (claim(results=[result("gpu-1", driver="other.example.com")]), "no device of driver gpu.gpudra.io"),
    (claim(node_selector_node="node-b"), "allocated to node ['node-b'], not node-a"),
])
def test_bad_claims_are_refused_with_a_reason(obj, message: str) -> None:
    with pytest.raises(ClaimError, match=".*") as info:
        plan(obj)
    assert message in str(info.value)
    assert "ns/c1" in str(info.value)  # the error names the claim


@pytest.mark.parametrize("ref", [
    ClaimRef("ns", "c1", ""),
    ClaimRef("ns", "c1", "../../etc/passwd"),
    ClaimRef("ns", "c1", "a/b"),
    ClaimRef("../kube-system", "c1", UID),
    ClaimRef("ns", "c1/../../x", UID),
    ClaimRef("", "c1", UID),
    ClaimRef("ns", "c1", UID + "\n"),  # "$" alone would match before the newline
    ClaimRef("ns\n", "c1", UID),
    ClaimRef("ns", "c1\n", UID),
])
def test_names_with_path_characters_are_malformed(ref: ClaimRef) -> None:
    with pytest.raises(ClaimError, match="malformed claim"):
        plan(claim(), ref=ref)


def test_a_failed_get_is_the_claims_error() -> None:
    with pytest.raises(ClaimError, match="API down"):
        plan(ClaimError("API down"))


def test_devices_not_yet_discovered_is_a_retryable_error() -> None:
    with pytest.raises(ClaimError, match="not discovered yet; retry"):
        plan_prepare(REF, claim(), None, EMPTY, node=NODE, driver=DRIVER)


def test_a_device_prepared_for_another_claim_is_refused() -> None:
    other = plan(claim(uid=OTHER, name="c2"), ref=ClaimRef("ns", "c2", OTHER)).claim
    for checkpoint in (EMPTY.started(other), EMPTY.started(other).completed(OTHER)):
        with pytest.raises(ClaimError, match=f"gpu-3 is already prepared for claim {OTHER}"):
            plan(claim(), checkpoint=checkpoint)


def test_admin_access_does_not_need_exclusive_use() -> None:
    other = plan(claim(uid=OTHER, name="c2"), ref=ClaimRef("ns", "c2", OTHER)).claim
    p = plan(claim(results=[result("gpu-3", adminAccess=True)]), checkpoint=EMPTY.started(other).completed(OTHER))
    assert [d.device for d in p.claim.devices] == ["gpu-3"]


def test_a_device_held_with_admin_access_only_does_not_block_a_normal_claim() -> None:
    """A monitoring claim (adminAccess) on every GPU must not make the GPUs unpreparable: the
    scheduler allocates them to normal claims too."""
    monitor = plan(claim(uid=OTHER, name="c2", results=[result("gpu-3", adminAccess=True)]),
                   ref=ClaimRef("ns", "c2", OTHER)).claim
    assert [d.admin_access for d in monitor.devices] == [True]
    p = plan(claim(), checkpoint=EMPTY.started(monitor).completed(OTHER))
    assert [(d.device, d.admin_access) for d in p.claim.devices] == [("gpu-3", False)]
    assert PreparedDevice.from_json(monitor.devices[0].to_json()) == monitor.devices[0]
    assert "adminAccess" not in p.claim.devices[0].to_json()  # entries as before: same checksums


def test_a_completed_claim_allocated_anew_to_another_device_is_prepared_again() -> None:
    prepared = plan(claim()).claim  # gpu-3
    checkpoint = EMPTY.started(prepared).completed(UID)
    again = plan(claim(results=[result("gpu-4")]), checkpoint=checkpoint)
    assert not again.done and [d.device for d in again.claim.devices] == ["gpu-4"]
    assert plan(claim(), checkpoint=checkpoint).done  # the same allocation: answered again


def test_a_completed_claim_is_answered_again_whatever_the_api_says() -> None:
    prepared = plan(claim()).claim
    checkpoint = EMPTY.started(prepared).completed(UID)
    for obj in (claim(), None, ClaimError("API down")):
        again = plan(obj, checkpoint=checkpoint, devs={})  # even with the device gone from discovery
        assert again.done and again.claim == prepared


def test_a_started_claim_is_planned_again() -> None:
    prepared = plan(claim()).claim
    again = plan(claim(), checkpoint=EMPTY.started(prepared))
    assert not again.done and again.claim == prepared


def test_mig_devices_get_the_parent_node_and_both_capability_nodes() -> None:
    mig = devices("a100-80gb-mig")
    p = plan(claim(results=[result("gpu-0-mig-3g40gb-2-0")]), devs=mig)
    (device,) = p.claim.devices
    assert device.device_nodes == ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22")
    assert device.uuid.startswith("MIG-")


def test_prepared_claim_round_trips_through_json() -> None:
    prepared = plan(claim(results=[result("gpu-1"), result("gpu-2", request="b")])).claim
    assert PreparedClaim.from_json(UID, prepared.to_json()) == prepared


def shared(uid: str, name: str, device: str = "gpu-3", memory: str = "10Gi", share: str | None = None):  # type: ignore[no-untyped-def]
    """A claim allocated a share of ``device`` (consumable capacity, KEP-5075)."""
    return claim(uid=uid, name=name, results=[result(device, shareID=share or f"{uid[:8]}-share",
                                                     consumedCapacity={"memory": memory})])


def holding(*claims: tuple[str, str, dict]) -> Checkpoint:  # type: ignore[type-arg]
    checkpoint = EMPTY
    for uid, name, obj in claims:
        checkpoint = checkpoint.started(plan(obj, ref=ClaimRef("ns", name, uid)).claim).completed(uid)
    return checkpoint


def test_shares_of_one_device_are_prepared_side_by_side_with_their_share_ids() -> None:
    third = "7e7e7e7e-0000-4000-8000-000000000003"
    checkpoint = holding((OTHER, "c2", shared(OTHER, "c2", memory="40Gi")))
    p = plan(shared(UID, "c1", memory="20Gi", share="share-1"), checkpoint=checkpoint)
    (device,) = p.claim.devices
    assert (device.device, device.share_id, device.consumed_memory) == ("gpu-3", "share-1", 20 * 2**30)
    assert PreparedDevice.from_json(device.to_json()) == device
    both = checkpoint.started(p.claim).completed(UID)
    assert sorted(uid for uid, _ in both.device_holders(NODE, "gpu-3")) == sorted([UID, OTHER])
    # the checkpoint that holds shares is version 3: an older agent would drop them
    import json

    from gpudra_driver.plugin.checkpoint import decode, encode
    assert json.loads(encode(both))["version"] == 3 and decode(encode(both)) == both
    # an H100 of 81559Mi: 40 + 20 Gi held, 30 more would over-commit it, 19 fit
    with pytest.raises(ClaimError, match=r"gpu-3 would be over-committed: 30Gi of memory asked, 60Gi of 81559Mi"):
        plan(shared(third, "c3", memory="30Gi"), ref=ClaimRef("ns", "c3", third), checkpoint=both)
    assert plan(shared(third, "c3", memory="19Gi"), ref=ClaimRef("ns", "c3", third), checkpoint=both).claim


def test_a_share_of_a_device_held_whole_and_a_whole_device_held_in_shares_are_refused() -> None:
    whole = holding((OTHER, "c2", claim(uid=OTHER, name="c2")))
    with pytest.raises(ClaimError, match=f"already prepared for claim {OTHER} without a share"):
        plan(shared(UID, "c1"), checkpoint=whole)
    in_shares = holding((OTHER, "c2", shared(OTHER, "c2")))
    with pytest.raises(ClaimError, match=f"already prepared for claim {OTHER}; a device is shared between "
                                         "claims only as consumable capacity"):
        plan(claim(), checkpoint=in_shares)


def test_a_malformed_consumed_capacity_is_the_claims_error() -> None:
    with pytest.raises(ClaimError, match="consumedCapacity memory"):
        plan(claim(results=[result("gpu-3", shareID="s", consumedCapacity={"memory": "lots"})]))
