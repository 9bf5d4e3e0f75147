"""The GpuConfig API: strict decoding that names the field, and which config a request gets (class
configs, then claim configs, the last one winning whole). The examples are shared with the
admission policy's test (tests/gpuconfig_cases.py), docs/sharing.md's included."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from gpuconfig_cases import BAD, GOOD, Bad, doc_examples, doc_objects, gpu_config, mps

from gpudra_driver.gpuconfig import (DEFAULT, GpuConfig, GpuConfigError, Interval, Mps, MpsSettings, Sharing,
                                     Strategy, TimeSlicing, config_for_request, decode)

DRIVER = "gpu.gpudra.io"
GiB, MiB = 2**30, 2**20


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
