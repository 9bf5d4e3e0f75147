from __future__ import annotations

from pathlib import Path

import pytest

from gpudra_core import limits
from gpudra_core.devicemodel import (
    ATTRIBUTES,
    CAPACITIES,
    AttrValue,
    Device,
    attribute_names,
    attribute_type,
    capacity_names,
    cuda_version_from_int,
    gpu_device_name,
    is_capacity,
    mig_device_name,
    normalize_pci_bus_id,
    normalize_version,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "devices.md"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("productName", "string"),
        ("uuid", "string"),
        ("cudaComputeCapability", "version"),
        ("driverVersion", "version"),
        ("index", "int"),
        ("numaNode", "int"),
        ("resource.kubernetes.io/pciBusID", "string"),
        ("gpu.gpudra.io/productName", "string"),  # qualified with the driver's own domain
        ("gpu.gpudra.io/parentUUID", "string"),
        ("memory", None),  # a capacity, not an attribute
        ("pciBusID", None),  # only exists in the standard domain
        ("resource.kubernetes.io/uuid", None),  # not a standard attribute
        ("gpu.gpudra.io/resource.kubernetes.io/pciBusID", None),
        ("productname", None),  # names are case-sensitive, as in CEL
        ("nope", None),
    ],
)
def test_attribute_type(name: str, expected: str | None) -> None:
    assert attribute_type(name) == expected


def test_attribute_type_restricted_to_the_driver_domain() -> None:
    assert attribute_type("gpu.gpudra.io/uuid", driver="gpu.gpudra.io") == "string"
    assert attribute_type("gpu.nvidia.com/uuid", driver="gpu.gpudra.io") is None
    assert attribute_type("resource.kubernetes.io/pciBusID", driver="gpu.gpudra.io") == "string"


def test_capacities_by_device_type() -> None:
    assert capacity_names("gpu") == ["memory", "shares"]  # shares: only with consumable capacity
    assert capacity_names("mig") == [
        "memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines",
        "computeSlices",  # dynamic MIG placements only
    ]
    assert capacity_names() == list(CAPACITIES)
    assert is_capacity("memory") and is_capacity("gpu.gpudra.io/memory", driver="gpu.gpudra.io")
    assert not is_capacity("other.io/memory", driver="gpu.gpudra.io")
    assert not is_capacity("productName")


def test_attribute_sets_per_device_type() -> None:
    assert "minor" in attribute_names("gpu") and "minor" not in attribute_names("mig")
    assert {"profile", "parentUUID", "parentIndex", "gpuInstanceId"} <= set(attribute_names("mig"))
    assert not {"profile", "parentUUID"} & set(attribute_names("gpu"))


@pytest.mark.parametrize("device_type", ["gpu", "mig"])
def test_a_full_device_of_each_type_fits_the_per_device_limit(device_type: str) -> None:
    total = len(attribute_names(device_type)) + len(capacity_names(device_type))  # type: ignore[arg-type]
    assert total <= limits.MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE


def test_every_declared_name_is_a_valid_qualified_name() -> None:
    for name in [*ATTRIBUTES, *CAPACITIES]:
        limits.check_qualified_name(name, name)


def test_docs_describe_every_attribute_and_capacity() -> None:
    text = DOCS.read_text()
    missing = [n for n in [*ATTRIBUTES, *CAPACITIES] if f"`{n}`" not in text]
    assert missing == []


def test_attr_value_keeps_bool_and_int_apart() -> None:
    assert AttrValue.of_bool(True).to_api() == {"bool": True}
    assert AttrValue.of_int(3).to_api() == {"int": 3}
    assert AttrValue.of_version("1.2.3").to_api() == {"version": "1.2.3"}
    assert AttrValue.of_string("x").to_api() == {"string": "x"}
    with pytest.raises(TypeError):
        AttrValue("int", True)
    with pytest.raises(TypeError):
        AttrValue("bool", 1)
    with pytest.raises(TypeError):
        AttrValue("string", 5)


def _gpu(**attrs: AttrValue) -> Device:
    return Device("gpu-0", {"type": AttrValue.of_string("gpu"), **attrs}, {"memory": 1})


def test_device_accepts_the_model() -> None:
    d = _gpu(uuid=AttrValue.of_string("GPU-x"), index=AttrValue.of_int(0))
    assert d.type == "gpu" and d.attr("uuid") == "GPU-x" and d.attr("numaNode") is None


@pytest.mark.parametrize(
    ("attributes", "capacity", "match"),
    [
        ({"colour": AttrValue.of_string("red")}, {}, "not in the gpu model"),
        ({"index": AttrValue.of_string("0")}, {}, "must be int"),
        ({"profile": AttrValue.of_string("1g.10gb")}, {}, "not in the gpu model"),  # MIG-only
        ({}, {"multiprocessors": 14}, "not in the gpu model"),  # MIG-only capacity
        ({}, {"memory": -1}, "non-negative"),
    ],
)
def test_device_rejects_what_the_model_does_not_declare(attributes, capacity, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        Device("gpu-0", {"type": AttrValue.of_string("gpu"), **attributes}, capacity)


def test_device_needs_a_type_and_a_dns_label_name() -> None:
    with pytest.raises(ValueError, match="'type'"):
        Device("gpu-0", {}, {})
    with pytest.raises(limits.LimitError):
        Device("GPU_0", {"type": AttrValue.of_string("gpu")}, {})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("9.0", "9.0.0"),
        ("8.9", "8.9.0"),
        ("570.133.20", "570.133.20"),
        ("550.54", "550.54.0"),
        ("535.104.05", "535.104.5"),  # semver forbids leading zeros
        ("580.159.04", "580.159.4"),
        ("12", "12.0.0"),
        ("1.2.3.4", "1.2.3+4"),
    ],
)
def test_normalize_version(raw: str, expected: str) -> None:
    assert normalize_version(raw) == expected
    assert limits.is_semver(expected)


@pytest.mark.parametrize("raw", ["", "abc", "1..2", "v1.0"])
def test_normalize_version_rejects_non_numeric(raw: str) -> None:
    with pytest.raises(ValueError):
        normalize_version(raw)


def test_cuda_version_from_nvml_int() -> None:
    assert cuda_version_from_int(12080) == "12.8.0"
    assert cuda_version_from_int(13000) == "13.0.0"
    assert cuda_version_from_int(12020) == "12.2.0"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3B:00.0", "0000:3b:00.0"),
        ("00000001:DB:1F.7", "0001:db:1f.7"),
        ("3b:00.0", "0000:3b:00.0"),
    ],
)
def test_normalize_pci_bus_id(raw: str, expected: str) -> None:
    assert normalize_pci_bus_id(raw) == expected


@pytest.mark.parametrize("raw", ["", "3b:00", "00010000:3b:00.0", "0000:3b:00.8"])
def test_normalize_pci_bus_id_rejects(raw: str) -> None:
    with pytest.raises(ValueError):
        normalize_pci_bus_id(raw)


def test_device_names() -> None:
    assert gpu_device_name(7) == "gpu-7"
    assert mig_device_name(0, "3g.40gb", 2, 0) == "gpu-0-mig-3g40gb-2-0"
    assert mig_device_name(3, "1c.3g.40gb", 1, 2) == "gpu-3-mig-1c3g40gb-1-2"
    assert mig_device_name(1, "1g.10gb+me", 9, 0) == "gpu-1-mig-1g10gbme-9-0"
    with pytest.raises(limits.LimitError):
        mig_device_name(0, "x" * 60, 1, 0)
