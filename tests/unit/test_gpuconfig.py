"""The GpuConfig API: strict decoding that names the field, and which config a request gets (class
configs, then claim configs, the last one winning whole). The examples are shared with the
admission policy's test (tests/gpuconfig_cases.py), docs/sharing.md's included."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpuconfig_cases import BAD, GOOD, Bad, doc_examples, doc_objects, gpu_config, mps, per_device

from gpudra_core import limits
from gpudra_driver.gpuconfig import (DEFAULT, MAX_FIELDS, MAX_PER_DEVICE, MEMORY_RULE, QUANTITY_FORM, GpuConfig,
                                     GpuConfigError, Interval, Mps, MpsSettings, Sharing, Strategy, TimeSlicing,
                                     config_for_request, decode)

DRIVER = "gpu.gpudra.io"
GiB, MiB = 2**30, 2**20
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("parameters", GOOD.values(), ids=GOOD.keys())
def test_good_examples_decode(parameters: Any) -> None:
    config = decode(parameters)
    sharing = config.sharing
    # The strategy's block is there exactly when it is the strategy (defaults filled in).
    assert (sharing.time_slicing is not None) == (sharing.strategy is Strategy.TIME_SLICING)
    assert (sharing.mps is not None) == (sharing.strategy is Strategy.MPS)


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_examples_are_refused_naming_the_field(case: Bad) -> None:
    with pytest.raises(GpuConfigError) as caught:
        decode(case.parameters)
    assert (caught.value.field, caught.value.reason) == (case.field, case.reason)
    assert str(caught.value).startswith(f"{case.field}: {case.reason}")


def test_the_docs_examples_decode() -> None:
    kinds = {o["kind"] for o in doc_objects()}
    assert {"DeviceClass", "ResourceClaim", "ResourceClaimTemplate"} <= kinds  # class and claim configs shown
    examples = doc_examples()
    assert len(examples) >= 3
    strategies = {decode(parameters).sharing.strategy for parameters in examples}
    assert strategies == set(Strategy)


def test_decoded_values() -> None:
    assert decode(gpu_config()) == DEFAULT == GpuConfig(Sharing(Strategy.EXCLUSIVE))
    assert decode(gpu_config({"strategy": "TimeSlicing"})).sharing == Sharing(
        Strategy.TIME_SLICING, time_slicing=TimeSlicing(Interval.DEFAULT))
    assert decode(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})).sharing.time_slicing \
        == TimeSlicing(Interval.LONG)
    config = decode(mps(activeThreadPercentage=50, pinnedMemoryLimit="10Gi",
                        perDevice={"gpu-1": {"pinnedMemoryLimit": "1.5Gi"}, "GPU-abc": {"activeThreadPercentage": 20}}))
    assert config.sharing.mps == Mps(MpsSettings(50, 10 * GiB), {"gpu-1": MpsSettings(None, 3 * GiB // 2),
                                                                 "GPU-abc": MpsSettings(20, None)})
    assert decode(mps(pinnedMemoryLimit=1048576)).sharing.mps == Mps(MpsSettings(None, MiB))
    # Whole bytes, rounded up as apimachinery's Quantity.Value() does.
    assert decode(mps(pinnedMemoryLimit="1048576.5")).sharing.mps == Mps(MpsSettings(None, MiB + 1))


def test_limits_are_whole_bytes_within_int64() -> None:
    def limit(value: Any) -> int | None:
        config = decode(mps(pinnedMemoryLimit=value)).sharing.mps
        assert config is not None
        return config.defaults.pinned_memory_limit

    assert limit("9223372036854775807") == limits.INT64_MAX
    assert limit("16Ei") == limit("8Ei") == limits.INT64_MAX  # ParseQuantity's cap of BinarySI values
    assert limit("2e0006") == 2 * 10**6 and limit("1Mi") == MiB
    assert limit("0.5Gi") == GiB // 2 and limit(" 1Gi".strip()) == GiB


# --- bounded work: every input a tenant can write costs the same small time to decode -----------
def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


HOSTILE: dict[str, Callable[[], Any]] = {
    # each of these took seconds (or forever) to build an integer from, with the node's lock held
    "limit 1e300000": lambda: mps(pinnedMemoryLimit="1e300000"),
    "limit 1e2147483647": lambda: mps(pinnedMemoryLimit="1e2147483647"),
    "per-device limit 1e1000000": lambda: per_device(**{"gpu-0": {"pinnedMemoryLimit": "1e1000000"}}),
    "limit of a million digits": lambda: mps(pinnedMemoryLimit="7" * 10**6),
    "limit of a million digits and a suffix": lambda: mps(pinnedMemoryLimit="7" * 10**6 + "Ei"),
    "percentage of 300,000 digits": lambda: mps(activeThreadPercentage=10**300000),
    "perDevice of 100,000 entries": lambda: per_device(**{f"gpu-{i}": {} for i in range(100_000)}),
    "100,000 unknown fields": lambda: gpu_config(**{f"x{i}": i for i in range(100_000)}),
    "100,000 unknown fields in an entry": lambda: per_device(**{"gpu-0": {f"x{i}": i for i in range(100_000)}}),
    "sharing nested 100,000 deep": lambda: gpu_config(nested(100_000)),
    "strategy a deep list": lambda: gpu_config({"strategy": nested(100_000)}),
    "strategy a wide object": lambda: gpu_config({"strategy": {f"k{i}": "v" * 100 for i in range(100_000)}}),
    "apiVersion of ten million characters": lambda: gpu_config(apiVersion="v" * 10**7),
    "interval of ten million characters": lambda: gpu_config({"strategy": "TimeSlicing",
                                                              "timeSlicing": {"interval": "\u00e9" * 10**7}}),
    "per-device key of a million characters": lambda: per_device(**{"gpu-" + "0" * 10**6: {}}),
}
DECODE_BUDGET_S = 0.010


@pytest.mark.parametrize("make", HOSTILE.values(), ids=HOSTILE.keys())
def test_any_input_decodes_in_under_10ms_to_a_config_error(make: Callable[[], Any]) -> None:
    """CPU time of this thread (other processes on the machine do not count), the best of three."""
    parameters = make()
    spent = []
    for _ in range(3):
        started = time.thread_time()
        with pytest.raises(GpuConfigError) as caught:
            decode(parameters)
        spent.append(time.thread_time() - started)
        assert len(str(caught.value)) < 400  # the value shown is cut short
    assert min(spent) < DECODE_BUDGET_S, f"{min(spent) * 1000:.1f} ms"


def test_the_bounds_are_the_policys() -> None:
    """The admission policy states the same bounds: the quantity's form, its length, the fields
    per object, the entries of perDevice (tests/integration/test_claim_config_admission.py holds
    their verdicts to the same examples)."""
    policy = (REPO / "manifests" / "base" / "claim-config-admission-policy.yaml").read_text()
    assert f'.matches("{QUANTITY_FORM}")' in policy
    assert f"pinnedMemoryLimit.size() <= {limits.MAX_QUANTITY_LENGTH} &&" in policy
    assert f"o.v.size() > {MAX_FIELDS})" in policy and f"o.v.size() <= {MAX_FIELDS} &&" in policy
    assert f"o.v.size() > {MAX_PER_DEVICE})" in policy and f"o.v.size() <= {MAX_PER_DEVICE})" in policy
    assert MEMORY_RULE in policy
    # RE2 (the API server's CEL) and Python read the pattern alike: ASCII classes, no lookaround.
    assert not re.search(r"\\[dswb]|\(\?", QUANTITY_FORM)


def test_intervals_are_nvidia_smis_timeslice_values() -> None:
    assert [(i.value, i.nvidia_smi_value) for i in Interval] == [("Default", 0), ("Short", 1), ("Medium", 2),
                                                                  ("Long", 3)]


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.sharing = Sharing(Strategy.MPS)  # type: ignore[misc]


def test_errors_show_what_was_given() -> None:
    with pytest.raises(GpuConfigError, match=r'^sharing\.mps\.activeThreadPercentage: must be an integer between '
                                              r'1 and 100, got "x"$'):
        decode(mps(activeThreadPercentage="x"))
    with pytest.raises(GpuConfigError, match=r"^sharing\.timeSlicing: allowed only with strategy TimeSlicing, "
                                              r"got strategy MPS$"):
        decode(gpu_config({"strategy": "MPS", "timeSlicing": {}}))
    with pytest.raises(GpuConfigError, match=r"^parameters: must be an object, got \[1\]$"):
        decode([1])
    with pytest.raises(GpuConfigError, match=r"^apiVersion: must be gpudra.io/v1alpha1$"):
        decode({})  # nothing given: nothing to show
    with pytest.raises(GpuConfigError, match=r'got "a{56}\.\.\.$'):
        decode(mps(pinnedMemoryLimit="a" * 100))  # long values cut short


# --- MPS settings per device ------------------------------------------------------------------------
DEVICES = [("gpu-0", "GPU-aaa"), ("gpu-1", "GPU-bbb")]


def settings(**fields: Any) -> Mps:
    mps_config = decode(mps(**fields)).sharing.mps
    assert mps_config is not None
    return mps_config


def test_each_device_gets_the_defaults_and_its_overrides_field_by_field() -> None:
    config = settings(activeThreadPercentage=50, pinnedMemoryLimit="10Gi",
                      perDevice={"gpu-1": {"pinnedMemoryLimit": "20Gi"}})
    assert config.for_devices(DEVICES) == {"gpu-0": MpsSettings(50, 10 * GiB), "gpu-1": MpsSettings(50, 20 * GiB)}
    by_uuid = settings(perDevice={"GPU-aaa": {"activeThreadPercentage": 30}})
    assert by_uuid.for_devices(DEVICES) == {"gpu-0": MpsSettings(30, None), "gpu-1": MpsSettings(None, None)}
    assert settings().for_devices(DEVICES) == {"gpu-0": MpsSettings(), "gpu-1": MpsSettings()}


def test_a_per_device_key_must_name_one_device_of_the_request() -> None:
    with pytest.raises(GpuConfigError, match=r"^sharing\.mps\.perDevice\.gpu-7: names no device of this request, "
                                              r"which got gpu-0 \(GPU-aaa\), gpu-1 \(GPU-bbb\)$"):
        settings(perDevice={"gpu-7": {}}).for_devices(DEVICES)
    with pytest.raises(GpuConfigError, match=r"^sharing\.mps\.perDevice\.0: names no device"):
        settings(perDevice={"0": {}}).for_devices(DEVICES)  # NVIDIA's index keys are not ours
    with pytest.raises(GpuConfigError, match=r"^sharing\.mps\.perDevice\.GPU-bbb: names device gpu-1 again$"):
        settings(perDevice={"gpu-1": {}, "GPU-bbb": {}}).for_devices(DEVICES)


# --- which config a request gets -----------------------------------------------------------------
def entry(source: str, parameters: Any, requests: list[str] | None = None, driver: str = DRIVER) -> dict[str, Any]:
    config: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        config["requests"] = requests
    return config


TS = gpu_config({"strategy": "TimeSlicing"})
LONG = gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})
MPS_LIMIT = mps(pinnedMemoryLimit="10Gi")
MPS_PERCENT = mps(activeThreadPercentage=50)
BROKEN = gpu_config({"strategy": "Sometimes"})


def test_no_config_of_ours_is_exclusive() -> None:
    assert config_for_request([], DRIVER, "gpu") == DEFAULT
    # Other drivers' configs are theirs, valid for us or not.
    others = [entry("FromClaim", {"anything": True}, driver="gpu.nvidia.com"), entry("FromClass", TS, driver="x.io")]
    assert config_for_request(others, DRIVER, "gpu") == DEFAULT


def test_a_class_config_applies_unless_the_claim_overrides_it() -> None:
    # The scheduler lists a class's configs for the request it serves (requests: [<request>]).
    assert config_for_request([entry("FromClass", TS, ["gpu"])], DRIVER, "gpu") == decode(TS)
    assert config_for_request([entry("FromClass", TS, ["gpu"])], DRIVER, "other") == DEFAULT
    configs = [entry("FromClass", TS, ["gpu"]), entry("FromClaim", MPS_LIMIT)]
    assert config_for_request(configs, DRIVER, "gpu") == decode(MPS_LIMIT)


def test_claim_configs_win_over_class_configs_wherever_they_are_listed() -> None:
    configs = [entry("FromClaim", LONG), entry("FromClass", TS)]
    assert config_for_request(configs, DRIVER, "gpu") == decode(LONG)


def test_the_last_config_wins_as_a_whole_object() -> None:
    claim = [entry("FromClaim", MPS_LIMIT), entry("FromClaim", MPS_PERCENT)]
    assert config_for_request(claim, DRIVER, "gpu") == decode(MPS_PERCENT)  # no limit merged in
    classes = [entry("FromClass", MPS_LIMIT), entry("FromClass", TS)]
    assert config_for_request(classes, DRIVER, "gpu") == decode(TS)


@pytest.mark.parametrize(("requests", "request_name", "applies"), [
    (None, "gpu", True), ([], "gpu", True), (["gpu"], "gpu", True), (["a", "gpu"], "gpu", True),
    (["gpu"], "gpu/large", True),  # a main request covers its subrequests
    (["gpu/large"], "gpu/large", True), (["gpu/large"], "gpu/small", False), (["gpu/large"], "gpu", False),
    (["gpu"], "gpu2", False), (["gpu"], "gpu2/large", False), (["other"], "gpu", False),
])
def test_request_matching(requests: list[str] | None, request_name: str, applies: bool) -> None:
    expected = decode(TS) if applies else DEFAULT
    assert config_for_request([entry("FromClaim", TS, requests)], DRIVER, request_name) == expected


def test_configs_for_other_requests_are_not_decoded() -> None:
    configs = [entry("FromClaim", BROKEN, ["other"]), entry("FromClaim", TS, ["gpu"])]
    assert config_for_request(configs, DRIVER, "gpu") == decode(TS)


def test_an_overridden_config_must_still_be_valid() -> None:
    configs = [entry("FromClass", BROKEN), entry("FromClaim", TS)]
    with pytest.raises(GpuConfigError, match=r"^status\.allocation\.devices\.config\[0\] \(FromClass\): "
                                              r"sharing\.strategy: must be one of"):
        config_for_request(configs, DRIVER, "gpu")


def test_errors_name_the_config_and_its_source() -> None:
    configs = [entry("FromClass", TS), entry("FromClaim", TS, driver="x.io"), entry("FromClaim", MPS_LIMIT),
               entry("FromClaim", mps(activeThreadPercentage=0))]
    with pytest.raises(GpuConfigError) as caught:
        config_for_request(configs, DRIVER, "gpu")
    assert str(caught.value) == ("status.allocation.devices.config[3] (FromClaim, spec.devices.config[2]): "
                                 "sharing.mps.activeThreadPercentage: must be an integer between 1 and 100, got 0")
    assert (caught.value.field, caught.value.reason) == ("sharing.mps.activeThreadPercentage",
                                                         "must be an integer between 1 and 100")


def test_an_unknown_source_is_an_error_and_a_config_without_opaque_is_skipped() -> None:
    with pytest.raises(GpuConfigError, match=r'^status\.allocation\.devices\.config\[0\]: source: must be FromClass '
                                              r'or FromClaim, got "FromElsewhere"$'):
        config_for_request([{"source": "FromElsewhere", "opaque": {"driver": DRIVER, "parameters": TS}}],
                           DRIVER, "gpu")
    # A configuration kind newer than this code names no driver: nobody's to claim.
    assert config_for_request([{"source": "FromClaim", "future": {}}], DRIVER, "gpu") == DEFAULT


def test_the_mps_sample_claim_decodes_to_mps_with_its_limits() -> None:
    import yaml
    from pathlib import Path

    from gpudra_driver.gpuconfig import Strategy, decode

    sample = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "claim-mps.yaml"
    claim, *pods = list(yaml.safe_load_all(sample.read_text()))
    (config,) = claim["spec"]["devices"]["config"]
    decoded = decode(config["opaque"]["parameters"])
    assert decoded.sharing.strategy is Strategy.MPS and decoded.sharing.mps is not None
    assert decoded.sharing.mps.defaults.active_thread_percentage == 50
    assert decoded.sharing.mps.defaults.pinned_memory_limit == 16 * 2**30
    assert {p["spec"]["resourceClaims"][0]["resourceClaimName"] for p in pods} == {claim["metadata"]["name"]}
