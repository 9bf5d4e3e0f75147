"""The operator's reading of the API server's answer to its consumable-capacity probe (pure); the
probe itself runs against real API servers in tests/integration/test_consumable_capacity.py."""

from __future__ import annotations

from gpudra_operator import features

# What a 1.35 API server (DRAConsumableCapacity off) answers the probe, verbatim.
REFUSAL_1_35 = ("DeviceClass.resource.k8s.io \"gpudra-consumable-capacity-probe-vcjcm\" is invalid: "
                "spec.selectors[0].cel.expression: Invalid value: \"device.allowMultipleAllocations\": compilation "
                "failed: ERROR: <input>:1:7: undefined field 'allowMultipleAllocations'\n"
                " | device.allowMultipleAllocations\n | ......^")


def test_the_probe_is_a_dry_run_class_reading_the_field() -> None:
    probe = features.consumable_capacity_probe()
    assert probe["kind"] == "DeviceClass" and "generateName" in probe["metadata"]
    assert probe["spec"]["selectors"] == [{"cel": {"expression": "device.allowMultipleAllocations"}}]


def test_only_a_refusal_naming_the_undefined_field_means_the_gate_is_off() -> None:
    assert features.refused_for_the_field(422, REFUSAL_1_35)
    assert not features.refused_for_the_field(422, "spec.selectors[0].cel.expression: too complex")
    assert not features.refused_for_the_field(403, REFUSAL_1_35)


def test_the_message_names_the_gate_the_version_and_what_to_do() -> None:
    message = features.unsupported_message("v1.35.4")
    assert "spec.sharing.consumableCapacity is not in effect" in message
    assert "(Kubernetes v1.35.4) has the DRAConsumableCapacity feature gate off" in message
    assert "The agents publish whole GPUs, one claim each" in message
    assert "Upgrade to 1.36 or later, or enable DRAConsumableCapacity" in message
