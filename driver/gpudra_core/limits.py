"""Kubernetes resource.k8s.io/v1 limits, in one place, with checks that fail before the API server does.

Numbers come from ``k8s.io/api/resource/v1/types.go`` and the apiserver's resource validation
(kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go``, 1.35). Every check raises
:class:`LimitError`, which names the object and the rule it broke, so a caller can log one line
that says what to fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Sized

# ResourceSlice
MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64  # ...WithTaintsOrConsumesCounters
MAX_TAINTS_PER_DEVICE = 16  # DeviceTaintsMaxLength
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_POOL_NAME_LENGTH = 253
MAX_DRIVER_NAME_LENGTH = 63  # DriverNameMaxLength (a DNS subdomain, validated like a CSI driver)
# Partitionable devices (KEP-4815)
MAX_COUNTER_SETS_PER_SLICE = 8  # ResourceSliceMaxCounterSets
MAX_COUNTERS_PER_SET = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_COUNTER_CONSUMPTIONS_PER_DEVICE = 2  # ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS_PER_CONSUMPTION = 32  # ResourceSliceMaxCountersPerDeviceCounterConsumption

# Device attributes
MAX_ATTRIBUTE_STRING_LENGTH = 64  # DeviceAttributeMaxValueLength: string and version values
MAX_ID_LENGTH = 32  # DeviceMaxIDLength: the C identifier part of a qualified name
MAX_DOMAIN_LENGTH = 63  # DeviceMaxDomainLength

# Object metadata
MAX_DNS_LABEL_LENGTH = 63  # device names, label values
MAX_DNS_SUBDOMAIN_LENGTH = 253  # object names
MAX_LABEL_VALUE_LENGTH = 63

# DeviceClass / ResourceClaim CEL
MAX_CEL_EXPRESSION_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
MAX_CEL_COST = 1_000_000  # CELSelectorExpressionMaxCost
MAX_SELECTORS = 32

# ResourceClaim status.allocation (k8s.io/api resource/v1 types.go and validation.go's
# validateDeviceAllocationResult, 1.35): what the node agent reads from a claim. Bounds checked
# before any lock on the node (plugin/allocation.py); a claim the API server accepted is within them.
MAX_ALLOCATION_RESULTS = 32  # AllocationResultsMaxSize
MAX_ALLOCATION_CONFIGS = 2 * 32  # 2 * DeviceConfigMaxSize: the class's configs and the claim's
MAX_CONFIG_REQUESTS = 32  # DeviceRequestsMaxSize: the requests one config names
MAX_OPAQUE_PARAMETERS_LENGTH = 10 * 1024  # OpaqueParametersMaxLength: bytes of the raw JSON
# "<request>" or "<request>/<subrequest>", each a DNS label (validateRequestNameRef)
MAX_REQUEST_REFERENCE_LENGTH = 2 * 63 + 1
# consumedCapacity: one entry per capacity of the device, which has at most 32 attributes and
# capacities together; each value a Quantity within int64 for every device we publish
MAX_CONSUMED_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
# A quantity's characters. No upstream constant: apimachinery's canonical form of an int64 value
# takes at most 23, so this is generous, and parsing what it admits costs microseconds.
MAX_QUANTITY_LENGTH = 64

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Used with fullmatch: with match, "$" also matches before a trailing newline ("name\n" would pass).
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Semantic Versioning 2.0.0, the grammar the apiserver uses for `version` attributes.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$",
    re.ASCII,  # \d: ASCII digits only, as Go's regexp
)


class LimitError(ValueError):
    """A value the API server would reject. ``subject`` names the object, ``rule`` the limit."""

    def __init__(self, subject: str, rule: str) -> None:
        super().__init__(f"{subject}: {rule}")
        self.subject = subject
        self.rule = rule


def is_dns_label(value: str) -> bool:
    return len(value) <= MAX_DNS_LABEL_LENGTH and bool(_DNS_LABEL.fullmatch(value))


def is_dns_subdomain(value: str) -> bool:
    return (
        0 < len(value) <= MAX_DNS_SUBDOMAIN_LENGTH
        and all(_DNS_LABEL.fullmatch(part) for part in value.split("."))
    )


def is_semver(value: str) -> bool:
    return bool(_SEMVER.fullmatch(value))


def is_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_VALUE_LENGTH and bool(_LABEL_VALUE.fullmatch(value))


def check_dns_label(subject: str, value: str) -> None:
    if not is_dns_label(value):
        raise LimitError(
            subject,
            f"{value!r} is not a DNS label (lowercase alphanumerics and '-', "
            f"alphanumeric at both ends, at most {MAX_DNS_LABEL_LENGTH} characters)",
        )


def check_dns_subdomain(subject: str, value: str, max_length: int = MAX_DNS_SUBDOMAIN_LENGTH) -> None:
    if not is_dns_subdomain(value) or len(value) > max_length:
        raise LimitError(
            subject, f"{value!r} is not a DNS subdomain of at most {max_length} characters"
        )


def check_driver_name(value: str) -> None:
    check_dns_subdomain("driver name", value, MAX_DRIVER_NAME_LENGTH)


def check_qualified_name(subject: str, name: str) -> None:
    """A bare C identifier (the driver's own domain) or ``<domain>/<C identifier>``."""
    domain, sep, ident = name.rpartition("/")
    if sep:
        check_dns_subdomain(f"{subject} domain", domain, MAX_DOMAIN_LENGTH)
    if len(ident) > MAX_ID_LENGTH or not _C_IDENTIFIER.fullmatch(ident):
        raise LimitError(
            subject, f"{name!r}: name part must be a C identifier of at most {MAX_ID_LENGTH} characters"
        )


def check_string_value(subject: str, value: str) -> None:
    if len(value) > MAX_ATTRIBUTE_STRING_LENGTH:
        raise LimitError(
            subject, f"string value is {len(value)} characters, the limit is {MAX_ATTRIBUTE_STRING_LENGTH}"
        )


def check_version_value(subject: str, value: str) -> None:
    check_string_value(subject, value)
    if not is_semver(value):
        raise LimitError(subject, f"{value!r} is not a semantic version (MAJOR.MINOR.PATCH)")


def check_int_value(subject: str, value: int) -> None:
    if not INT64_MIN <= value <= INT64_MAX:
        raise LimitError(subject, f"{value} does not fit in int64")


def check_device_entries(subject: str, attributes: Sized, capacity: Sized) -> None:
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        raise LimitError(
            subject,
            f"{total} attributes and capacities, the limit is "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}",
        )


def check_devices_per_slice(subject: str, count: int, *, taints_or_counters: bool = False) -> None:
    limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if taints_or_counters else MAX_DEVICES_PER_SLICE
    if count > limit:
        raise LimitError(subject, f"{count} devices, the limit per ResourceSlice is {limit}")


def check_counters(subject: str, counters: Sized, limit: int) -> None:
    """A counter set's counters, or what one device consumes of one set."""
    if not 0 < len(counters) <= limit:
        raise LimitError(subject, f"{len(counters)} counters, must be 1..{limit}")


def check_taints(subject: str, taints: Sequence[tuple[str, str]]) -> None:
    """Device taints as ``(key, value)``: at most 16, each key a label name (``<domain>/<name>``),
    each value a label value."""
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        raise LimitError(subject, f"{len(taints)} taints, the limit per device is {MAX_TAINTS_PER_DEVICE}")
    for key, value in taints:
        domain, _, name = key.rpartition("/")
        if (domain and not is_dns_subdomain(domain)) or not name or not is_label_value(name):
            raise LimitError(subject, f"taint key {key!r} is not a label name")
        if not is_label_value(value):
            raise LimitError(subject, f"taint {key} value {value!r} is not a label value")


def check_labels(subject: str, labels: Mapping[str, str]) -> None:
    for key, value in labels.items():
        if not is_label_value(value):
            raise LimitError(subject, f"label {key}={value!r} is not a valid label value")


def check_cel_expression(subject: str, expression: str) -> None:
    if len(expression.encode()) > MAX_CEL_EXPRESSION_LENGTH:
        raise LimitError(subject, f"CEL expression exceeds {MAX_CEL_EXPRESSION_LENGTH} bytes")
