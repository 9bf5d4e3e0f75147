"""The GpuConfig admission policy (manifests/base/claim-config-admission-policy.yaml) on the real API
server: it type-checks clean; good configs pass in claims, templates and classes, the docs'
examples included; every bad example of tests/gpuconfig_cases.py is refused with exactly the
field and reason the agent's decoder gives (the unit tests decode the same examples), which also
proves no wrong type makes the CEL fail, since the policy fails open; other drivers' configs are
left alone; updates are checked only when they change the configs; and the worst configs a
tenant can write are refused in bounded time (the policy neither fails open nor makes the API
server compute what the decoder refuses to).

Each test names its own driver, with a GpuDraConfig of it created for the test: the API server
reads GpuDraConfigs through an informer, so a test waits until its driver is enforced."""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from admissionpolicy import type_check_warnings
from gpuconfig_cases import BAD, DOC_DRIVER, GOOD, doc_objects, gpu_config, mps, opaque_configs, policy_error
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core import limits
from gpudra_driver.gpuconfig import GpuConfigError, decode
from gpudra_core.kubeapi import Kube, Obj, error_message, resource_type
from gpudra_dev.localcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
POLICY_FILE = REPO / "manifests" / "base" / "claim-config-admission-policy.yaml"
POLICY_NAME = "gpudra-claim-config"
POLICY = resource_type("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy")
BINDING = resource_type("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding")
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
ALLOWED = "allowed"
NVIDIA_CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                 "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def policy(kube: Kube, crd_installed: Obj) -> AsyncIterator[Obj]:
    """The shipped policy and binding, applied as they are; removed afterwards."""
    policy, binding = yaml.safe_load_all(POLICY_FILE.read_text())
    await kube.apply(policy)
    await kube.apply(binding)
    try:
        yield policy
    finally:
        await kube.delete(BINDING, POLICY_NAME)
        await kube.delete(POLICY, POLICY_NAME)


@pytest.fixture
def suffix() -> str:
    return secrets.token_hex(3)


DriverFactory = Callable[[], Awaitable[str]]


@pytest_asyncio.fixture(loop_scope="session")
async def driver(kube: Kube, policy: Obj, namespace: str) -> AsyncIterator[DriverFactory]:
    """Makes a driver name of gpudra's: a GpuDraConfig naming it, once the policy enforces it."""
    created: list[str] = []

    async def make() -> str:
        name = f"claim-config-{secrets.token_hex(3)}"
        driver_name = f"{name}.gpudra.io"
        await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                           "spec": {"driverName": driver_name, "agent": {"namespace": namespace}}})
        created.append(name)
        probe = claim(namespace, "probe", [config(driver_name, gpu_config(kind="Nope"))])
        await wait_for(lambda: refused(kube.create(probe, dry_run=True)), timeout=30,
                       what=f"the policy to check driver {driver_name}'s configs")
        return driver_name

    try:
        yield make
    finally:
        for name in created:
            await kube.delete(CONFIG, name)


# --- objects ----------------------------------------------------------------------------------------
def config(driver: str, parameters: Any, requests: list[str] | None = None) -> Obj:
    entry: Obj = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry


REQUESTS = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpudra.io"}}]


def claim(namespace: str, name: str, configs: list[Obj]) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": REQUESTS, "config": configs}}}


def template(namespace: str, name: str, configs: list[Obj]) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": REQUESTS, "config": configs}}}}


def device_class(name: str, configs: list[Obj]) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": "true"}}], "config": configs}}


async def verdict(call: Awaitable[Any]) -> str:
    """ALLOWED, or the refusal's message."""
    try:
        await call
    except ApiException as error:
        return error_message(error)
    return ALLOWED


async def refused(call: Awaitable[Any]) -> str | None:
    got = await verdict(call)
    return None if got == ALLOWED else got


def refusal(driver: str, *errors: str) -> str:
    return (f"ValidatingAdmissionPolicy '{POLICY_NAME}' with binding '{POLICY_NAME}' denied request: "
            f"invalid GpuConfig for driver {driver}: " + "; ".join(errors))


# --- the policy itself ------------------------------------------------------------------------------
async def test_the_policy_type_checks_clean(kube: Kube, policy: Obj, suffix: str) -> None:
    """Against ResourceClaim, ResourceClaimTemplate and DeviceClass v1 and the GpuDraConfig schema.
    A copy reading a field GpuDraConfigs lack gets a warning: the checker does look."""
    assert await type_check_warnings(kube, f"check-{suffix}", policy["spec"]) == []
    typo = json.loads(json.dumps(policy["spec"]).replace("params.spec.driverName", "params.spec.driver"))
    warnings = await type_check_warnings(kube, f"typo-{suffix}", typo)
    assert warnings and all("undefined field 'driver'" in w["warning"] for w in warnings), warnings


# --- verdicts ---------------------------------------------------------------------------------------
async def test_good_configs_are_admitted_in_claims_templates_and_classes(
        kube: Kube, driver: DriverFactory, namespace: str, suffix: str) -> None:
    mine = await driver()
    configs = [config(mine, parameters) for parameters in GOOD.values()]
    assert len(configs) <= 32  # the API's limit per claim
    assert await verdict(kube.create(claim(namespace, "good", configs), dry_run=True)) == ALLOWED
    assert await verdict(kube.create(template(namespace, "good", configs), dry_run=True)) == ALLOWED
    assert await verdict(kube.create(device_class(f"good-{suffix}", configs), dry_run=True)) == ALLOWED


async def test_each_bad_config_is_refused_with_the_decoders_field_and_reason(
        kube: Kube, driver: DriverFactory, namespace: str) -> None:
    """Each bad example third in a claim, after a good config of ours and another driver's: the
    message names exactly that config and field, for the reason the decoder gives, and nothing else."""
    mine = await driver()
    mismatches = []
    for name, case in BAD.items():
        with pytest.raises(GpuConfigError) as decoded:
            decode(case.parameters)
        at = "spec.devices.config[2].opaque.parameters"
        expected = refusal(mine, policy_error(at, decoded.value.field, decoded.value.reason))
        configs = [config(mine, GOOD["mps, per device by name and UUID"]), config("gpu.nvidia.com", NVIDIA_CONFIG),
                   config(mine, case.parameters)]
        got = await verdict(kube.create(claim(namespace, "bad", configs), dry_run=True))
        if not got.endswith(expected):
            mismatches.append(f"{name}: expected ...{expected}\n  got {got}")
    assert mismatches == []


async def test_templates_and_classes_are_refused_at_their_paths(
        kube: Kube, driver: DriverFactory, namespace: str, suffix: str) -> None:
    mine = await driver()
    bad = [config(mine, gpu_config()), config(mine, gpu_config({"strategy": "MPS", "mps": {"perDevice": 5}}))]
    got = await verdict(kube.create(template(namespace, "bad", bad), dry_run=True))
    assert got.endswith(refusal(mine, "spec.spec.devices.config[1].opaque.parameters.sharing.mps.perDevice: "
                                      "must be an object")), got
    got = await verdict(kube.create(device_class(f"bad-{suffix}", bad), dry_run=True))
    assert got.endswith(refusal(mine, "spec.config[1].opaque.parameters.sharing.mps.perDevice: must be an object")), got


async def test_one_message_lists_every_broken_field(kube: Kube, driver: DriverFactory, namespace: str) -> None:
    mine = await driver()
    configs = [config(mine, gpu_config({"strategy": "MPS", "mps": {"activeThreadPercentage": 0, "x": 1}})),
               config(mine, {"apiVersion": "v1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing",
                                                                                 "timeSlicing": {"interval": 3}}})]
    got = await verdict(kube.create(claim(namespace, "many", configs), dry_run=True))
    assert got.endswith(refusal(
        mine,
        "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: "
        "must be an integer between 1 and 100",
        "spec.devices.config[0].opaque.parameters.sharing.mps.x: unknown field",
        "spec.devices.config[1].opaque.parameters.apiVersion: must be gpudra.io/v1alpha1",
        "spec.devices.config[1].opaque.parameters.sharing.timeSlicing.interval: "
        "must be one of Default, Short, Medium, Long")), got


async def test_only_the_gpudraconfigs_drivers_are_checked_each_by_its_own_config(
        kube: Kube, driver: DriverFactory, namespace: str, suffix: str) -> None:
    first, second = await driver(), await driver()
    broken = gpu_config({"strategy": "Always"})
    # A GpuConfig-shaped config for a driver no GpuDraConfig names, and NVIDIA's own: not ours.
    others = [config(f"unknown-{suffix}.gpudra.io", broken), config("gpu.nvidia.com", NVIDIA_CONFIG),
              config(first, gpu_config()), config(second, gpu_config())]
    assert await verdict(kube.create(claim(namespace, "others", others), dry_run=True)) == ALLOWED
    at = "spec.devices.config[1].opaque.parameters.sharing.strategy: must be one of Exclusive, TimeSlicing, MPS"
    for refused_driver in (first, second):
        got = await verdict(kube.create(claim(namespace, "one", [config(first, gpu_config()),
                                                                  config(refused_driver, broken)]), dry_run=True))
        assert got.endswith(refusal(refused_driver, at)), got


async def test_the_docs_examples_are_admitted(kube: Kube, driver: DriverFactory, namespace: str, suffix: str) -> None:
    """docs/sharing.md's classes, claims and templates with configs of gpudra's driver (the unit
    tests decode the same ones)."""
    mine = await driver()
    examples = [obj for obj in doc_objects() if any(o["driver"] == DOC_DRIVER for o in opaque_configs(obj))]
    assert {obj["kind"] for obj in examples} == {"DeviceClass", "ResourceClaim", "ResourceClaimTemplate"}
    for example in examples:
        obj = copy.deepcopy(example)
        for opaque in opaque_configs(obj):
            if opaque["driver"] == DOC_DRIVER:
                opaque["driver"] = mine
        if obj["kind"] == "DeviceClass":
            obj["metadata"]["name"] += f"-{suffix}"
        else:
            obj["metadata"]["namespace"] = namespace
        assert await verdict(kube.create(obj, dry_run=True)) == ALLOWED, obj


async def test_updates_are_checked_only_when_they_change_the_configs(
        kube: Kube, driver: DriverFactory, namespace: str, suffix: str) -> None:
    """A claim and a class written before their driver's GpuDraConfig existed keep working: the
    finalizer and label updates that allocation and GitOps make are admitted. A class update that
    changes its configs is checked.

    The class is created as this client writes JSON (with spaces) and its labels merge-patched,
    which re-encodes the stored parameters without them: from 1.37 the API server gives CEL the
    typed objects, whose equality compares a RawExtension's bytes, so the policy compares each
    config's parameters as JSON values (this test failed on 1.37 while it compared the configs)."""
    later = f"later-{suffix}.gpudra.io"
    broken = [config(later, gpu_config({"strategy": "MPS", "mps": {"activeThreadPercentage": 0}}))]
    class_name = f"early-{suffix}"
    await kube.create(claim(namespace, "early", broken))
    await kube.create(device_class(class_name, broken))
    try:
        await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                           "metadata": {"name": f"later-{suffix}"},
                           "spec": {"driverName": later, "agent": {"namespace": namespace}}})
        message = refusal(later, "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: "
                                 "must be an integer between 1 and 100")
        await wait_for(lambda: refused(kube.create(claim(namespace, "again", broken), dry_run=True)), timeout=30,
                       what=f"the policy to check {later}")
        assert (await verdict(kube.create(claim(namespace, "again", broken), dry_run=True))).endswith(message)

        # As the scheduler and the resourceclaim controller do it: read, change the metadata, update.
        # (A patch re-encodes the parameters with sorted keys, which the claim's immutable spec
        # refuses before admission whenever they were written in another order.)
        for finalizers in (["example.com/keep"], []):
            live = await kube.get(CLAIM, "early", namespace)
            assert live is not None
            live["metadata"].update(finalizers=finalizers, labels={"a": "b"})
            await kube.request("PUT", CLAIM.path(namespace, "early"), body=live)
        await kube.patch(DEVICE_CLASS, class_name, {"metadata": {"labels": {"a": "b"}}})

        changed = [config(later, gpu_config({"strategy": "Sometimes"}))]
        got = await verdict(kube.patch(DEVICE_CLASS, class_name, {"spec": {"config": changed}}))
        assert got.endswith(refusal(later, "spec.config[0].opaque.parameters.sharing.strategy: "
                                           "must be one of Exclusive, TimeSlicing, MPS")), got
        fixed = [config(later, gpu_config({"strategy": "TimeSlicing"}))]
        assert await verdict(kube.patch(DEVICE_CLASS, class_name, {"spec": {"config": fixed}})) == ALLOWED
    finally:
        await kube.delete(CLAIM, "early", namespace)
        await kube.delete(DEVICE_CLASS, class_name)
        await kube.delete(CONFIG, f"later-{suffix}")


# --- bounded work ------------------------------------------------------------------------------------
def entries(value: Any, count: int = 32, key: str = "gpu-{}") -> dict[str, Any]:
    return {key.format(i): value for i in range(count)}


def unknown(count: int) -> dict[str, Any]:
    return {f"unknown-field-{i:02}": 0 for i in range(count)}


# Each is one config's parameters, under the API's 10 KiB; a claim holds 32 of them.
WORST: dict[str, Obj] = {
    # ParseQuantity computes 10**exponent: minutes for each of these before the policy bounded them
    "huge exponents": mps(pinnedMemoryLimit="1e2000000000", perDevice=entries({"pinnedMemoryLimit": "1e2000000000"})),
    "huge negative exponents": mps(pinnedMemoryLimit="1e-2000000000",
                                   perDevice=entries({"pinnedMemoryLimit": "-1e-2000000000"})),
    "exponents of 300000": mps(pinnedMemoryLimit="1e300000", perDevice=entries({"pinnedMemoryLimit": "1e300000"})),
    "a long digit string": mps(pinnedMemoryLimit="9" * 9000),
    "long digit strings per device": mps(perDevice=entries({"pinnedMemoryLimit": "9" * 250})),
    # every object at its 8 fields, each field wrong: about 300 errors per config
    "every error the bounds allow": gpu_config(
        {"strategy": "MPS", **unknown(6), "mps": {
            "activeThreadPercentage": 0, "pinnedMemoryLimit": "1e99", **unknown(5),
            "perDevice": entries({"activeThreadPercentage": 101, "pinnedMemoryLimit": "x", **unknown(6)},
                                 key="Bad_{}")}},
        **unknown(5)),
    "a wide perDevice": mps(perDevice=entries({}, count=700, key="g{}")),
    "a wide object": gpu_config({"strategy": "MPS", **entries(0, count=900, key="f{}")}),
    "a key of 9000 characters": mps(perDevice={"k" * 9000: {"pinnedMemoryLimit": "1e2000000000"}}),
    # (the client recurses to send them, so not deeper; the policy never walks a value it does not know)
    "deep values": gpu_config({"strategy": "MPS", "deep": json.loads("[" * 200 + "]" * 200)}),
}
ADMISSION_BUDGET_S = 2.0  # the policy's own CEL budget is about 1 s of the API server's CPU


async def test_the_worst_configs_are_refused_in_bounded_time(
        kube: Kube, driver: DriverFactory, namespace: str) -> None:
    mine = await driver()
    baseline = [config(mine, GOOD["mps, per device by name and UUID"])] * 32
    started = time.perf_counter()
    assert await verdict(kube.create(claim(namespace, "baseline", baseline), dry_run=True)) == ALLOWED
    times = {"32 good configs": time.perf_counter() - started}
    admitted = []
    for name, parameters in WORST.items():
        assert len(json.dumps(parameters)) <= limits.MAX_OPAQUE_PARAMETERS_LENGTH, name
        with pytest.raises(GpuConfigError):
            decode(parameters)
        started = time.perf_counter()
        got = await verdict(kube.create(claim(namespace, "worst", [config(mine, parameters)] * 32), dry_run=True))
        times[name] = time.perf_counter() - started
        if got == ALLOWED or "denied request" not in got:  # the policy failed open, or something else refused it
            admitted.append(f"{name}: {got[:300]}")
    print("\nadmission times (32 configs each): " + ", ".join(f"{n} {t * 1000:.0f} ms" for n, t in times.items()))
    assert admitted == []
    worst = max(times, key=lambda n: times[n])
    assert times[worst] < ADMISSION_BUDGET_S, f"{worst}: {times[worst]:.2f} s"
