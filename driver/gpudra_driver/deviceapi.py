"""A device as the API takes it: its ``resource.k8s.io/v1`` Device entry, checked against the API's
limits, and the devices fitted to those limits before they are published (pure). Discovery fits
what NVML reports; slice building serialises the fitted devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gpudra_core import limits
from gpudra_core.consumable import policy_to_api
from gpudra_core.devicemodel import CAPACITIES, AttrValue, CounterConsumption, CounterSet, Device, DeviceTaint
from gpudra_core.quantity import format_quantity


def check_attribute_value(where: str, val: AttrValue) -> None:
    """The API's limits on one attribute value (``LimitError`` naming ``where``)."""
    if val.type == "string":
        limits.check_string_value(where, str(val.value))
    elif val.type == "version":
        limits.check_version_value(where, str(val.value))
    elif val.type == "int":
        limits.check_int_value(where, int(val.value))


def fit_devices(devices: list[Device]) -> tuple[list[Device], list[str]]:
    """The devices as the API will take them, and what had to change (pure). A value past a limit
    must not hold up the whole pool: a string attribute over 64 characters (NVML product names
    reach 96) is cut to 64, an attribute value the API refuses otherwise is left out, and a device
    that still does not fit is skipped; each change is one warning naming the device."""
    fitted: list[Device] = []
    warnings: list[str] = []
    for device in devices:
        attributes = dict(device.attributes)
        for key, val in device.attributes.items():
            try:
                check_attribute_value(f"device {device.name} attribute {key}", val)
            except limits.LimitError as error:
                if val.type == "string":
                    attributes[key] = AttrValue.of_string(str(val.value)[:limits.MAX_ATTRIBUTE_STRING_LENGTH])
                    warnings.append(f"{error}; published cut to {limits.MAX_ATTRIBUTE_STRING_LENGTH} characters")
                else:
                    del attributes[key]
                    warnings.append(f"{error}; published without it")
        candidate = dataclasses.replace(device, attributes=attributes) if attributes != device.attributes else device
        try:
            device_to_api(candidate)
        except (limits.LimitError, ValueError) as error:
            warnings.append(f"device {device.name} skipped: {error}")
            continue
        fitted.append(candidate)
    return fitted, warnings


def device_to_api(device: Device) -> dict[str, Any]:
    """One v1 Device entry: ``{name, attributes: {k: {type: v}}, capacity: {k: {value: qty}}}``, and
    for a shared device ``allowMultipleAllocations: true`` and each capacity's ``requestPolicy``."""
    subject = f"device {device.name}"
    limits.check_dns_label(f"{subject} name", device.name)
    limits.check_device_entries(subject, device.attributes, device.capacity)
    attributes: dict[str, Any] = {}
    for key, val in sorted(device.attributes.items()):
        where = f"{subject} attribute {key}"
        limits.check_qualified_name(where, key)
        check_attribute_value(where, val)
        attributes[key] = val.to_api()
    capacity: dict[str, Any] = {}
    for key, amount in sorted(device.capacity.items()):
        limits.check_qualified_name(f"{subject} capacity {key}", key)
        spec = CAPACITIES.get(key)
        binary = spec is not None and spec.unit == "bytes"
        capacity[key] = {"value": format_quantity(amount, binary=binary)}
        if key in device.request_policies:
            capacity[key]["requestPolicy"] = policy_to_api(device.request_policies[key], binary=binary)
    entry: dict[str, Any] = {"name": device.name, "attributes": attributes}
    if capacity:
        entry["capacity"] = capacity
    if device.allow_multiple_allocations:
        entry["allowMultipleAllocations"] = True
    if device.taints:
        limits.check_taints(subject, [(t.key, t.value) for t in device.taints])
        entry["taints"] = [taint_to_api(t) for t in device.taints]
    if device.consumes_counters:
        entry["consumesCounters"] = consumption_to_api(subject, device.consumes_counters)
    return entry


def consumption_to_api(subject: str, consumptions: Sequence[CounterConsumption]) -> list[dict[str, Any]]:
    """``consumesCounters``: at most 2 sets, each named once, each with 1..32 counters."""
    if len(consumptions) > limits.MAX_COUNTER_CONSUMPTIONS_PER_DEVICE:
        raise limits.LimitError(subject, f"{len(consumptions)} counter consumptions, the limit is "
                                         f"{limits.MAX_COUNTER_CONSUMPTIONS_PER_DEVICE}")
    if len({c.counter_set for c in consumptions}) != len(consumptions):
        raise limits.LimitError(subject, "consumes from one counter set twice")
    entries = []
    for consumption in consumptions:
        limits.check_counters(f"{subject} consumption of {consumption.counter_set}", consumption.counters,
                              limits.MAX_COUNTERS_PER_CONSUMPTION)
        entries.append({"counterSet": consumption.counter_set, "counters": counters_to_api(consumption.counters)})
    return entries


def counter_set_to_api(counter_set: CounterSet) -> dict[str, Any]:
    """One ``sharedCounters`` entry: ``{name, counters: {<name>: {value}}}``."""
    limits.check_counters(f"counter set {counter_set.name}", counter_set.counters, limits.MAX_COUNTERS_PER_SET)
    return {"name": counter_set.name, "counters": counters_to_api(counter_set.counters)}


def counters_to_api(counters: Mapping[str, int]) -> dict[str, dict[str, str]]:
    return {name: {"value": format_quantity(value, binary=False)} for name, value in sorted(counters.items())}


def taint_to_api(taint: DeviceTaint) -> dict[str, str]:
    """``{key, value?, effect, timeAdded}``; an empty value is left out, as the API server does."""
    entry = {"key": taint.key, "effect": taint.effect, "timeAdded": taint.time_added}
    if taint.value:
        entry["value"] = taint.value
    return entry
