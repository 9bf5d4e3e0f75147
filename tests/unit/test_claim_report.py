"""What the agent reports of a prepared claim: status.devices entries and the per-pod info series."""

from __future__ import annotations

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_driver.plugin.claimreport import (INFO_LABELS, MAX_CONSUMERS, allocation_refused, carries_exactly,
                                              consumer_pods, device_status_entries, entries_of, info_series,
                                              live_entries, locate, same_entries, status_apply, status_merge_patch)
from gpudra_driver import metrics
from gpudra_driver.plugin.claimreporter import MAX_DEFER, QUIET, ClaimReporter, write_delay
from gpudra_driver.plugin.model import ClaimRef, DeviceSharing, MigPlacement, PreparedClaim, PreparedDevice

REF = ClaimRef("ml", "train", "3f1c4a52-6f5e-4f52-9d0a-1d2b3c4d5e6f")
GPU = Device("gpu-1", {"type": AttrValue.of_string("gpu"), "uuid": AttrValue.of_string("GPU-1111"),
                       "productName": AttrValue.of_string("NVIDIA H100 80GB HBM3"),
                       "index": AttrValue("int", 1), "minor": AttrValue("int", 1),
                       "resource.kubernetes.io/pciBusID": AttrValue.of_string("0000:1b:00.0")})
STATIC_MIG = Device("gpu-0-mig-1g10gb-9-0", {
    "type": AttrValue.of_string("mig"), "uuid": AttrValue.of_string("MIG-aaaa"),
    "parentUUID": AttrValue.of_string("GPU-0000"), "profile": AttrValue.of_string("1g.10gb"),
    "gpuInstanceId": AttrValue("int", 9), "computeInstanceId": AttrValue("int", 0)})
PUBLISHED = {d.name: d for d in (GPU, STATIC_MIG)}


def prepared(*devices: PreparedDevice) -> PreparedClaim:
    return PreparedClaim(REF, devices)


def gpu(name: str = "gpu-1", uuid: str = "GPU-1111", **kwargs) -> PreparedDevice:
    return PreparedDevice(("train",), "node-a", name, uuid, ("/dev/nvidia1",), f"k8s.gpu.gpudra.io/claim={REF.uid}-{name}",
                          **kwargs)


def test_a_whole_gpu_entry_names_it_as_a_person_finds_it_on_the_node() -> None:
    (entry,) = device_status_entries(prepared(gpu()), driver="gpu.gpudra.io", node="node-a", generation=3,
                                     published=PUBLISHED, now=0)
    assert (entry["driver"], entry["pool"], entry["device"]) == ("gpu.gpudra.io", "node-a", "gpu-1")
    assert "shareID" not in entry
    (ready,) = entry["conditions"]
    assert ready == {"type": "Ready", "status": "True", "reason": "Prepared", "observedGeneration": 3,
                     "lastTransitionTime": "1970-01-01T00:00:00Z",
                     "message": "prepared on node node-a for the claim's containers"}
    assert entry["data"] == {"node": "node-a", "uuid": "GPU-1111", "productName": "NVIDIA H100 80GB HBM3",
                             "index": 1, "minor": 1, "pciBusID": "0000:1b:00.0", "deviceNodes": ["/dev/nvidia1"],
                             "cdiDevice": f"k8s.gpu.gpudra.io/claim={REF.uid}-gpu-1"}


def test_a_share_and_its_sharing_are_in_the_entry_keyed_by_share_id() -> None:
    device = gpu(share_id="5e0b8f1e-1c1d-4d4e-8f8f-0a0b0c0d0e0f", consumed=(("memory", 10 << 30),),
                 sharing=DeviceSharing("MPS", active_thread_percentage=50))
    (entry,) = device_status_entries(prepared(device), driver="d.io", node="node-a", generation=None,
                                     published=PUBLISHED, now=0)
    assert entry["shareID"] == device.share_id
    assert "observedGeneration" not in entry["conditions"][0]
    assert entry["data"]["sharing"] == "MPS" and entry["data"]["consumedCapacity"] == {"memory": 10 << 30}


def test_mig_devices_are_placed_on_their_physical_gpu_as_dcgm_labels_them() -> None:
    static = PreparedDevice(("train",), "node-a", STATIC_MIG.name, "MIG-aaaa", (), "x")
    assert locate(static, STATIC_MIG) == locate(static, PUBLISHED[STATIC_MIG.name])
    assert (locate(static, STATIC_MIG).gpu_uuid, locate(static, STATIC_MIG).mig_uuid,
            locate(static, STATIC_MIG).gpu_instance) == ("GPU-0000", "MIG-aaaa", "9")
    placement = MigPlacement("GPU-7777", "3g.40gb", 4, 4, 7)
    before = PreparedDevice(("train",), "node-a", "gpu-7-mig-3g40gb-at4", "", (), "x", mig=placement)
    assert (locate(before, None).gpu_uuid, locate(before, None).mig_uuid) == ("GPU-7777", "")
    made = PreparedDevice(("train",), "node-a", "gpu-7-mig-3g40gb-at4", "MIG-bbbb", (), "x",
                          mig=MigPlacement("GPU-7777", "3g.40gb", 4, 4, 7, gi=2, ci=0))
    (entry,) = device_status_entries(prepared(made), driver="d.io", node="node-a", generation=1, published={}, now=0)
    assert entry["data"]["uuid"] == "MIG-bbbb" and entry["data"]["gpuUUID"] == "GPU-7777"
    assert entry["data"]["gpuInstanceID"] == 2 and entry["data"]["migProfile"] == "3g.40gb"


def test_apply_names_the_uid_and_an_empty_apply_withdraws_every_entry() -> None:
    body = status_apply(REF, [{"driver": "d"}])
    assert body["metadata"] == {"name": "train", "namespace": "ml", "uid": REF.uid}
    assert body["status"] == {"devices": [{"driver": "d"}]}
    assert status_apply(REF, [])["status"] == {}


def test_live_entries_that_differ_only_in_time_are_not_written_again() -> None:
    wanted = device_status_entries(prepared(gpu()), driver="d.io", node="node-a", generation=1,
                                   published=PUBLISHED, now=0)
    later = device_status_entries(prepared(gpu()), driver="d.io", node="node-a", generation=1,
                                  published=PUBLISHED, now=3600)
    live = {"status": {"devices": [*later, {"driver": "other.io", "pool": "p", "device": "x", "conditions": []}]}}
    assert same_entries(live_entries(live, "d.io"), wanted)
    assert not same_entries(live_entries(live, "d.io"), device_status_entries(
        prepared(gpu()), driver="d.io", node="node-a", generation=2, published=PUBLISHED, now=0))
    assert not same_entries([], wanted)
    assert live_entries({"status": {"devices": "junk"}}, "d.io") == []


def test_consumer_pods_are_bounded_and_only_pods() -> None:
    reserved = [{"resource": "pods", "name": f"p-{i}", "uid": str(i)} for i in range(MAX_CONSUMERS + 50)]
    reserved += [{"resource": "jobs", "apiGroup": "batch", "name": "job", "uid": "j"},
                 {"resource": "pods", "name": "Not A Name", "uid": "x"}, "junk"]
    pods = consumer_pods({"status": {"reservedFor": reserved}})
    assert len(pods) == MAX_CONSUMERS and "job" not in pods and "Not A Name" not in pods
    assert consumer_pods(None) == () and consumer_pods({"status": {"reservedFor": {"a": 1}}}) == ()


def test_info_series_one_per_pod_request_and_device() -> None:
    two_requests = PreparedDevice(("train", "eval"), "node-a", "gpu-1", "GPU-1111", ("/dev/nvidia1",), "x")
    series = info_series(prepared(two_requests), ("p-0", "p-1"), PUBLISHED)
    assert len(series) == 4 and all(len(s) == len(INFO_LABELS) for s in series)
    assert ("ml", "p-1", "train", "eval", "gpu-1", "GPU-1111", "", "") in series
    assert info_series(prepared(two_requests), (), PUBLISHED)[0][1] == ""  # pod not known yet


def test_the_reporter_serves_the_series_of_what_the_checkpoint_holds() -> None:
    claims: list[PreparedClaim] = [prepared(gpu())]
    reporter = ClaimReporter(None, driver="d.io", node="node-a", prepared_claims=lambda: claims)
    reporter.set_devices([GPU])
    reporter.prepared(claims[0], {"status": {"reservedFor": [{"resource": "pods", "name": "p-0", "uid": "u"}]}})

    def samples() -> list[dict[str, str]]:
        (family,) = metrics.CLAIM_DEVICES.collect()
        return [s.labels for s in family.samples]

    assert samples() == []  # noted on the kubelet call's path, taken in by the writer's task
    reporter.take_calls()
    assert samples() == [dict(zip(INFO_LABELS, ("ml", "p-0", "train", "train", "gpu-1", "GPU-1111", "", "")))]
    claims.clear()  # unprepared by a peer instance: the checkpoint no longer holds it
    reporter.refresh()
    assert samples() == []
    reporter.prepared(prepared(gpu()), None)
    reporter.take_calls()
    assert [s["pod"] for s in samples()] == [""]  # no pod known yet
    reporter.prepared(prepared(gpu()), None)
    reporter.unprepared(REF)
    reporter.take_calls()  # in their order: the unprepare last
    assert samples() == []


def test_a_call_makes_only_its_own_claims_series_again(monkeypatch) -> None:
    """The series of a node holding many claims are not rebuilt whole on every kubelet call: that
    cost grew with the claims held, on the loop that answers the kubelet."""
    import gpudra_driver.plugin.claimreporter as claimreporter

    claims = [PreparedClaim(ClaimRef("ml", f"c{i}", f"00000000-0000-0000-0000-{i:012d}"), (gpu(),)) for i in range(50)]
    reporter = ClaimReporter(None, driver="d.io", node="node-a", prepared_claims=lambda: claims)
    reporter.set_devices([GPU])
    reporter.refresh()
    built: list[str] = []
    real = claimreporter.info_series
    monkeypatch.setattr(claimreporter, "info_series", lambda claim, *a: built.append(claim.uid) or real(claim, *a))
    one = claims[7]
    reporter.prepared(one, {"status": {"reservedFor": [{"resource": "pods", "name": "p-7", "uid": "u"}]}})
    reporter.take_calls()
    assert built == [one.uid]
    assert len(reporter.series()) == 50 and ("ml", "p-7", "c7") == reporter.series()[7][:3]
    reporter.seen(one.ref, {"metadata": {"uid": one.uid}, "status": {"reservedFor": [
        {"resource": "pods", "name": "p-7", "uid": "u"}]}})  # the leak sweep: the same pod
    assert built == [one.uid]
    reporter.seen(one.ref, {"metadata": {"uid": one.uid}, "status": {"reservedFor": [
        {"resource": "pods", "name": "p-8", "uid": "v"}]}})  # another pod holds it now
    assert built == [one.uid, one.uid] and ("ml", "p-8", "c7") == reporter.series()[7][:3]
    reporter.unprepared(one.ref)
    reporter.take_calls()
    assert built == [one.uid, one.uid]
    assert [s[2] for s in reporter.series()] == [f"c{i}" for i in range(50) if i != 7]  # in claim (UID) order


def test_status_writes_wait_for_a_quiet_kubelet_but_not_forever() -> None:
    assert write_delay(100.0, float("-inf"), 100.0) == 0  # no call yet: at once
    assert abs(write_delay(100.0, 99.9, 99.9) - (QUIET - 0.1)) < 1e-9  # a call 0.1 s ago
    assert write_delay(100.0, 100.0 - QUIET, 90.0) == 0  # quiet long enough
    assert write_delay(100.0, 100.0, 100.0 - MAX_DEFER) == 0  # calls keep coming: the oldest write goes anyway
    assert abs(write_delay(100.0, 100.0, 100.0 - MAX_DEFER + 0.1) - 0.1) < 1e-9  # never past MAX_DEFER


# kube-apiserver 1.35.4's answer to a status apply on a claim created with Python's json.dumps
# default separators and allocated by kube-scheduler (the value shortened here)
IMMUTABLE = ('ResourceClaim.resource.k8s.io "mps" is invalid: status.allocation: Invalid value: '
             '{"Devices":{"Results":[{"Request":"gpu"}]},"AllocationTimestamp":null}: field is immutable')


def test_only_the_allocation_immutability_answer_counts_as_refused() -> None:
    assert allocation_refused(422, IMMUTABLE)
    # kube-apiserver 1.37.2's (declarative validation)
    assert allocation_refused(422, 'ResourceClaim.resource.k8s.io "compact" is invalid: status.allocation: '
                                   'Invalid value: null: field cannot be modified once set')
    assert not allocation_refused(409, IMMUTABLE)
    # the agent's own entries being invalid is a different refusal: no fallback
    assert not allocation_refused(422, 'ResourceClaim.resource.k8s.io "mps" is invalid: status.devices[0].pool: '
                                       'Invalid value: "x": must be allocated')
    assert not allocation_refused(422, 'ResourceClaim.resource.k8s.io "mps" is invalid: metadata.name: field is immutable')


def test_the_merge_patch_keeps_other_drivers_and_is_tied_to_what_was_read() -> None:
    ours = status_apply(REF, [{"driver": "gpu.gpudra.io", "pool": "node-a", "device": "gpu-1"}])
    nic = {"driver": "nic.example.com", "pool": "node-a", "device": "nic-0"}
    live = {"metadata": {"name": "train", "namespace": "ml", "uid": REF.uid, "resourceVersion": "42"},
            "status": {"devices": [{"driver": "gpu.gpudra.io", "pool": "node-a", "device": "gpu-0"}, nic]}}
    patch = status_merge_patch(live, "gpu.gpudra.io", entries_of(ours))
    assert patch["metadata"] == {"uid": REF.uid, "resourceVersion": "42"}
    assert patch["status"]["devices"] == [nic, {"driver": "gpu.gpudra.io", "pool": "node-a", "device": "gpu-1"}]
    # withdrawing: the other driver's entry stays; with none left the list goes
    assert status_merge_patch(live, "gpu.gpudra.io", entries_of(status_apply(REF, [])))["status"]["devices"] == [nic]
    alone = {**live, "status": {"devices": live["status"]["devices"][:1]}}
    assert status_merge_patch(alone, "gpu.gpudra.io", [])["status"]["devices"] is None


def test_an_apply_answer_still_holding_entries_it_left_out_is_not_taken() -> None:
    entry = {"driver": "gpu.gpudra.io", "pool": "node-a", "device": "gpu-0",
             "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    nic = {"driver": "nic.example.com", "pool": "node-a", "device": "nic-0"}
    live = {"status": {"devices": [entry, nic]}}
    assert carries_exactly(live, "gpu.gpudra.io", [{**entry, "conditions": [{"type": "Ready", "status": "True"}]}])
    # a withdrawal answered with our entry still there (a merge patch's, owned by an Update)
    assert not carries_exactly(live, "gpu.gpudra.io", [])
    assert carries_exactly({"status": {"devices": [nic]}}, "gpu.gpudra.io", [])
    assert not carries_exactly(live, "gpu.gpudra.io", [entry, {**entry, "device": "gpu-1"}])
