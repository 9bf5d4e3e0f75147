"""The device model: the one declaration of what the agent publishes.

Discovery fills it, slice building serialises it, the operator's DeviceClass templates and the docs
read it. Everything here is data plus small pure helpers; nothing touches NVML or the API.

Device types and names (stable across agent restarts and rescans, DNS labels):

* ``gpu``: a full GPU, named ``gpu-<index>`` (``index`` = NVML enumeration index, which NVML orders
  by PCI bus ID).
* ``mig``: a MIG device, named ``gpu-<parentIndex>-mig-<profile>-<giId>-<ciId>`` where ``<profile>``
  is the MIG profile with every character outside ``[a-z0-9]`` removed (``3g.40gb`` -> ``3g40gb``,
  ``1c.3g.40gb`` -> ``1c3g40gb``) and ``giId``/``ciId`` are the GPU and compute instance IDs. The
  pair (giId, ciId) is unique on a parent, so the name is unique; it changes only when the MIG
  layout is changed, which is exactly when the device it names changes.

Sharing (KEP-5075, consumable capacity): a device may carry ``allow_multiple_allocations`` and a
:class:`RequestPolicy` per capacity, which lets the scheduler put several claims on it, each
consuming part of a capacity (:mod:`gpudra_core.consumable` decides which devices and how).

MIG rule: a GPU whose *current* MIG mode is enabled is not published as a full GPU, only its MIG
devices are. Its memory and SMs belong to the MIG devices; advertising both would let the scheduler
hand out the same silicon twice. A MIG-enabled GPU with no MIG devices publishes nothing (it is
stranded until someone creates partitions), and discovery reports a warning for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, TypeAlias

from gpudra_core import limits

AttrType: TypeAlias = Literal["string", "int", "bool", "version"]
CapacityUnit: TypeAlias = Literal["bytes", "count"]
DeviceType: TypeAlias = Literal["gpu", "mig"]

ATTR_TYPES: tuple[AttrType, ...] = ("string", "int", "bool", "version")
DEVICE_TYPES: tuple[DeviceType, ...] = ("gpu", "mig")
# Kubernetes' domain for standard attributes: StandardDeviceAttributePrefix in
# k8s.io/dynamic-resource-allocation/deviceattribute (attributes.go), which names pciBusID, pcieRoot
# (a string "pci<domain>:<bus>") and numaNode (an int, KEP-6072).
STANDARD_DOMAIN = "resource.kubernetes.io"

_BOTH: frozenset[DeviceType] = frozenset(DEVICE_TYPES)
_GPU: frozenset[DeviceType] = frozenset({"gpu"})
_MIG: frozenset[DeviceType] = frozenset({"mig"})


@dataclass(frozen=True)
class AttributeSpec:
    """One published attribute. ``name`` is the key in the slice: bare names live in the driver's
    domain (CEL: ``device.attributes['<driver>'].<name>``), qualified ones keep their domain."""

    name: str
    type: AttrType
    description: str
    device_types: frozenset[DeviceType]
    optional: bool = False  # published only when known

    @property
    def domain(self) -> str | None:
        return self.name.rpartition("/")[0] or None

    @property
    def short_name(self) -> str:
        return self.name.rpartition("/")[2]


@dataclass(frozen=True)
class CapacitySpec:
    name: str
    unit: CapacityUnit
    description: str
    device_types: frozenset[DeviceType]


def _by_name(*specs):  # type: ignore[no-untyped-def]
    return MappingProxyType({s.name: s for s in specs})


ATTRIBUTES: Mapping[str, AttributeSpec] = _by_name(
    AttributeSpec("type", "string", "Device type: 'gpu' or 'mig'.", _BOTH),
    AttributeSpec("uuid", "string", "NVML UUID: 'GPU-…' for a GPU, 'MIG-…' for a MIG device.", _BOTH),
    AttributeSpec("productName", "string", "NVML product name, e.g. 'NVIDIA H100 80GB HBM3' (the parent's for MIG).", _BOTH),
    AttributeSpec("brand", "string", "NVML brand, e.g. 'Nvidia', 'Tesla', 'GeForce'.", _BOTH),
    AttributeSpec("architecture", "string", "Architecture, e.g. 'Ampere', 'Hopper', 'Ada Lovelace'.", _BOTH),
    AttributeSpec("cudaComputeCapability", "version", "CUDA compute capability as semver, e.g. '9.0.0'.", _BOTH),
    AttributeSpec("driverVersion", "version", "NVIDIA kernel driver version as semver, e.g. '570.133.20'.", _BOTH),
    AttributeSpec("cudaDriverVersion", "version", "Highest CUDA version the driver supports, e.g. '12.8.0'.", _BOTH),
    AttributeSpec("index", "int", "GPU: NVML index. MIG: the MIG device's index under its parent.", _BOTH),
    AttributeSpec("minor", "int", "Minor number of /dev/nvidia<minor>.", _GPU),
    AttributeSpec(
        f"{STANDARD_DOMAIN}/pciBusID",
        "string",
        "PCI address in extended BDF form, e.g. '0000:3b:00.0' (the parent's for MIG).",
        _BOTH,
        optional=True,
    ),
    AttributeSpec("numaNode", "int", "NUMA node of the GPU's PCI device; absent when unknown.", _BOTH, optional=True),
    # KEP-6072 (GA in 1.37): Kubernetes' standard NUMA attribute, the same value as numaNode, which
    # stays for the claims and classes that already select on it. The standard one is what a claim
    # aligns across drivers (matchAttribute with a NIC driver's devices).
    AttributeSpec(
        f"{STANDARD_DOMAIN}/numaNode",
        "int",
        "NUMA node of the GPU's PCI device, the standard attribute (same value as numaNode); absent when unknown.",
        _BOTH,
        optional=True,
    ),
    AttributeSpec(
        f"{STANDARD_DOMAIN}/pcieRoot",
        "string",
        "PCIe root complex of the GPU, 'pci<domain>:<bus>', e.g. 'pci0000:00', from sysfs (the parent's for MIG).",
        _BOTH,
        optional=True,
    ),
    AttributeSpec("profile", "string", "MIG profile, e.g. '1g.10gb', '3g.40gb'.", _MIG),
    AttributeSpec("parentUUID", "string", "UUID of the GPU the MIG device lives on.", _MIG),
    AttributeSpec("parentIndex", "int", "NVML index of the parent GPU.", _MIG),
    AttributeSpec("parentMinor", "int", "Minor number of the parent GPU's /dev/nvidia<minor>.", _MIG),
    AttributeSpec("gpuInstanceId", "int", "MIG GPU instance ID on the parent.", _MIG),
    AttributeSpec("computeInstanceId", "int", "MIG compute instance ID within the GPU instance.", _MIG),
)

CAPACITIES: Mapping[str, CapacitySpec] = _by_name(
    CapacitySpec("memory", "bytes", "Framebuffer memory in bytes (exact, as NVML reports it).", _BOTH),
    CapacitySpec("shares", "count", "Claims the GPU may be shared by; only with consumable capacity and a "
                 "shares count (spec.sharing.consumableCapacity.shares).", _GPU),
    CapacitySpec("multiprocessors", "count", "Streaming multiprocessors.", _MIG),
    CapacitySpec("copyEngines", "count", "Copy engines.", _MIG),
    CapacitySpec("decoders", "count", "Video decoders (NVDEC).", _MIG),
    CapacitySpec("encoders", "count", "Video encoders (NVENC).", _MIG),
    CapacitySpec("jpegEngines", "count", "JPEG decoders (NVJPG).", _MIG),
    CapacitySpec("ofaEngines", "count", "Optical flow accelerators (OFA).", _MIG),
    CapacitySpec("computeSlices", "count", "MIG compute slices (the 'g' of a profile: 3 for 3g.40gb); "
                 "only on dynamic MIG placements.", _MIG),
)


def attribute_type(name: str, driver: str | None = None) -> AttrType | None:
    """The type of a published attribute, or None if the agent never publishes it.

    Accepts bare names (``productName``), fully qualified standard names
    (``resource.kubernetes.io/pciBusID``) and names qualified with the driver's domain
    (``gpu.gpudra.io/productName``); pass ``driver`` to accept only that domain. Capacities are
    not attributes (see :func:`capacity_names`): ``attribute_type("memory")`` is None.
    """
    if name in ATTRIBUTES:
        return ATTRIBUTES[name].type
    domain, sep, bare = name.rpartition("/")
    if not sep or domain == STANDARD_DOMAIN or (driver is not None and domain != driver):
        return None
    spec = ATTRIBUTES.get(bare)
    return spec.type if spec is not None and spec.domain is None else None


def attribute_names(device_type: DeviceType | None = None) -> list[str]:
    return [n for n, s in ATTRIBUTES.items() if device_type is None or device_type in s.device_types]


def capacity_names(device_type: DeviceType | None = None) -> list[str]:
    return [n for n, s in CAPACITIES.items() if device_type is None or device_type in s.device_types]


def is_capacity(name: str, driver: str | None = None) -> bool:
    domain, _, bare = name.rpartition("/")
    return bare in CAPACITIES and (not domain or driver is None or domain == driver)


@dataclass(frozen=True)
class AttrValue:
    """A typed attribute value, tagged the way resource.k8s.io/v1 tags it."""

    type: AttrType
    value: str | int | bool

    def __post_init__(self) -> None:
        expected = {"string": str, "version": str, "int": int, "bool": bool}[self.type]
        # bool is an int subclass in Python; the API keeps them apart, so must we.
        if type(self.value) is not expected:
            raise TypeError(f"{self.type} attribute needs {expected.__name__}, got {self.value!r}")

    # Named of_* because methods called int/bool would shadow the builtins in annotations.
    @classmethod
    def of_string(cls, value: str) -> AttrValue:
        return cls("string", value)

    @classmethod
    def of_int(cls, value: int) -> AttrValue:
        return cls("int", value)

    @classmethod
    def of_bool(cls, value: bool) -> AttrValue:
        return cls("bool", value)

    @classmethod
    def of_version(cls, value: str) -> AttrValue:
        return cls("version", value)

    def to_api(self) -> dict[str, str | int | bool]:
        """The v1 DeviceAttribute shape: exactly one of string/int/bool/version."""
        return {self.type: self.value}


@dataclass(frozen=True)
class RequestPolicy:
    """How much of a capacity one allocation consumes (resource.k8s.io/v1 CapacityRequestPolicy, in
    its validRange form; KEP-5075). ``default`` is what a request that names no amount consumes; a
    request below ``min`` is rounded up to it, one between steps up to ``min + n * step``; one above
    ``max`` cannot be allocated. Values in the capacity's unit (bytes or a count)."""

    default: int
    min: int
    max: int | None = None
    step: int | None = None

    def problems(self, value: int) -> list[str]:
        """Why the API server would refuse this policy on a capacity of ``value`` (validation.go,
        validateRequestPolicyRange): empty when it takes it."""
        found = []
        if self.min > value:
            found.append(f"min {self.min} is larger than the capacity {value}")
        if self.default < self.min:
            found.append(f"default {self.default} is less than min {self.min}")
        if self.max is not None:
            if self.min > self.max:
                found.append(f"min {self.min} is larger than max {self.max}")
            if self.max > value:
                found.append(f"max {self.max} is larger than the capacity {value}")
            if self.default > self.max:
                found.append(f"default {self.default} is more than max {self.max}")
        if self.step is not None:
            if self.step <= 0:
                found.append(f"step {self.step} is not positive")
                return found
            if self.min + self.step > value:
                found.append(f"one step (min {self.min} + step {self.step}) is larger than the capacity {value}")
            for name, amount in (("default", self.default), ("max", self.max)):
                if amount is not None and (amount - self.min) % self.step:
                    found.append(f"{name} {amount} is not min {self.min} plus a multiple of step {self.step}")
        return found


TaintEffect: TypeAlias = Literal["None", "NoSchedule", "NoExecute"]
TAINT_EFFECTS: tuple[TaintEffect, ...] = ("None", "NoSchedule", "NoExecute")


@dataclass(frozen=True)
class DeviceTaint:
    """A device taint (KEP-5055, resource.k8s.io/v1 ``DeviceTaint``): ``key`` a qualified name in
    the driver's domain, ``value`` a label value (may be empty), ``time_added`` an RFC 3339 time in
    whole seconds, as the API server stores it, so a republished slice compares equal."""

    key: str
    value: str
    effect: TaintEffect
    time_added: str

    def __post_init__(self) -> None:
        if self.effect not in TAINT_EFFECTS:
            raise ValueError(f"taint {self.key}: effect must be one of {TAINT_EFFECTS}, not {self.effect!r}")


@dataclass(frozen=True)
class CounterSet:
    """Counters a pool shares between devices (KEP-4815, partitionable devices): what a device that
    consumes them takes is no longer available to the others. Names are DNS labels; values counts."""

    name: str
    counters: Mapping[str, int]

    def __post_init__(self) -> None:
        limits.check_dns_label(f"counter set {self.name!r} name", self.name)
        for key, value in self.counters.items():
            limits.check_dns_label(f"counter set {self.name} counter {key!r}", key)
            if type(value) is not int or value < 0:
                raise ValueError(f"counter set {self.name}: counter {key!r} must be a non-negative int")


@dataclass(frozen=True)
class CounterConsumption:
    """What a device takes from one :class:`CounterSet` of its pool while it is allocated."""

    counter_set: str
    counters: Mapping[str, int]

    def __post_init__(self) -> None:
        limits.check_dns_label(f"counter set {self.counter_set!r} name", self.counter_set)
        for key, value in self.counters.items():
            limits.check_dns_label(f"consumed counter {key!r} of {self.counter_set}", key)
            if type(value) is not int or value < 0:
                raise ValueError(f"consumed counter {key!r} of {self.counter_set} must be a non-negative int")


@dataclass(frozen=True)
class Device:
    """One allocatable device. ``capacity`` values are bytes (unit ``bytes``) or counts.

    Construction checks the model: every attribute and capacity must be declared above, with the
    declared type and for this device's ``type``; a typo fails here, not in the scheduler. So are
    the sharing fields: a request policy only on a device that allows multiple allocations, for a
    capacity it has, valid for that capacity's value.
    """

    name: str
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    allow_multiple_allocations: bool = False
    request_policies: dict[str, RequestPolicy] = field(default_factory=dict)
    taints: tuple[DeviceTaint, ...] = ()  # set by device health (gpudra_driver.devicehealth), not discovery
    # Dynamic MIG (partitionable devices): what this device takes from its GPU's counters, and, on
    # one device per GPU, the counter set the GPU's hardware provides (published once, in the
    # pool's counter slice; :func:`gpudra_driver.publishing.slices.build_slices`).
    consumes_counters: tuple[CounterConsumption, ...] = ()
    provides_counters: CounterSet | None = None

    def __post_init__(self) -> None:
        limits.check_dns_label(f"device {self.name!r} name", self.name)
        dtype = self.attributes.get("type")
        if dtype is None or dtype.value not in DEVICE_TYPES:
            raise ValueError(f"device {self.name}: attribute 'type' must be one of {DEVICE_TYPES}")
        for key, val in self.attributes.items():
            spec = ATTRIBUTES.get(key)
            if spec is None or dtype.value not in spec.device_types:
                raise ValueError(f"device {self.name}: attribute {key!r} is not in the {dtype.value} model")
            if val.type != spec.type:
                raise ValueError(f"device {self.name}: attribute {key!r} must be {spec.type}, got {val.type}")
        for key, amount in self.capacity.items():
            cspec = CAPACITIES.get(key)
            if cspec is None or dtype.value not in cspec.device_types:
                raise ValueError(f"device {self.name}: capacity {key!r} is not in the {dtype.value} model")
            if type(amount) is not int or amount < 0:
                raise ValueError(f"device {self.name}: capacity {key!r} must be a non-negative int")
        if self.request_policies and not self.allow_multiple_allocations:
            raise ValueError(f"device {self.name}: a request policy needs allow_multiple_allocations")
        for key, policy in self.request_policies.items():
            if key not in self.capacity:
                raise ValueError(f"device {self.name}: request policy for capacity {key!r}, which it does not have")
            problems = policy.problems(self.capacity[key])
            if problems:
                raise ValueError(f"device {self.name}: request policy of capacity {key!r}: {'; '.join(problems)}")

    @property
    def type(self) -> str:
        return str(self.attributes["type"].value)

    def attr(self, name: str) -> str | int | bool | None:
        value = self.attributes.get(name)
        return None if value is None else value.value


# -- naming -----------------------------------------------------------------------------------


def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(parent_index: int, profile: str, gi_id: int, ci_id: int) -> str:
    name = f"gpu-{parent_index}-mig-{_profile_label(profile)}-{gi_id}-{ci_id}"
    limits.check_dns_label("MIG device name", name)
    return name


def mig_placement_name(parent_index: int, profile: str, start: int) -> str:
    """A dynamic MIG placement: ``gpu-<parentIndex>-mig-<profile>-at<start>`` (``start``: its first
    memory slice), e.g. ``gpu-0-mig-3g40gb-at4``. Never a static MIG device's name, which ends in
    two numbers."""
    name = f"gpu-{parent_index}-mig-{_profile_label(profile)}-at{start}"
    limits.check_dns_label("MIG placement name", name)
    return name


def _profile_label(profile: str) -> str:
    return re.sub(r"[^a-z0-9]", "", profile.lower())


# -- value normalisation ----------------------------------------------------------------------

_BDF = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` -> ``0000:3b:00.0``, the extended BDF Kubernetes' standard
    attribute requires (``^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\\.[0-9a-f]$``)."""
    m = _BDF.fullmatch(bus_id.strip())
    if not m:
        raise ValueError(f"not a PCI bus ID: {bus_id!r}")
    domain, bus, dev, fn = m.groups()
    domain_val = int(domain or "0", 16)
    if domain_val > 0xFFFF:
        raise ValueError(f"PCI domain of {bus_id!r} does not fit the 4-digit BDF form")
    return f"{domain_val:04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def normalize_version(raw: str) -> str:
    """A dotted numeric version as semver: pad to three parts and drop leading zeros, which semver
    forbids (``9.0`` -> ``9.0.0``, ``550.54`` -> ``550.54.0``, ``535.104.05`` -> ``535.104.5``).
    Parts beyond the third go into build metadata so nothing is lost."""
    parts = raw.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a numeric version: {raw!r}")
    nums = [str(int(p)) for p in parts]
    nums += ["0"] * (3 - len(nums))
    version = ".".join(nums[:3]) + (f"+{'.'.join(nums[3:])}" if len(nums) > 3 else "")
    limits.check_version_value("version", version)
    return version


def cuda_version_from_int(value: int) -> str:
    """NVML's CUDA driver version integer (1000*major + 10*minor, e.g. 12080) as semver."""
    return f"{value // 1000}.{(value % 1000) // 10}.0"
