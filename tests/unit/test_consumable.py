"""Consumable capacity (KEP-5075) on the agent's side: which devices are published for sharing and
with which request policies, checked against the API server's own rules for a requestPolicy
(k8s.io/kubernetes pkg/apis/resource/validation, validateRequestPolicyRange) so that a node's pool
is never refused for a policy; the flags; the probe slice and how its answer is read."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

import pytest

from gpudra_core import consumable
from gpudra_core.consumable import (ConsumableCapacity, memory_policy, policy_to_api, share_device,
                                      share_devices, shares_policy)
from gpudra_core.devicemodel import AttrValue, Device, RequestPolicy
from gpudra_driver.discovery import scan
from gpudra_driver.nvml import load_nvml
from gpudra_driver.publishing.rescan import Rescanner
from gpudra_driver.publishing.slices import build_slices
from gpudra_driver.deviceapi import device_to_api

GI, MI = 2**30, 2**20
H100 = 81559 * MI  # what NVML reports for an "80GB" H100


def gpu(name: str = "gpu-0", memory: int = H100) -> Device:
    return Device(name, {"type": AttrValue.of_string("gpu"), "uuid": AttrValue.of_string(f"GPU-{name}")},
                  {"memory": memory})


def mig() -> Device:
    return Device("gpu-0-mig-1g10gb-9-0", {"type": AttrValue.of_string("mig")}, {"memory": 9728 * MI})


# -- the policies ---------------------------------------------------------------------------------

def test_memory_a_claim_names_is_rounded_to_the_step_and_none_means_the_whole_gpu() -> None:
    policy = memory_policy(H100, GI)
    assert policy == RequestPolicy(default=79 * GI, min=GI, max=79 * GI, step=GI)
    assert policy.problems(H100) == []


def test_a_gpu_of_exactly_n_steps_offers_all_of_it() -> None:
    assert memory_policy(80 * GI, GI) == RequestPolicy(default=80 * GI, min=GI, max=80 * GI, step=GI)


@pytest.mark.parametrize("memory, step", [(23034 * MI, 16 * GI), (GI, GI), (2 * GI - 1, GI)])
def test_a_gpu_with_less_than_two_steps_is_not_shared(memory: int, step: int) -> None:
    assert memory_policy(memory, step) is None


def test_two_steps_is_the_least_that_can_be_shared() -> None:
    policy = memory_policy(2 * GI, GI)
    assert policy is not None and policy.problems(2 * GI) == []


@pytest.mark.parametrize("shares", [1, 2, 7, 1000])
def test_shares_policy_is_one_per_claim_and_valid_for_any_count(shares: int) -> None:
    policy = shares_policy(shares)
    assert (policy.default, policy.min, policy.max) == (1, 1, shares)
    assert policy.problems(shares) == []


def test_one_share_has_no_step_which_the_api_would_refuse() -> None:
    assert RequestPolicy(default=1, min=1, max=1, step=1).problems(1) == [
        "one step (min 1 + step 1) is larger than the capacity 1"]
    assert shares_policy(1).step is None


@pytest.mark.parametrize("policy, value, problem", [
    (RequestPolicy(default=GI, min=2 * GI), 4 * GI, "default 1073741824 is less than min"),
    (RequestPolicy(default=GI, min=8 * GI), 4 * GI, "min 8589934592 is larger than the capacity"),
    (RequestPolicy(default=GI, min=GI, max=8 * GI), 4 * GI, "max 8589934592 is larger than the capacity"),
    (RequestPolicy(default=3 * GI, min=GI, max=2 * GI), 4 * GI, "default 3221225472 is more than max"),
    (RequestPolicy(default=GI, min=2 * GI, max=GI), 4 * GI, "min 2147483648 is larger than max"),
    (RequestPolicy(default=GI + 1, min=GI, step=GI), 4 * GI, "default 1073741825 is not min"),
    (RequestPolicy(default=GI, min=GI, max=3 * GI - 1, step=GI), 4 * GI, "max 3221225471 is not min"),
    (RequestPolicy(default=GI, min=GI, step=0), 4 * GI, "step 0 is not positive"),
])
def test_the_api_servers_rules_for_a_valid_range(policy: RequestPolicy, value: int, problem: str) -> None:
    assert any(p.startswith(problem) for p in policy.problems(value)), policy.problems(value)


@pytest.mark.parametrize("memory", [2 * GI, 23034 * MI, H100, 143771 * MI, 80 * GI])
@pytest.mark.parametrize("step", [MI, GI, 1536 * MI, 10**9, 3 * GI])
def test_every_published_policy_passes_the_api_servers_rules(memory: int, step: int) -> None:
    policy = memory_policy(memory, step)
    if policy is not None:
        assert policy.problems(memory) == []
        assert policy.default <= memory and policy.max is not None and policy.max > memory - step


# -- the devices ---------------------------------------------------------------------------------

def test_full_gpus_are_shared_mig_devices_are_not() -> None:
    devices, warnings = share_devices([gpu(), mig()], ConsumableCapacity(GI))
    assert warnings == []
    shared, partition = devices
    assert shared.allow_multiple_allocations and shared.request_policies == {"memory": memory_policy(H100, GI)}
    assert partition == mig()


def test_shares_add_a_capacity_with_its_policy() -> None:
    device, warning = share_device(gpu(), ConsumableCapacity(GI, shares=4))
    assert warning is None
    assert device.capacity == {"memory": H100, "shares": 4}
    assert device.request_policies["shares"] == RequestPolicy(default=1, min=1, max=4, step=1)


def test_a_small_gpu_stays_exclusive_with_a_warning_naming_it() -> None:
    (device,), (warning,) = share_devices([gpu("gpu-3", 23034 * MI)], ConsumableCapacity(16 * GI))
    assert not device.allow_multiple_allocations and device.request_policies == {}
    assert warning == ("GPU gpu-3: its memory (23034Mi) is less than two steps of 16Gi (--consumable-memory-step): "
                       "published unshared, one claim at a time")


def test_no_policy_changes_nothing() -> None:
    assert share_devices([gpu(), mig()], None) == ([gpu(), mig()], [])


def test_the_model_refuses_a_policy_the_api_would_refuse() -> None:
    with pytest.raises(ValueError, match="needs allow_multiple_allocations"):
        dataclasses.replace(gpu(), request_policies={"memory": memory_policy(H100, GI)})
    with pytest.raises(ValueError, match="request policy for capacity 'shares', which it does not have"):
        dataclasses.replace(gpu(), allow_multiple_allocations=True, request_policies={"shares": shares_policy(2)})
    with pytest.raises(ValueError, match="max 85899345920 is larger than the capacity"):
        dataclasses.replace(gpu(), allow_multiple_allocations=True,
                            request_policies={"memory": RequestPolicy(default=GI, min=GI, max=80 * GI, step=GI)})


def test_the_published_device_in_the_api_form() -> None:
    device, _ = share_device(gpu(), ConsumableCapacity(GI, shares=4))
    entry = device_to_api(device)
    assert entry["allowMultipleAllocations"] is True
    assert entry["capacity"] == {
        "memory": {"value": "81559Mi",
                   "requestPolicy": {"default": "79Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}},
        "shares": {"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}},
    }
    assert "allowMultipleAllocations" not in device_to_api(gpu())
    assert "requestPolicy" not in device_to_api(gpu())["capacity"]["memory"]


def test_quantities_are_in_the_canonical_form_the_api_server_returns() -> None:
    # a decimal step stays decimal, a binary one binary: the publisher compares what it sent with
    # what the server stored, so a different spelling would rewrite the pool forever
    assert policy_to_api(RequestPolicy(default=85 * 10**9, min=10**9, max=85 * 10**9, step=10**9), binary=True) == {
        "default": "85G", "validRange": {"min": "1G", "max": "85G", "step": "1G"}}
    assert policy_to_api(RequestPolicy(default=1536 * MI, min=512 * MI), binary=True) == {
        "default": "1536Mi", "validRange": {"min": "512Mi"}}


def test_slices_carry_the_shared_devices() -> None:
    devices, _ = share_devices([gpu("gpu-0"), gpu("gpu-1"), mig()], ConsumableCapacity(GI, shares=2))
    [slice_] = build_slices("gpu.gpudra.io", "node-1", "uid-1", 1, devices)
    by_name = {d["name"]: d for d in slice_["spec"]["devices"]}
    assert [n for n, d in by_name.items() if d.get("allowMultipleAllocations")] == ["gpu-0", "gpu-1"]


# -- the flags -----------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    consumable.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags() -> None:
    assert consumable.from_args(parse()) is None
    assert consumable.from_args(parse("--consumable-memory-step", "1Gi")) == ConsumableCapacity(GI)
    assert consumable.from_args(parse("--consumable-memory-step", "512Mi", "--consumable-shares", "8")) == \
        ConsumableCapacity(512 * MI, 8)
    with pytest.raises(ValueError, match="--consumable-shares needs --consumable-memory-step"):
        consumable.from_args(parse("--consumable-shares", "2"))


@pytest.mark.parametrize("argv, message", [
    (("--consumable-memory-step", "0"), "is not a positive whole number of bytes"),
    (("--consumable-memory-step=-1Gi",), "is not a positive whole number of bytes"),
    (("--consumable-memory-step", "0.5"), "is not a positive whole number of bytes"),
    (("--consumable-memory-step", "lots"), "is not a Kubernetes quantity"),
    (("--consumable-shares", "1001"), "is not a number of shares 0..1000"),
    (("--consumable-shares", "x"), "is not a number of shares"),
])
def test_bad_flags_are_usage_errors(argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_policy_values_are_checked() -> None:
    with pytest.raises(ValueError):
        ConsumableCapacity(0)
    with pytest.raises(ValueError):
        ConsumableCapacity(GI, shares=1001)
    assert ConsumableCapacity.parse("1.5Gi", 3) == ConsumableCapacity(1536 * MI, 3)


# -- the rescan hands on shared devices ------------------------------------------------------------

def test_the_rescan_hands_shared_gpus_to_the_publisher_and_warns_once(tmp_path: Path) -> None:
    published: list[list[Device]] = []
    reports: list[tuple[str, str, str]] = []

    async def report(kind: str, reason: str, message: str) -> None:
        reports.append((kind, reason, message))

    def publish(devices):  # type: ignore[no-untyped-def]
        published.append(list(devices))
        return True

    rescanner = Rescanner("fake:l4x2", publish, report=report, sharing=ConsumableCapacity(12 * GI))
    assert asyncio.run(rescanner.scan_once()) and asyncio.run(rescanner.scan_once())
    assert [d.allow_multiple_allocations for d in published[0]] == [False, False]  # 2 x 23034Mi < 2 x 12Gi
    assert [r[1] for r in reports] == ["DiscoveryWarning", "DiscoveryWarning"]  # once per GPU, not per scan

    rescanner = Rescanner("fake:dgx-h100", publish, sharing=ConsumableCapacity(GI, 2))
    assert asyncio.run(rescanner.scan_once())
    expected, _ = share_devices(scan(load_nvml("fake:dgx-h100")).devices, ConsumableCapacity(GI, 2))
    assert published[-1] == expected and all(d.allow_multiple_allocations for d in expected)


# -- the probe -----------------------------------------------------------------------------------

def test_the_probe_slice_is_this_nodes_and_its_answer_is_read_from_the_stored_object() -> None:
    probe = consumable.probe_slice("gpu.gpudra.io", "node-1")
    assert probe["spec"]["nodeName"] == "node-1" and probe["spec"]["driver"] == "gpu.gpudra.io"
    assert "generateName" in probe["metadata"]  # a dry run never collides with a real slice
    assert consumable.keeps_sharing(probe)
    dropped = {"spec": {"devices": [{"name": "probe", "capacity": {"memory": {"value": "2Gi"}}}]}}
    assert not consumable.keeps_sharing(dropped)
