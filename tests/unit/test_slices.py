from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable

import pytest

from gpudra_core import limits
from gpudra_core.devicemodel import AttrValue, Device
from gpudra_driver.discovery import scan
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices, node_label_value, slice_name
from gpudra_driver.deviceapi import device_to_api

DRIVER = "gpu.gpudra.io"
NODE = "node-a"
UID = "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"


def synthetic(n: int) -> list[Device]:
    return [
        Device(
            f"gpu-{i}",
            {
                "type": AttrValue.of_string("gpu"),
                "uuid": AttrValue.of_string(f"GPU-{i:08x}-0000-0000-0000-000000000000"),
                "index": AttrValue.of_int(i),
                "cudaComputeCapability": AttrValue.of_version("9.0.0"),
            },
            {"memory": 81559 * 2**20},
        )
        for i in range(n)
    ]


def test_300_devices_are_split_into_slices_of_128() -> None:
    slices = build_slices(DRIVER, NODE, UID, 7, synthetic(300))
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    assert [s["metadata"]["name"] for s in slices] == [
        "node-a-gpu-gpudra-io-0", "node-a-gpu-gpudra-io-1", "node-a-gpu-gpudra-io-2",
    ]
    for s in slices:
        assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
        assert s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 3}
        assert s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == NODE
        assert s["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
        ]
        assert s["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpudra-agent", "gpudra.io/node": NODE}
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(300)]  # natural order, each device once
    assert slices[0]["spec"]["devices"][-1]["name"] == "gpu-127"


def test_slices_are_deterministic_whatever_the_input_order() -> None:
    devices = synthetic(200)
    shuffled = devices[:]
    random.Random(1).shuffle(shuffled)
    assert build_slices(DRIVER, NODE, UID, 1, shuffled) == build_slices(DRIVER, NODE, UID, 1, devices)


def test_generation_is_the_only_change_between_generations() -> None:
    one, two = (build_slices(DRIVER, NODE, UID, g, synthetic(3))[0] for g in (1, 2))
    assert two["spec"]["pool"]["generation"] == 2
    two["spec"]["pool"]["generation"] = 1
    assert one == two


def test_no_devices_still_publishes_one_empty_slice() -> None:
    [only] = build_slices(DRIVER, NODE, UID, 3, [])
    assert "devices" not in only["spec"]
    assert only["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}


def test_offline_preview_has_no_owner() -> None:
    [only] = build_slices(DRIVER, NODE, None, 1, synthetic(1))
    assert "ownerReferences" not in only["metadata"]


def test_smaller_slices_on_request() -> None:
    slices = build_slices(DRIVER, NODE, UID, 1, synthetic(10), max_devices=4)
    assert [len(s["spec"]["devices"]) for s in slices] == [4, 4, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}


def test_device_serialisation_in_v1_shape(fake: Callable[[str], FakeNvml]) -> None:
    devices = scan(fake("a100-80gb-mig")).devices
    [s] = build_slices(DRIVER, NODE, UID, 1, devices)
    first = s["spec"]["devices"][0]
    assert first["name"] == "gpu-0-mig-1g10gb-9-0"  # natural sort puts 1g before 3g
    attrs = first["attributes"]
    assert attrs["type"] == {"string": "mig"}
    assert attrs["profile"] == {"string": "1g.10gb"}
    assert attrs["gpuInstanceId"] == {"int": 9}
    assert attrs["cudaComputeCapability"] == {"version": "8.0.0"}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:07:00.0"}
    assert first["capacity"] == {
        "memory": {"value": "9728Mi"},
        "multiprocessors": {"value": "14"},
        "copyEngines": {"value": "1"},
        "decoders": {"value": "0"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "0"},
        "ofaEngines": {"value": "0"},
    }
    assert json.loads(json.dumps(s)) == s  # plain JSON-ready data


def test_bool_attribute_serialisation() -> None:
    assert AttrValue.of_bool(False).to_api() == {"bool": False}


def test_long_node_names_stay_within_limits() -> None:
    long_a = "n" * 240 + ".example.com"
    long_b = "m" * 240 + ".example.com"
    name_a = slice_name(long_a, DRIVER, 0)
    assert len(name_a) <= 253 and limits.is_dns_subdomain(name_a)
    assert name_a != slice_name(long_b, DRIVER, 0)
    label = node_label_value(long_a)
    assert limits.is_label_value(label) and label != node_label_value(long_b)
    [s] = build_slices(DRIVER, long_a, UID, 1, synthetic(1))
    assert s["spec"]["pool"]["name"] == long_a and s["spec"]["nodeName"] == long_a


def _with_product(name: str, product: str) -> Device:
    return Device(name, {"type": AttrValue.of_string("gpu"), "productName": AttrValue.of_string(product)}, {})


def test_limits_are_enforced() -> None:
    with pytest.raises(limits.LimitError, match="64"):
        build_slices(DRIVER, NODE, UID, 1, [_with_product("gpu-0", "x" * 65)])
    build_slices(DRIVER, NODE, UID, 1, [_with_product("gpu-0", "x" * 64)])  # the limit itself is fine
    with pytest.raises(limits.LimitError, match="duplicate device names"):
        build_slices(DRIVER, NODE, UID, 1, synthetic(2) + synthetic(1))
    with pytest.raises(limits.LimitError, match="driver name"):
        build_slices("Not_A_Driver", NODE, UID, 1, [])
    with pytest.raises(limits.LimitError, match="node name"):
        build_slices(DRIVER, "Node_A", UID, 1, [])
    with pytest.raises(limits.LimitError, match="generation"):
        build_slices(DRIVER, NODE, UID, -1, [])
    with pytest.raises(limits.LimitError, match="max_devices"):
        build_slices(DRIVER, NODE, UID, 1, [], max_devices=129)


def test_version_values_must_be_semver() -> None:
    device = Device("gpu-0", {"type": AttrValue.of_string("gpu"), "driverVersion": AttrValue.of_version("535.104.05")}, {})
    with pytest.raises(limits.LimitError, match="semantic version"):
        device_to_api(device)


def test_limit_helpers() -> None:
    with pytest.raises(limits.LimitError, match="33 attributes and capacities"):
        limits.check_device_entries("d", range(30), range(3))
    limits.check_device_entries("d", range(30), range(2))
    with pytest.raises(limits.LimitError, match="129 devices"):
        limits.check_devices_per_slice("s", 129)
    with pytest.raises(limits.LimitError, match="limit per ResourceSlice is 64"):
        limits.check_devices_per_slice("s", 65, taints_or_counters=True)
    with pytest.raises(limits.LimitError):
        limits.check_qualified_name("a", "x" * 33)
    with pytest.raises(limits.LimitError):
        limits.check_qualified_name("a", "Bad_Domain/name")
    limits.check_qualified_name("a", "resource.kubernetes.io/pciBusID")
    with pytest.raises(limits.LimitError):
        limits.check_int_value("a", 2**63)
    with pytest.raises(limits.LimitError):
        limits.check_dns_label("a", "a" * 64)
    limits.check_dns_label("a", "a" * 63)
    with pytest.raises(limits.LimitError, match="10240 bytes"):
        limits.check_cel_expression("c", "x" * (10 * 1024 + 1))


def test_a_value_past_a_limit_changes_that_device_only_and_says_so() -> None:
    from gpudra_core.devicemodel import AttrValue
    from gpudra_driver.publishing.slices import build_slices
    from gpudra_driver.deviceapi import fit_devices

    devices = scan(FakeNvml(load_profile("l4x2"))).devices
    long_name = "NVIDIA L4 " + "Extended Edition " * 5  # 95 characters, as NVML names can be
    bad = dataclasses.replace(devices[0], attributes={**devices[0].attributes,
                                                      "productName": AttrValue.of_string(long_name),
                                                      "driverVersion": AttrValue.of_version("550.1")})
    fitted, warnings = fit_devices([bad, devices[1]])
    assert [d.name for d in fitted] == ["gpu-0", "gpu-1"] and fitted[1] is devices[1]
    assert fitted[0].attr("productName") == long_name[:64]
    assert fitted[0].attr("driverVersion") is None  # not a semantic version: left out, not guessed
    assert len(warnings) == 2 and all(w.startswith("device gpu-0 attribute ") for w in warnings)
    assert "cut to 64 characters" in warnings[0] + warnings[1] and "published without it" in warnings[0] + warnings[1]
    (slice_,) = build_slices("gpu.gpudra.io", "n", None, 1, fitted)  # the pool publishes
    assert len(slice_["spec"]["devices"]) == 2
