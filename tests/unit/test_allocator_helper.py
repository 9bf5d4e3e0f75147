"""gpudra-allocator's protocol (operator/gpudra-allocator, through gpudra_operator.allocatorhelper):
every supported release's binary answers each op, runs Kubernetes' allocator with that release's
feature gates (consumable capacity, partitionable devices and taints where the release's scheduler
has them on), and stays bounded and alive when a request is bad, too long, or too slow. Without the
binaries the tests fail with the command that builds them; they never skip."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpudra_operator.allocatorhelper import (
    AllocatorError,
    AllocatorHelper,
    AllocatorUnavailable,
    available_minors,
    choose,
)

DRIVER = "gpu.example.com"
MINORS = available_minors()


def test_every_supported_release_has_a_binary() -> None:
    source = Path(__file__).resolve().parents[2] / "operator" / "gpudra-allocator"
    releases = sorted(int(p.name.removeprefix("v1.")) for p in source.glob("v1.*"))
    assert releases and MINORS == releases, (
        f"gpudra-allocator binaries for 1.{MINORS} but sources for 1.{releases}: run make allocator")


def test_a_release_without_a_binary_is_answered_by_the_nearest_with_a_note() -> None:
    newest, oldest = MINORS[-1], MINORS[0]
    assert choose(newest).note is None and choose(newest).minor == newest
    later = choose(newest + 1)
    assert later.minor == newest and later.note and f"1.{newest + 1}" in later.note and "may not know" in later.note
    earlier = choose(oldest - 1)
    assert earlier.minor == oldest and earlier.note and "may not know" not in earlier.note
    assert choose(None).minor == oldest


def test_no_binary_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(AllocatorUnavailable, match="hack/allocator-bin.sh"):
        choose(36, tmp_path)


def device(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, **fields}


def slice_(node: str, devices: list[dict[str, Any]], *, count: int = 1, name: str | None = None,
           **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"driver": DRIVER, "nodeName": node,
                            "pool": {"name": node, "generation": 1, "resourceSliceCount": count}, **spec}
    if devices:
        body["devices"] = devices
    return {"metadata": {"name": name or f"{node}-slice"}, "spec": body}


def claim(name: str, *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"}, "spec": {"devices": devices}}


def exactly(name: str, count: int = 1, **body: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "gpu", "allocationMode": "ExactCount", "count": count, **body}}


GPU_CLASS = {"metadata": {"name": "gpu"}, "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}
NODES = [{"metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"}}}]


def held(name: str, **result: Any) -> dict[str, Any]:
    """A claim whose allocation holds one device (``result``: its fields beyond request and pool)."""
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": DRIVER, "pool": "n1", **result}]}}}}


async def allocate(minor: int, slices: list[dict[str, Any]], claims: list[dict[str, Any]],
                   holders: list[dict[str, Any]] = (), **helper_args: Any) -> Any:  # type: ignore[assignment]
    async with AllocatorHelper(minor, **helper_args) as helper:
        (outcome,) = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=list(holders),
                                           claims=claims, nodes=NODES)
    return outcome


@pytest.mark.parametrize("minor", MINORS)
async def test_each_release_says_its_version_and_gates(minor: int) -> None:
    async with AllocatorHelper(minor) as helper:
        features = await helper.features()
        assert features["release"].startswith(f"1.{minor}.")
        assert features["gates"] == features["defaults"]
        # Kubernetes' own defaults (pkg/features/kube_features.go of each release)
        assert features["defaults"]["DRAPrioritizedList"] and features["defaults"]["DRAAdminAccess"]
        for gate in ("DRAConsumableCapacity", "DRAPartitionableDevices", "DRADeviceTaints"):
            assert features["defaults"][gate] is (minor >= 36), (gate, minor)
        assert features["defaults"]["DRADeviceTaintRules"] is (minor >= 37)
        assert features["defaults"].get("DRAFractionalCapacityRange", False) is False
    async with AllocatorHelper(minor, feature_gates={"DRAConsumableCapacity": minor < 36}) as helper:
        assert (await helper.features())["gates"]["DRAConsumableCapacity"] is (minor < 36)
    async with AllocatorHelper(minor, feature_gates={"DRANoSuchGate": True}) as helper:
        with pytest.raises(AllocatorError, match="unknown DRA feature gate"):
            await helper.features()


async def test_compile_gives_the_api_servers_error_and_estimated_cost() -> None:
    async with AllocatorHelper(MINORS[-1]) as helper:
        (good, bad, unknown_field), limit = await helper.compile([
            f'device.attributes["{DRIVER}"].index == 1', "device.attributes[", "device.nope == 1"])
    assert limit == 1_000_000
    assert good.error is None and 0 < good.max_cost < 100
    assert bad.error and "Syntax error" in bad.error
    assert unknown_field.error and "undefined field 'nope'" in unknown_field.error


async def test_match_runs_each_selector_on_each_device_with_runtime_errors() -> None:
    memory = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0'
    numa = f'device.attributes["{DRIVER}"].numaNode == 0'
    devices = [(DRIVER, device("a", capacity={"memory": {"value": "80Gi"}}, attributes={"numaNode": {"int": 0}})),
               (DRIVER, device("b", capacity={"memory": {"value": "24Gi"}}))]
    async with AllocatorHelper(MINORS[0]) as helper:
        compiled, rows = await helper.match([memory, numa], devices)
    assert [c.error for c in compiled] == [None, None]
    assert [(o.matches, o.error) for o in rows[0]] == [(True, None), (True, None)]
    assert rows[1][0].matches is False and rows[1][0].error is None
    assert rows[1][1].matches is False and "no such key: numaNode" in (rows[1][1].error or "")
    assert all(o.actual_cost for row in rows for o in row)


@pytest.mark.parametrize("minor", MINORS)
async def test_allocate_holds_what_other_claims_hold(minor: int) -> None:
    slices = [slice_("n1", [device("gpu-0"), device("gpu-1")])]
    fits = await allocate(minor, slices, [claim("c", exactly("r", 1))], [held("h", device="gpu-0")])
    assert fits.error is None and fits.results is not None
    assert [r["device"] for r in fits.results[0]["devices"]["results"]] == ["gpu-1"]
    full = await allocate(minor, slices, [claim("c", exactly("r", 2))], [held("h", device="gpu-0")])
    assert full.error is None and full.results is None
    # admin access holds nothing
    admin = await allocate(minor, slices, [claim("c", exactly("r", 2))], [held("h", device="gpu-0", adminAccess=True)])
    assert admin.results is not None


@pytest.mark.parametrize("minor", MINORS)
async def test_consumable_capacity_shares_a_device_where_the_release_does(minor: int) -> None:
    shared = device("gpu-0", allowMultipleAllocations=True, capacity={"memory": {
        "value": "140Gi", "requestPolicy": {"default": "10Gi", "validRange": {"min": "1Gi"}}}})
    slices = [slice_("n1", [shared])]
    share = exactly("r", 1, capacity={"requests": {"memory": "60Gi"}})
    holders = [held("a", device="gpu-0", shareID="11111111-1111-1111-1111-111111111111",
                    consumedCapacity={"memory": "60Gi"})]
    second = await allocate(minor, slices, [claim("b", share)], holders)
    if minor >= 36:  # DRAConsumableCapacity beta and on: 80Gi left, 60Gi asked
        assert second.error is None and second.results is not None, second
        (result,) = second.results[0]["devices"]["results"]
        assert result["device"] == "gpu-0" and result["shareID"] and result["consumedCapacity"] == {"memory": "60Gi"}
        third = await allocate(minor, slices, [claim("c", share)], holders + [
            held("b", device="gpu-0", shareID="22222222-2222-2222-2222-222222222222", consumedCapacity={"memory": "60Gi"})])
        assert third.error is None and third.results is None  # 20Gi left
    else:  # off in 1.35: a held device is held whole
        assert second.results is None
    # An administrator's gates are the ones that count.
    turned = await allocate(minor, slices, [claim("b", share)], holders,
                            feature_gates={"DRAConsumableCapacity": minor < 36})
    assert (turned.results is not None) is (minor < 36)


@pytest.mark.parametrize("minor", [m for m in MINORS if m >= 36])
async def test_partitionable_devices_share_counters(minor: int) -> None:
    counters = slice_("n1", [], count=2, name="n1-counters",
                      sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}])
    parts = [device(f"gpu-0-mig-{i}", consumesCounters=[{"counterSet": "gpu-0-counters",
                                                         "counters": {"memory": {"value": "40Gi"}}}])
             for i in range(3)]
    slices = [counters, slice_("n1", parts, count=2)]
    two = await allocate(minor, slices, [claim("c", exactly("r", 2))])
    assert two.error is None and two.results is not None
    three = await allocate(minor, slices, [claim("c", exactly("r", 3))])
    assert three.error is None and three.results is None  # 3 x 40Gi > 80Gi
    after_one = await allocate(minor, slices, [claim("c", exactly("r", 2))], [held("h", device="gpu-0-mig-0")])
    assert after_one.results is None


@pytest.mark.parametrize("minor", MINORS)
async def test_taints_keep_requests_off_unless_tolerated(minor: int) -> None:
    tainted = device("gpu-0", taints=[{"key": f"{DRIVER}/unhealthy", "value": "xid", "effect": "NoSchedule"}])
    slices = [slice_("n1", [tainted])]
    plain = await allocate(minor, slices, [claim("c", exactly("r"))])
    tolerating = await allocate(minor, slices, [claim("c", exactly("r", tolerations=[
        {"key": f"{DRIVER}/unhealthy", "operator": "Exists", "effect": "NoSchedule"}]))])
    assert tolerating.results is not None
    assert (plain.results is None) is (minor >= 36)  # DRADeviceTaints: alpha and off in 1.35


async def test_a_selector_that_fails_stops_the_allocation_with_the_schedulers_error() -> None:
    slices = [slice_("n1", [device("gpu-0")])]
    request = exactly("r", selectors=[{"cel": {"expression": f'device.attributes["{DRIVER}"].numaNode == 0'}}])
    outcome = await allocate(MINORS[0], slices, [claim("c", request)])
    assert outcome.results is None and outcome.error
    # the scheduler's own words (kube-scheduler fails the pod with them, on every node)
    assert outcome.error.startswith("claim team/c: selector #0") and "CEL runtime error" in outcome.error
    assert "no such key: numaNode" in outcome.error


async def test_bad_requests_are_refused_and_the_helper_goes_on() -> None:
    async with AllocatorHelper(MINORS[0]) as helper:
        with pytest.raises(AllocatorError, match="unknown op"):
            await helper.ask({"op": "nope"})
        with pytest.raises(AllocatorError, match="bad request"):
            await helper.ask({"op": "allocate", "slices": "not a list"})
        assert (await helper.features())["release"]


async def test_a_request_longer_than_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    binary = choose(MINORS[0]).path
    process = await asyncio.create_subprocess_exec(
        str(binary), "-max-request-bytes", "4096", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b'{"op":"compile","expressions":["' + b"x" * 100_000 + b'"]}\n{"op":"features","id":7}\n')
    await process.stdin.drain()
    refused = await process.stdout.readline()
    assert b"request longer than 4096 bytes" in refused
    assert b'"id":7' in await process.stdout.readline()
    process.stdin.close()
    assert await process.wait() == 0


async def test_a_request_past_its_deadline_stops_and_the_next_one_is_answered() -> None:
    # 3,000 nodes of 8 devices and a claim no node fits, under a 1 ms deadline
    slices = [slice_(f"n{i}", [device(f"gpu-{d}") for d in range(8)], name=f"s{i}") for i in range(3000)]
    nodes = [{"metadata": {"name": f"n{i}"}} for i in range(3000)]
    async with AllocatorHelper(MINORS[0], timeout=0.001) as helper:
        with pytest.raises(AllocatorError, match="deadline"):
            await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                  claims=[claim("c", exactly("r", 9))], nodes=nodes)
        helper.timeout = 60
        assert (await helper.features())["release"]


async def test_a_helper_that_dies_is_started_again_on_the_next_request() -> None:
    async with AllocatorHelper(MINORS[0]) as helper:
        await helper.features()
        process = helper._process
        assert process is not None
        process.kill()
        await process.wait()
        assert (await helper.features())["release"]
        assert helper._process is not process


async def test_results_are_the_allocators_own_objects_untouched() -> None:
    slices = [slice_("n1", [device("gpu-0"), device("gpu-1")])]
    before = copy.deepcopy(slices)
    outcome = await allocate(MINORS[-1], slices, [claim("c", exactly("r", 2))])
    assert slices == before
    assert outcome.results[0]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]


RULE_VERSIONS = {35: "v1alpha3", 36: "v1beta2", 37: "v1"}


@pytest.mark.parametrize("minor", MINORS)
async def test_device_taint_rules_taint_devices_as_the_schedulers_tracker_does(minor: int) -> None:
    rule = {"apiVersion": f"resource.k8s.io/{RULE_VERSIONS.get(minor, 'v1')}", "kind": "DeviceTaintRule",
            "metadata": {"name": "drain-gpu-0"},
            "spec": {"deviceSelector": {"driver": DRIVER, "device": "gpu-0"},
                     "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"}}}
    slices = [slice_("n1", [device("gpu-0"), device("gpu-1")])]
    both = claim("c", exactly("r", 2))
    tolerating = claim("c", exactly("r", 2, tolerations=[{"key": "example.com/maintenance", "operator": "Exists"}]))
    on = {"DRADeviceTaints": True, "DRADeviceTaintRules": True}
    for gates in ({}, on):
        async with AllocatorHelper(minor, feature_gates=gates) as helper:
            (plain,) = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[], claims=[both],
                                             nodes=NODES, device_taint_rules=[rule])
            (tolerated,) = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                                 claims=[tolerating], nodes=NODES, device_taint_rules=[rule])
        applied = bool(gates) or minor >= 37  # DRADeviceTaintRules: on by default from 1.37
        assert (plain.results is None) is applied, (minor, gates, plain)
        assert tolerated.results is not None and tolerated.error is None


async def test_a_cancelled_request_leaves_no_answer_for_the_next_one() -> None:
    slices = [slice_(f"n{i}", [device(f"gpu-{d}") for d in range(8)], name=f"s{i}") for i in range(2000)]
    nodes = [{"metadata": {"name": f"n{i}"}} for i in range(2000)]
    async with AllocatorHelper(MINORS[0]) as helper:
        slow = asyncio.create_task(helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                                   claims=[claim("c", exactly("r", 9))], nodes=nodes))
        await asyncio.sleep(0)  # the request is written (the task runs up to its first wait)
        while helper._process is None:
            await asyncio.sleep(0)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        features = await helper.features()  # its own answer, not the allocation's
        assert features["release"] and "nodes" not in features


async def test_an_idle_helper_exits_and_comes_back_on_the_next_request() -> None:
    async with AllocatorHelper(MINORS[0], idle_close=0.05) as helper:
        await helper.features()
        process = helper._process
        assert process is not None
        assert await asyncio.wait_for(process.wait(), 10) is not None  # exited once idle
        assert (await helper.features())["release"] and helper._process is not process


async def test_the_operator_images_lean_build_refuses_rules_it_would_leave_out() -> None:
    script = Path(__file__).resolve().parents[2] / "hack" / "allocator-bin.sh"
    built = subprocess.run([str(script)], env={**os.environ, "VARIANT": "lean"}, capture_output=True, text=True,
                           timeout=1800, check=False)
    assert built.returncode == 0, f"VARIANT=lean {script} failed: {built.stderr[-2000:]}"
    lean = Path(built.stdout.strip().splitlines()[-1])
    rule = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "drain"},
            "spec": {"deviceSelector": {"driver": DRIVER, "device": "gpu-0"},
                     "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"}}}
    slices = [slice_("n1", [device("gpu-0"), device("gpu-1")])]
    async with AllocatorHelper(37) as full, AllocatorHelper(37, where=lean) as small:
        assert (await full.features())["deviceTaintRules"] is True
        assert (await small.features())["deviceTaintRules"] is False
        (plain,) = await small.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                        claims=[claim("c", exactly("r", 2))], nodes=NODES)
        assert plain.results is not None
        with pytest.raises(AllocatorError, match="does not apply them: run kubectl gpudra explain from the gpudra wheel"):
            await small.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                 claims=[claim("c", exactly("r", 2))], nodes=NODES, device_taint_rules=[rule])
        assert (await full.features())["extendedClaims"] is True
        assert (await small.features())["extendedClaims"] is False
        with pytest.raises(AllocatorError, match="does not build the claim for extended resources"):
            await small.extended(pod=extended_pod([worker("main", 1)]), classes=[EXTENDED_CLASS], claims=[],
                                 nodes=NODES)
    assert lean.stat().st_size < choose(37).path.stat().st_size


# --- extended resources backed by DRA (KEP-5004): the claim the scheduler builds --------------------

RESOURCE = "example.com/gpu"
EXTENDED_CLASS = {"metadata": {"name": "gpu"}, "spec": {**GPU_CLASS["spec"], "extendedResourceName": RESOURCE}}


def worker(name: str, gpus: int, *, sidecar: bool = False, resource: str = RESOURCE) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "resources": {"requests": {resource: str(gpus), "cpu": "1"}}}
    if sidecar:
        body["restartPolicy"] = "Always"
    return body


def extended_pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "team", "uid": "uid-p"},
            "spec": {"initContainers": init or [], "containers": containers}}


def counts(variant: dict[str, Any]) -> dict[str, int]:
    return {r["name"]: r["exactly"]["count"] for r in variant["requests"]}


@pytest.mark.parametrize("minor", MINORS)
async def test_extended_resources_get_the_schedulers_claim_where_its_gate_is_on(minor: int) -> None:
    pod = extended_pod([worker("a", 2), worker("b", 1)], init=[worker("warm", 4), worker("side", 1, sidecar=True)])
    async with AllocatorHelper(minor) as helper:
        plan = await helper.extended(pod=pod, classes=[EXTENDED_CLASS], claims=[], nodes=NODES)
    if minor < 36:  # DRAExtendedResource: alpha and off in 1.35
        assert plan is None
        return
    assert plan is not None
    assert plan.resources == {RESOURCE: 4} and plan.classes == {RESOURCE: "gpu"} and plan.prior is None
    (variant,) = plan.variants
    # Long-lived containers (the sidecar among them) each get a request; the init container
    # reuses theirs (1 + 2 + 1) and needs none of its own.
    # Named by container index and the resource's place among the container's sorted requests (cpu first).
    assert counts(variant) == {"container-1-request-1": 1, "container-2-request-1": 2, "container-3-request-1": 1}
    warm = {m["requestName"] for m in variant["mappings"] if m["containerName"] == "warm"}
    assert warm == set(counts(variant))
    assert [(n.name, n.variant, n.unschedulable) for n in plan.nodes] == [("n1", 0, None)]


async def test_extended_resources_per_node_device_plugins_and_resources_nobody_serves() -> None:
    minor = max(MINORS)
    nodes = [{"metadata": {"name": "dra"}},
             {"metadata": {"name": "plugin"}, "status": {"allocatable": {RESOURCE: "8"}}},
             {"metadata": {"name": "zero"}, "status": {"allocatable": {RESOURCE: "0"}}}]
    async with AllocatorHelper(minor) as helper:
        plan = await helper.extended(pod=extended_pod([worker("main", 2)]), classes=[EXTENDED_CLASS], claims=[],
                                     nodes=nodes)
        assert plan is not None
        # A device plugin serves it where allocatable has some; DRA where it has none (listed or not).
        assert [(n.name, n.variant) for n in plan.nodes] == [("dra", 0), ("plugin", None), ("zero", 0)]
        unserved = extended_pod([worker("main", 1), worker("odd", 1, resource="example.com/fpga")])
        plan = await helper.extended(pod=unserved, classes=[EXTENDED_CLASS], claims=[], nodes=nodes[:1])
        assert plan is not None
        (node,) = plan.nodes
        assert node.variant is None and node.unschedulable is not None and "example.com/fpga" in node.unschedulable
        # No class maps the pod's resources: the scheduler leaves them to device plugins.
        assert await helper.extended(pod=extended_pod([worker("main", 1)]), classes=[GPU_CLASS], claims=[],
                                     nodes=nodes) is None
        # The implicit name of any class.
        implicit = extended_pod([worker("main", 1, resource="deviceclass.resource.kubernetes.io/gpu")])
        plan = await helper.extended(pod=implicit, classes=[GPU_CLASS], claims=[], nodes=nodes[:1])
        assert plan is not None and plan.classes == {"deviceclass.resource.kubernetes.io/gpu": "gpu"}


async def test_a_claim_from_an_earlier_attempt_keeps_the_pod_off_every_node() -> None:
    pod = extended_pod([worker("main", 1)])
    prior = {"metadata": {"name": "p-extended-resources-x", "namespace": "team",
                          "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
                          "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "uid-p",
                                               "controller": True}]},
             "spec": {"devices": {"requests": [exactly("container-0-request-0")]}}}
    async with AllocatorHelper(max(MINORS)) as helper:
        plan = await helper.extended(pod=pod, classes=[EXTENDED_CLASS], claims=[prior], nodes=NODES)
    assert plan is not None and plan.prior == "p-extended-resources-x"
    (node,) = plan.nodes
    assert node.unschedulable is not None and "earlier scheduling attempt" in node.unschedulable


async def test_allocate_adds_each_nodes_variant_of_the_extended_claim_after_the_pods_claims() -> None:
    minor = max(MINORS)
    nodes = [{"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}}} for n in ("n1", "n2")]
    slices = [slice_(n, [device("gpu-0"), device("gpu-1")]) for n in ("n1", "n2")]
    pod = extended_pod([worker("main", 2)])
    async with AllocatorHelper(minor) as helper:
        plan = await helper.extended(pod=pod, classes=[EXTENDED_CLASS], claims=[], nodes=nodes)
        assert plan is not None
        # n1: the pod's own claim and the extended one (2 + 1 GPUs > 2 published); n2: its own alone.
        one, two = await helper.allocate(classes=[EXTENDED_CLASS], slices=slices, allocated_claims=[],
                                         claims=[claim("own", exactly("r", 1))], nodes=nodes, pod=pod,
                                         extended_claims=plan.variants, node_extended=[0, -1])
        assert one.results is None and one.error is None
        assert two.results is not None and len(two.results) == 1
        (alone,) = await helper.allocate(classes=[EXTENDED_CLASS], slices=slices, allocated_claims=[], claims=[],
                                         nodes=nodes[:1], pod=pod, extended_claims=plan.variants, node_extended=[0])
        assert alone.results is not None
        (result,) = alone.results
        assert sorted(r["request"] for r in result["devices"]["results"]) == ["container-0-request-1"] * 2
        with pytest.raises(AllocatorError, match="one entry per node"):
            await helper.allocate(classes=[EXTENDED_CLASS], slices=slices, allocated_claims=[], claims=[],
                                  nodes=nodes, pod=pod, extended_claims=plan.variants, node_extended=[0])


@pytest.mark.parametrize("minor", MINORS)
async def test_a_node_past_the_schedulers_filter_timeout_is_its_error(minor: int) -> None:
    slices = [slice_("n1", [device("gpu-0"), device("gpu-1")])]
    async with AllocatorHelper(minor) as helper:
        assert (await helper.features())["defaults"]["DRASchedulerFilterTimeout"] is True  # beta, on, since 1.34
        ok = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                   claims=[claim("c", exactly("r", 2))], nodes=NODES)
        assert ok[0].results is not None  # well inside the default 10 s
    # A filter timeout no allocation can meet: the scheduler's error for the node, not "does not fit".
    async with AllocatorHelper(minor, filter_timeout=1e-9) as helper:
        (late,) = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                        claims=[claim("c", exactly("r", 2))], nodes=NODES)
        assert late.results is None and late.error is not None and "timed out trying to allocate devices" in late.error
    # Without one (0), or with the gate off, the same node answers.
    for helper_args in ({"filter_timeout": 0}, {"feature_gates": {"DRASchedulerFilterTimeout": False}}):
        async with AllocatorHelper(minor, **helper_args) as helper:  # type: ignore[arg-type]
            (outcome,) = await helper.allocate(classes=[GPU_CLASS], slices=slices, allocated_claims=[],
                                               claims=[claim("c", exactly("r", 2))], nodes=NODES)
            assert outcome.results is not None, helper_args
