"""The GpuConfig opaque configuration API (``gpudra.io/v1alpha1``, kind ``GpuConfig``): how a claim or
a DeviceClass asks for GPU sharing. Pure: the agent's prepare path decodes with it, the admission
policy (manifests/base/claim-config-admission-policy.yaml) applies the same rules in CEL, and a
test feeds both the same examples (docs/sharing.md lists which rules each side checks).

```yaml
apiVersion: gpudra.io/v1alpha1
kind: GpuConfig
sharing:
  strategy: Exclusive | TimeSlicing | MPS         # default Exclusive
  timeSlicing: {interval: Default | Short | Medium | Long}        # only with TimeSlicing
  mps:                                                            # only with MPS
    # Limits per MPS client process. Enforced on a GPU the claim holds whole (EXCLUSIVE_PROCESS:
    # every process must go through the claim's daemon); on a share of a GPU (consumable
    # capacity) cooperative only: a process that ignores CUDA_MPS_PIPE_DIRECTORY runs unlimited.
    activeThreadPercentage: 1..100
    pinnedMemoryLimit: 10Gi                                       # per device
    perDevice: {gpu-0: {pinnedMemoryLimit: 20Gi, activeThreadPercentage: 50}}  # name or UUID
    shmSize: 256Mi                       # the claim's /dev/shm, up to the platform's maxShmSize
```

Decoding is strict, like NVIDIA's StrictDecoder for its GpuConfig
(k8s-dra-driver-gpu api/nvidia.com/resource/v1beta1/api.go, sharing.go): an unknown field, a wrong
type or a field of the other strategy is an error that names the field's path. A typo must not
quietly give a pod an exclusive GPU it was meant to share, or the reverse.

Every value is a tenant's, decoded on the prepare path, so each is bounded in size and in the work
it costs before it is used: an object has at most :data:`MAX_FIELDS` fields, ``perDevice`` at most
one entry per device a claim can get, a quantity at most 64 characters with an exponent of at most
two digits, and nothing outside the known fields is walked (an error shows at most 60 characters
of a value). A decode costs the same for any input, whatever its size or depth."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from gpudra_core import limits
from gpudra_core.quantity import int64_value, parse_quantity

API_VERSION = "gpudra.io/v1alpha1"
KIND = "GpuConfig"

# MPS takes pinned memory limits in whole MiB (nvidia-cuda-mps-control
# set_default_device_pinned_mem_limit <uuid> <N>M): less would round to no limit at all.
MIN_PINNED_MEMORY = 2**20
_INT64 = range(-(2**63), 2**63)  # what the API server decodes a JSON integer into; beyond it, a float
# A quantity's text, bounded before it is parsed: the grammar of a Kubernetes quantity with an
# exponent of at most two digits (leading zeros aside). A value from 1Mi to the int64 maximum
# never needs more within 64 characters, and ParseQuantity (which the admission policy's
# isQuantity runs in the API server) costs time that grows with the exponent: it computes
# 10**exponent, for minutes at e2000000000. The policy matches the same pattern.
QUANTITY_FORM = r"^[+-]?[0-9]*([.][0-9]*)?([eE][+-]?0*[0-9]{1,2}|[KMGTPE]i|[numkMGTPE])?$"
_QUANTITY_FORM = re.compile(QUANTITY_FORM)
# Fields of one object of a config (the parameters, sharing, timeSlicing, mps, a perDevice entry),
# known or not: each knows at most 4, and up to 8 still lets an error name every typo.
MAX_FIELDS = 8
# perDevice: one entry per device of the claim at most (each names one, by name or by UUID).
MAX_PER_DEVICE = limits.MAX_ALLOCATION_RESULTS

# perDevice keys: a device's name in the pool (a DNS label, devicemodel) or an NVML UUID
# (GPU-<uuid>, MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>). Which device a key names, and
# whether the request got it, only prepare can tell.
_DEVICE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DEVICE_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z/-]+")


class Strategy(str, Enum):
    EXCLUSIVE = "Exclusive"
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


class Interval(str, Enum):
    """A time-slice length, as nvidia-smi compute-policy --set-timeslice names them."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"

    @property
    def nvidia_smi_value(self) -> int:
        """The argument of ``nvidia-smi compute-policy -i <uuid> --set-timeslice``."""
        return {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}[self.value]


@dataclass(frozen=True)
class TimeSlicing:
    interval: Interval = Interval.DEFAULT


@dataclass(frozen=True)
class MpsSettings:
    """Settings of one MPS control daemon's device; None: MPS's own default."""

    active_thread_percentage: int | None = None
    pinned_memory_limit: int | None = None  # bytes

    def over(self, defaults: MpsSettings) -> MpsSettings:
        """These settings, with ``defaults`` for the fields they leave unset."""
        return MpsSettings(
            self.active_thread_percentage if self.active_thread_percentage is not None
            else defaults.active_thread_percentage,
            self.pinned_memory_limit if self.pinned_memory_limit is not None else defaults.pinned_memory_limit)


@dataclass(frozen=True)
class Mps:
    defaults: MpsSettings = MpsSettings()
    # key (a device name or UUID, as written) -> its overrides, field by field
    per_device: Mapping[str, MpsSettings] = field(default_factory=lambda: MappingProxyType({}))
    shm_size: int | None = None  # bytes: the claim's /dev/shm (one per claim); None: the platform's default

    def for_devices(self, devices: Iterable[tuple[str, str]]) -> dict[str, MpsSettings]:
        """Each of a request's devices (``(name, uuid)`` pairs) -> its settings: the overrides of
        its perDevice entry over the defaults. A key that names none of them, or two keys that name
        the same one, is an error (only prepare knows the devices)."""
        devices = list(devices)
        keyed: dict[str, str] = {}  # key -> device name
        for name, uuid in devices:
            for key in (name, uuid):
                if key in self.per_device:
                    if name in keyed.values():
                        raise GpuConfigError(f"sharing.mps.perDevice.{key}", f"names device {name} again")
                    keyed[key] = name
        for key in self.per_device:
            if key not in keyed:
                raise GpuConfigError(f"sharing.mps.perDevice.{key}", "names no device of this request, which got "
                                     + ", ".join(f"{name} ({uuid})" for name, uuid in devices))
        overrides = {name: self.per_device[key] for key, name in keyed.items()}
        return {name: overrides.get(name, MpsSettings()).over(self.defaults) for name, _ in devices}


@dataclass(frozen=True)
class Sharing:
    """``time_slicing`` is set exactly when the strategy is TimeSlicing, ``mps`` exactly when it is
    MPS (filled with defaults when the config leaves the block out)."""

    strategy: Strategy = Strategy.EXCLUSIVE
    time_slicing: TimeSlicing | None = None
    mps: Mps | None = None


@dataclass(frozen=True)
class GpuConfig:
    sharing: Sharing = Sharing()


DEFAULT = GpuConfig()  # no config of ours for a request: an exclusive GPU


class GpuConfigError(ValueError):
    """A config that is not a valid GpuConfig. ``field`` is the path inside the parameters
    (``sharing.mps.activeThreadPercentage``), ``reason`` the rule it breaks, worded as the
    admission policy words it; ``where`` says which config of a claim it was."""

    def __init__(self, field: str, reason: str, *, got: str | None = None, where: str = "") -> None:
        self.field, self.reason, self.got, self.where = field, reason, got, where
        text = f"{field}: {reason}" + (f", got {got}" if got is not None else "")
        super().__init__(f"{where}: {text}" if where else text)

    def at(self, where: str) -> GpuConfigError:
        return GpuConfigError(self.field, self.reason, got=self.got, where=where)


_SHOWN = 60  # characters of a value an error shows


def _show(value: Any) -> str:
    """``value`` as JSON, cut to 60 characters. Built piece by piece and stopped once long enough,
    so a huge or deep value costs no more than what is shown."""
    text = ""
    for piece in _json_pieces(value):
        text += piece
        if len(text) > _SHOWN:
            return text[:_SHOWN - 3] + "..."
    return text


def _json_pieces(value: Any) -> Iterator[str]:
    """The JSON text of ``value`` in pieces (object keys in their order), lazily: a depth-first
    walk on an explicit stack, each piece short however long the string or integer it shows."""
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, _Piece):
            yield item.text
        elif isinstance(item, Mapping):
            stack.append(_members(item))
        elif isinstance(item, (list, tuple)):
            stack.append(_elements(item))
        else:
            yield _scalar(item)


class _Piece:
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_END = object()


def _members(mapping: Mapping[Any, Any]) -> Iterator[Any]:
    yield _Piece("{")
    for index, (key, member) in enumerate(mapping.items()):
        yield _Piece(("," if index else "") + _scalar(key) + ":")
        yield member
    yield _Piece("}")


def _elements(items: Sequence[Any]) -> Iterator[Any]:
    yield _Piece("[")
    for index, item in enumerate(items):
        if index:
            yield _Piece(",")
        yield item
    yield _Piece("]")


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value[:_SHOWN])
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length() * 3 // 10} digits>"  # str() of it: slow, or refused
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return f"<{type(value).__name__}>"


def _key(key: str) -> str:
    """An object key as a path shows it: at most 64 characters (the policy cuts it alike)."""
    return key if len(key) <= 64 else key[:61] + "..."


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise GpuConfigError(path or "parameters", "must be an object", got=_show(value))
    return value


def _object(value: Any, path: str, known: Sequence[str]) -> Mapping[str, Any]:
    """``value`` as an object with no fields but ``known`` (at most :data:`MAX_FIELDS`, counted
    before any is looked at)."""
    body = _mapping(value, path)
    if len(body) > MAX_FIELDS:
        raise GpuConfigError(path or "parameters", f"must have at most {MAX_FIELDS} fields", got=str(len(body)))
    for key in sorted(body):
        if key not in known:
            raise GpuConfigError(f"{path}.{_key(key)}" if path else _key(key), "unknown field")
    return body


def _enum(value: Any, path: str, enum: type[Strategy] | type[Interval]) -> Any:
    for member in enum:
        if value == member.value and isinstance(value, str):
            return member
    raise GpuConfigError(path, "must be one of " + ", ".join(m.value for m in enum), got=_show(value))


def _percentage(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise GpuConfigError(path, "must be an integer between 1 and 100", got=_show(value))
    return value


MEMORY_RULE = ("must be a quantity from 1Mi to the int64 maximum (e.g. 10Gi), "
               "at most 64 characters with an exponent of at most 2 digits")


def _memory(value: Any, path: str) -> int:
    """Bytes, rounded up to a whole byte like apimachinery's Quantity.Value(). JSON carries a
    quantity as a string or an integer; a float is neither. A string is bounded (length, then
    form) before it is parsed, and its value before it is made an integer (:func:`int64_value`)."""
    amount: int | None = None
    if isinstance(value, str):
        if len(value) <= limits.MAX_QUANTITY_LENGTH and _QUANTITY_FORM.fullmatch(value):
            try:
                amount = int64_value(value)
            except ValueError:
                pass
    elif isinstance(value, int) and not isinstance(value, bool) and value in _INT64:
        amount = value
    # The minimum holds for the value as written, as the admission policy's compareTo judges it:
    # 1048575.1 rounds up to 1Mi but is less.
    if amount is None or amount < MIN_PINNED_MEMORY \
            or amount == MIN_PINNED_MEMORY and isinstance(value, str) and parse_quantity(value) < MIN_PINNED_MEMORY:
        raise GpuConfigError(path, MEMORY_RULE, got=_show(value))
    return amount


_MPS_SETTINGS = ("activeThreadPercentage", "pinnedMemoryLimit")


def _mps_settings(body: Mapping[str, Any], path: str) -> MpsSettings:
    percentage = body.get("activeThreadPercentage")
    limit = body.get("pinnedMemoryLimit")
    return MpsSettings(
        _percentage(percentage, f"{path}activeThreadPercentage") if "activeThreadPercentage" in body else None,
        _memory(limit, f"{path}pinnedMemoryLimit") if "pinnedMemoryLimit" in body else None)


def _mps(value: Any) -> Mps:
    body = _object(value, "sharing.mps", (*_MPS_SETTINGS, "perDevice", "shmSize"))
    per_device: dict[str, MpsSettings] = {}
    if "perDevice" in body:
        entries = _mapping(body["perDevice"], "sharing.mps.perDevice")
        if len(entries) > MAX_PER_DEVICE:
            raise GpuConfigError("sharing.mps.perDevice", f"must have at most {MAX_PER_DEVICE} entries, "
                                 "one per device of the claim", got=str(len(entries)))
        for key in sorted(entries):
            path = f"sharing.mps.perDevice.{_key(key)}"
            if not (len(key) <= 63 and _DEVICE_NAME.fullmatch(key) or len(key) <= 64 and _DEVICE_UUID.fullmatch(key)):
                raise GpuConfigError(path, "must be a device name in the pool (gpu-0) or a GPU UUID")
            per_device[key] = _mps_settings(_object(entries[key], path, _MPS_SETTINGS), f"{path}.")
    shm_size = _memory(body["shmSize"], "sharing.mps.shmSize") if "shmSize" in body else None
    return Mps(_mps_settings(body, "sharing.mps."), MappingProxyType(per_device), shm_size)


def decode(parameters: object) -> GpuConfig:
    """The GpuConfig in an opaque config's ``parameters``; :class:`GpuConfigError` naming the first
    field that breaks a rule."""
    body = _mapping(parameters, "")
    if body.get("apiVersion") != API_VERSION:
        raise GpuConfigError("apiVersion", f"must be {API_VERSION}",
                             got=_show(body["apiVersion"]) if "apiVersion" in body else None)
    if body.get("kind") != KIND:
        raise GpuConfigError("kind", f"must be {KIND}", got=_show(body["kind"]) if "kind" in body else None)
    _object(body, "", ("apiVersion", "kind", "sharing"))
    if "sharing" not in body:
        return DEFAULT
    sharing = _object(body["sharing"], "sharing", ("strategy", "timeSlicing", "mps"))
    strategy = _enum(sharing["strategy"], "sharing.strategy", Strategy) if "strategy" in sharing \
        else Strategy.EXCLUSIVE
    for block, owner in (("timeSlicing", Strategy.TIME_SLICING), ("mps", Strategy.MPS)):
        if block in sharing:
            _mapping(sharing[block], f"sharing.{block}")
            if strategy is not owner:  # NVIDIA's GetTimeSlicingConfig/GetMpsConfig refuse the mix too
                raise GpuConfigError(f"sharing.{block}", f"allowed only with strategy {owner.value}",
                                     got=f"strategy {strategy.value}")
    time_slicing = mps = None
    if strategy is Strategy.TIME_SLICING:
        slicing = _object(sharing.get("timeSlicing", {}), "sharing.timeSlicing", ("interval",))
        time_slicing = TimeSlicing(_enum(slicing["interval"], "sharing.timeSlicing.interval", Interval)
                                   if "interval" in slicing else Interval.DEFAULT)
    if strategy is Strategy.MPS:
        mps = _mps(sharing.get("mps", {}))
    return GpuConfig(Sharing(strategy, time_slicing, mps))


# --- a request's config ----------------------------------------------------------------------------
_SOURCES = ("FromClass", "FromClaim")  # k8s.io/api resource/v1 AllocationConfigSource, in precedence order


def _applies(requests: Sequence[str] | None, request: str) -> bool:
    """resource/v1 DeviceAllocationConfiguration.requests: empty means every request; a main
    request's name also covers its subrequests (``<main>/<sub>``)."""
    return not requests or any(r == request or request.startswith(r + "/") for r in requests)


def config_for_request(configs: Sequence[Mapping[str, Any]], driver: str, request: str, *,
                       decode: Callable[[object], GpuConfig] = decode) -> GpuConfig:
    """The GpuConfig for one request of an allocated claim, from its ``status.allocation.devices.config``.

    Only opaque configs of ``driver`` that apply to ``request`` count; others' configs are none of
    ours (types.go: drivers ignore configuration that is not theirs). Class configs come before
    claim configs, each in list order, and the last one wins as a whole object: the claim's
    author overrides the class's defaults. The API defines the source flag and the request
    matching; the precedence is the one the reference drivers implement (dra-example-driver's
    and NVIDIA's GetOpaqueDeviceConfigs). No config: :data:`DEFAULT` (Exclusive).

    Every config that applies is decoded, also one a later config overrides, so a broken class
    config is reported rather than hidden behind claims that override it. Errors name the
    config's index in the allocation, its source and, for a claim's, its index in the claim.
    ``decode``: :func:`decode`, or a memo of it (a caller asking for every request of a claim
    decodes each config once)."""
    candidates: list[tuple[int, str, str, Any]] = []
    claim_index = 0
    for index, config in enumerate(configs):
        source = config.get("source")
        where = f"status.allocation.devices.config[{index}]"
        if source == "FromClaim":
            where += f" (FromClaim, spec.devices.config[{claim_index}])"
            claim_index += 1
        elif source == "FromClass":
            where += " (FromClass)"
        else:
            raise GpuConfigError("source", "must be FromClass or FromClaim", got=_show(source), where=where)
        opaque = config.get("opaque")
        # Not opaque: a kind of configuration newer than this code, which names no driver to own it.
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        if _applies(config.get("requests"), request):
            candidates.append((_SOURCES.index(source), where, source, opaque.get("parameters")))
    chosen = DEFAULT
    for _, where, _, parameters in sorted(candidates, key=lambda c: c[0]):  # stable: list order kept
        try:
            chosen = decode(parameters)
        except GpuConfigError as error:
            raise error.at(where) from None
    return chosen
