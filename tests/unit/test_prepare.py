"""plan_prepare: every check a claim must pass before anything is written, and idempotency."""

from __future__ import annotations

import json
import time
import timeit

import pytest
from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver.plugin.allocation import ClaimAllocation, json_size_at_least, read_claim
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PreparedClaim, PreparedDevice
from gpudra_driver.plugin.plan import plan_prepare

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
    with pytest.raises(ClaimError, match=r"results\[0\]\.consumedCapacity\.memory: 'lots' is not a quantity"):
        plan(claim(results=[result("gpu-3", shareID="s", consumedCapacity={"memory": "lots"})]))


# -- tenant input: bounded before any lock (allocation.read_claim) ------------------------------------

def gpu_config(**sharing: object) -> dict:  # type: ignore[type-arg]
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}


def config(parameters: object, *, source: str = "FromClaim", requests: list[str] | None = None) -> dict:  # type: ignore[type-arg]
    entry: dict = {"source": source, "opaque": {"driver": DRIVER, "parameters": parameters}}  # type: ignore[type-arg]
    if requests is not None:
        entry["requests"] = requests
    return entry


def edited(change):  # type: ignore[no-untyped-def]
    """claim() with ``change(allocation.devices, claim)`` applied."""
    obj = claim()
    change(obj["status"]["allocation"]["devices"], obj)
    return obj


def nested(depth: int) -> list:  # type: ignore[type-arg]
    value: list = []  # type: ignore[type-arg]
    for _ in range(depth):  # built without recursion: deeper than any recursive walk could go
        value = [value]
    return value


TOO_BIG = "x" * (10 * 1024)


@pytest.mark.parametrize(("obj", "field"), [
    (edited(lambda d, c: d.update(results=[result("gpu-3")] * 33)),
     "status.allocation.devices.results: 33 entries; the API allows at most 32"),
    (edited(lambda d, c: d.update(config=[config(gpu_config())] * 65)),
     "status.allocation.devices.config: 65 entries; the API allows at most 64"),
    (edited(lambda d, c: d.update(config=[config(gpu_config(), requests=["gpu"] * 33)])),
     "status.allocation.devices.config[0].requests: 33 entries"),
    (edited(lambda d, c: d.update(config=[config(gpu_config(), requests=["gpu/" + "x" * 10**6])])),
     "status.allocation.devices.config[0].requests[0]: 'gpu/xxxxxx"),
    (edited(lambda d, c: d["results"][0].update(request="r" * 64)), "results[0].request: 'rrrr"),
    (edited(lambda d, c: d["results"][0].update(request="a/b/c")), "results[0].request: 'a/b/c' is not a request name"),
    (edited(lambda d, c: d["results"][0].update(device="GPU_3")), "results[0].device: 'GPU_3' is not a device name"),
    (edited(lambda d, c: d["results"][0].update(device="g" * 10**6)), "results[0].device: 'gggg"),
    (edited(lambda d, c: d["results"][0].update(pool="p" * 254)), "results[0].pool: 'pppp"),
    (edited(lambda d, c: d["results"][0].update(driver="d" * 10**6)), "results[0].driver: 'dddd"),
    (edited(lambda d, c: d["results"][0].update(shareID="../../x")), "results[0].shareID: '../../x' is not a UID"),
    (edited(lambda d, c: d["results"][0].update(shareID=OTHER, consumedCapacity={"memory": "1e300000"})),
     "results[0].consumedCapacity.memory: '1e300000' is not a quantity"),
    (edited(lambda d, c: d["results"][0].update(consumedCapacity={f"c{i}": "1" for i in range(33)})),
     "results[0].consumedCapacity: 33 entries"),
    (edited(lambda d, c: d.update(config=[config({"padding": TOO_BIG})])),
     "status.allocation.devices.config[0].opaque.parameters: over 10240 bytes of JSON"),
    (edited(lambda d, c: d.update(config=[config(nested(10**6))])),
     "status.allocation.devices.config[0].opaque.parameters: over 10240 bytes of JSON"),
    (edited(lambda d, c: d.update(config=[config({"n": 10**100000})])),
     "status.allocation.devices.config[0].opaque.parameters: over 10240 bytes of JSON"),
    (edited(lambda d, c: c["metadata"].update(uid="u" * 10**6)), "the API server has UID 'uuuu"),
    (edited(lambda d, c: d["results"].append("not a result")), "results[1]: 'not a result' is not an object"),
])
def test_a_claim_beyond_the_apis_bounds_is_refused_cheaply_naming_the_field(obj, field: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ClaimError) as info:
        plan(obj)
    assert time.perf_counter() - started < 0.05
    assert field in str(info.value) and "ns/c1" in str(info.value)
    assert len(str(info.value)) < 300  # whatever the claim holds, the message stays a line


def test_a_claim_at_the_apis_bounds_is_read_and_each_config_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 results under 32 longest request names, 64 configs of 10 KiB each applying to all of them:
    the API server accepts it, so the agent does; decoding each config once per request would be
    2,048 decodes."""
    from gpudra_driver import gpuconfig

    label = "r" * 61
    requests = [f"{label}{i:02d}/{'s' * 63}" for i in range(32)]
    # as big as a GpuConfig gets: one perDevice entry per device of the claim, by 64-character UUID
    per_device = {f"GPU-{i:060d}": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "1" + "0" * 17}
                  for i in range(32)}
    parameters = gpu_config(strategy="MPS", mps={"pinnedMemoryLimit": "10Gi", "perDevice": per_device})
    assert 4 * 1024 < len(json.dumps(parameters, separators=(",", ":"))) <= 10 * 1024
    names = [r.split("/")[0] for r in requests]
    obj = claim(results=[result(f"gpu-{i % 8}", request=r) for i, r in enumerate(requests)])
    obj["status"]["allocation"]["devices"]["config"] = [
        config(json.loads(json.dumps(parameters)), source=source, requests=names)
        for source in ("FromClass", "FromClaim") for _ in range(32)]
    decodes = 0
    decode = gpuconfig.decode

    def counting(value: object) -> gpuconfig.GpuConfig:
        nonlocal decodes
        decodes += 1
        return decode(value)

    monkeypatch.setattr(gpuconfig, "decode", counting)
    started = time.perf_counter()
    read = read_claim(REF, obj, driver=DRIVER)
    elapsed = time.perf_counter() - started
    assert isinstance(read, ClaimAllocation), read
    assert len(read.devices) == 32 and set(read.configs) == set(requests)
    assert all(isinstance(c, gpuconfig.GpuConfig) and c.sharing.strategy is gpuconfig.Strategy.MPS
               for c in read.configs.values())
    assert decodes == 64 and elapsed < 0.5


def test_parameters_of_exactly_the_apis_10_kib_pass_the_size_bound() -> None:
    padding = {**gpu_config(), "padding": ""}
    padding["padding"] = "x" * (10 * 1024 - len(json.dumps(padding, separators=(",", ":"))))
    assert len(json.dumps(padding, separators=(",", ":"))) == 10 * 1024
    obj = edited(lambda d, c: d.update(config=[config(padding)]))
    with pytest.raises(ClaimError) as info:
        plan(obj)
    assert "padding: unknown field" in str(info.value)  # the decoder's refusal, not the size bound's


def test_a_normal_claim_is_read_in_microseconds() -> None:
    obj = claim(results=[result("gpu-3")])
    obj["status"]["allocation"]["devices"]["config"] = [
        config(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}))]
    read = read_claim(REF, obj, driver=DRIVER)
    assert isinstance(read, ClaimAllocation) and read.shares_gpus
    # the best of a few rounds: what the check costs, not what the machine's other load does
    per_claim = min(timeit.repeat(lambda: read_claim(REF, obj, driver=DRIVER), number=500, repeat=5)) / 500
    assert per_claim < 200e-6, f"{per_claim * 1e6:.0f} µs per claim"


def test_json_size_is_a_lower_bound_of_what_the_api_server_measured() -> None:
    for value in ({"a": [1, 2.5, "é", None, True, False, {"b": "\u2028"}]}, [], {}, "x" * 100, -12345678901234567890,
                  [[[]]], {"k": 1e300}):
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        assert json_size_at_least(value, 10**9) <= len(raw)
    assert 100 < json_size_at_least(nested(10**6), 100) <= 102  # stops at the limit, whatever the depth


@pytest.mark.parametrize("wide", [dict.fromkeys(map(str, range(10**6)), 0), [0] * 10**6, ["x"] * 10**6 + [{"k": 1}]],
                         ids=["object", "array", "mixed"])
def test_json_size_stops_at_the_limit_whatever_the_width(wide: object) -> None:
    """A million members are not read to learn that their count alone passes the limit."""
    assert json_size_at_least(wide, 10 * 1024) > 10 * 1024
    # the best of a few rounds: what the walk costs, not what the machine's other load does
    seconds = min(timeit.repeat(lambda: json_size_at_least(wide, 10 * 1024), number=1, repeat=5))
    assert seconds < 0.01, f"{seconds * 1e3:.1f} ms"


def test_only_a_claim_with_a_side_effect_or_an_entry_to_replace_needs_prepare_started() -> None:
    from dataclasses import replace

    from gpudra_driver.plugin.model import MPS, TIME_SLICING, DeviceSharing
    from gpudra_driver.plugin.plan import needs_prepare_started

    plain = plan(claim(UID, results=[result("gpu-3")])).claim
    shared = plan(claim(UID, results=[result("gpu-3", shareID="s-1", consumedCapacity={"memory": "10Gi"})])).claim
    assert not needs_prepare_started(EMPTY, [plain])  # a new claim, nothing outside the CDI directory
    assert not needs_prepare_started(EMPTY, [shared])  # a share of consumable capacity: only its spec
    for sharing in (DeviceSharing(TIME_SLICING, timeslice=3), DeviceSharing(MPS, active_thread_percentage=50)):
        with_effect = replace(plain, devices=(replace(plain.devices[0], sharing=sharing),))
        assert needs_prepare_started(EMPTY, [with_effect])
        other = plan(claim(OTHER, name="c2", results=[result("gpu-4")]), ref=ClaimRef("ns", "c2", OTHER)).claim
        assert needs_prepare_started(EMPTY, [other, with_effect])  # one in the batch is enough
    completed = EMPTY.started(plain).completed(UID)
    assert needs_prepare_started(completed, [plain])  # allocated anew: replaces its entry
    assert needs_prepare_started(EMPTY.adopting({UID: [(NODE, "gpu-3")]}), [plain])  # an adopted claim
    assert not needs_prepare_started(completed, [])
