"""A claim's allocation as this driver reads it (pure): checked and bounded before any lock.

Everything a prepare takes from a ResourceClaim is tenant input: its requests' names and its
opaque configs are the claim author's, copied into ``status.allocation`` by the scheduler. So
:func:`read_claim` reads the claim once, before the prepare queues for the node, and refuses
cheaply what the API server never accepts: more results or configs than the API allows, a name
that is no DNS label, an opaque config of ours over the API's 10 KiB. It then decodes each of our
configs once (:mod:`gpudra_driver.gpuconfig`) and gives the planner (:mod:`.prepare`), which runs
under the node lock, typed values that cost nothing more to use. A bad claim is its own error;
its neighbours in the call, and the calls queued behind it, never wait for its checks.

The bounds are the API's own (resource/v1, see :mod:`gpudra_core.limits`): a claim the API
server accepted always passes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpudra_core import limits
from gpudra_driver import gpuconfig
from gpudra_driver.gpuconfig import GpuConfig, GpuConfigError, Strategy
from gpudra_driver.plugin.devicemetadata import pod_claim_name
from gpudra_driver.plugin.model import ClaimError, ClaimRef, is_uid
from gpudra_core.quantity import int64_value

RESULTS = "status.allocation.devices.results"
CONFIG = "status.allocation.devices.config"


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver."""

    request: str  # as allocated: "<request>" or "<request>/<subrequest>"
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None  # consumable capacity (KEP-5075): the share of the device
    consumed: tuple[tuple[str, int], ...] = ()  # capacity name -> base units, sorted


@dataclass(frozen=True)
class ClaimAllocation:
    """What preparing the claim needs from it, read and checked."""

    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]  # this driver's results, in the allocation's order
    # each ``metadata.name In [...]`` of the allocation's node selector (the scheduler pins
    # node-local allocations so)
    node_names: tuple[frozenset[str], ...] = ()
    # each request of ``devices`` -> its GpuConfig, or why it has none (reported once the claim
    # needs it: an already prepared claim is answered whatever its configs say)
    configs: Mapping[str, GpuConfig | ClaimError] = field(default_factory=lambda: MappingProxyType({}))
    # the claim's pod-local name (a template's claim), a DNS label or None (:mod:`.devicemetadata`)
    pod_claim_name: str | None = None

    @property
    def shares_gpus(self) -> bool:
        """Some request asks for GPU sharing: preparing it calls into the driver."""
        return any(isinstance(c, GpuConfig) and c.sharing.strategy is not Strategy.EXCLUSIVE
                   for c in self.configs.values())


# A claim as read before the locks: what planning needs from it, or why it is refused.
ReadClaim = ClaimAllocation | ClaimError


def read_claim(ref: ClaimRef, fetched: Mapping[str, Any] | ClaimError | None, *,
               driver: str) -> ClaimAllocation | ClaimError:
    """The claim's allocation (``fetched``: the GET's result, None when not found, or why the GET
    failed), or the :class:`ClaimError` that refuses it, naming the claim and the field."""
    try:
        ref.check()
        if isinstance(fetched, ClaimError):
            return fetched
        if fetched is None:
            return ClaimError(f"{ref}: not found")
        return _read(ref, fetched, driver)
    except ClaimError as error:
        return error
    except Exception as error:  # noqa: BLE001 - a shape no API server returns: this claim's error
        return ClaimError(f"{ref}: its allocation cannot be read: {_show(error)}")


def _read(ref: ClaimRef, claim: Mapping[str, Any], driver: str) -> ClaimAllocation:
    if not isinstance(claim, Mapping):
        raise ClaimError(f"{ref}: not a ResourceClaim: {_show(claim)}")
    metadata = _mapping(ref, claim.get("metadata"), "metadata")
    uid = metadata.get("uid")
    if uid != ref.uid:
        raise ClaimError(f"{ref}: the API server has UID {_show(uid)}; the claim was replaced")
    allocation = _mapping(ref, claim.get("status"), "status").get("allocation")
    if not allocation:
        raise ClaimError(f"{ref}: not allocated")
    allocation = _mapping(ref, allocation, "status.allocation")
    devices = _mapping(ref, allocation.get("devices"), "status.allocation.devices")
    results = _list(ref, devices.get("results"), RESULTS, limits.MAX_ALLOCATION_RESULTS)
    configs = _list(ref, devices.get("config"), CONFIG, limits.MAX_ALLOCATION_CONFIGS)
    ours = tuple(_result(ref, raw, f"{RESULTS}[{index}]") for index, raw in enumerate(results)
                 if _driver_of(ref, raw, f"{RESULTS}[{index}]") == driver)
    for index, raw in enumerate(configs):
        _check_config(ref, raw, f"{CONFIG}[{index}]", driver)
    return ClaimAllocation(ref, ours, _node_names(ref, allocation.get("nodeSelector")),
                           _configs_by_request(ref, configs, driver, {d.request for d in ours}),
                           pod_claim_name(metadata.get("annotations")))


def _result(ref: ClaimRef, raw: Mapping[str, Any], where: str) -> AllocatedDevice:
    request = _request_reference(ref, raw.get("request"), f"{where}.request")
    pool = raw.get("pool")
    if not isinstance(pool, str) or not 0 < len(pool) <= limits.MAX_POOL_NAME_LENGTH:
        raise ClaimError(f"{ref}: {where}.pool: {_show(pool)} is not a pool name")
    device = raw.get("device")
    if not isinstance(device, str) or not limits.is_dns_label(device):
        raise ClaimError(f"{ref}: {where}.device: {_show(device)} is not a device name (a DNS label)")
    admin_access = raw.get("adminAccess")
    if admin_access is not None and not isinstance(admin_access, bool):
        raise ClaimError(f"{ref}: {where}.adminAccess: {_show(admin_access)} is not a boolean")
    share_id = raw.get("shareID")
    if share_id is not None and not (isinstance(share_id, str) and is_uid(share_id)):
        raise ClaimError(f"{ref}: {where}.shareID: {_show(share_id)} is not a UID")
    consumed = _consumed(ref, raw.get("consumedCapacity"), f"{where}.consumedCapacity")
    return AllocatedDevice(request, pool, device, bool(admin_access), share_id, consumed)


def _driver_of(ref: ClaimRef, raw: Any, where: str) -> str:
    driver = _mapping(ref, raw, where).get("driver")
    if not isinstance(driver, str) or len(driver) > limits.MAX_DRIVER_NAME_LENGTH:
        raise ClaimError(f"{ref}: {where}.driver: {_show(driver)} is not a driver name")
    return driver


def _request_reference(ref: ClaimRef, value: Any, where: str) -> str:
    """``<request>`` or ``<request>/<subrequest>``, each a DNS label (validateRequestNameRef)."""
    if not (isinstance(value, str) and len(value) <= limits.MAX_REQUEST_REFERENCE_LENGTH
            and 1 <= len(parts := value.split("/")) <= 2 and all(limits.is_dns_label(p) for p in parts)):
        raise ClaimError(f"{ref}: {where}: {_show(value)} is not a request name")
    return value


def _consumed(ref: ClaimRef, raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    """consumedCapacity: capacity name -> base units. Our devices' capacities are int64s, so a
    larger value was never granted: refused before rounding it up, which for ``1e300000``
    alone would take seconds."""
    if raw is None:
        return ()
    entries = _mapping(ref, raw, where)
    if len(entries) > limits.MAX_CONSUMED_CAPACITIES:
        raise ClaimError(f"{ref}: {where}: {len(entries)} entries; a device has at most "
                         f"{limits.MAX_CONSUMED_CAPACITIES} capacities")
    consumed = []
    for name, value in entries.items():
        if not isinstance(name, str) or len(name) > limits.MAX_DOMAIN_LENGTH + 1 + limits.MAX_ID_LENGTH:
            raise ClaimError(f"{ref}: {where}: {_show(name)} is not a capacity name")
        amount: int | None = None
        if isinstance(value, str) and len(value) <= limits.MAX_QUANTITY_LENGTH:
            try:
                amount = int64_value(value)
            except (ValueError, ArithmeticError):
                pass
        elif isinstance(value, int) and not isinstance(value, bool) and value <= limits.INT64_MAX:
            amount = value
        if amount is None or amount < 0:
            raise ClaimError(f"{ref}: {where}.{name}: {_show(value)} is not a quantity this driver's "
                             "devices have")
        consumed.append((name, amount))
    return tuple(sorted(consumed))


def _check_config(ref: ClaimRef, raw: Any, where: str, driver: str) -> None:
    """The bounds of one allocation config; the parameters only of ours (others' are not read)."""
    config = _mapping(ref, raw, where)
    requests = config.get("requests")
    if requests is not None:
        for index, name in enumerate(_list(ref, requests, f"{where}.requests", limits.MAX_CONFIG_REQUESTS)):
            _request_reference(ref, name, f"{where}.requests[{index}]")
    opaque = config.get("opaque")
    if isinstance(opaque, Mapping) and opaque.get("driver") == driver:
        size = json_size_at_least(opaque.get("parameters"), limits.MAX_OPAQUE_PARAMETERS_LENGTH)
        if size > limits.MAX_OPAQUE_PARAMETERS_LENGTH:
            raise ClaimError(f"{ref}: {where}.opaque.parameters: over {limits.MAX_OPAQUE_PARAMETERS_LENGTH} "
                             "bytes of JSON; the API allows no more")


def _configs_by_request(ref: ClaimRef, configs: Sequence[Any], driver: str,
                        requests: set[str]) -> Mapping[str, GpuConfig | ClaimError]:
    """Each request's GpuConfig (:func:`gpuconfig.config_for_request`), each config decoded once
    however many requests it applies to."""
    decoded: dict[int, GpuConfig | GpuConfigError] = {}  # id(parameters) -> decode(parameters)

    def decode_once(parameters: object) -> GpuConfig:
        key = id(parameters)  # the parameters stay alive (in ``configs``) while this runs
        if key not in decoded:
            try:
                decoded[key] = gpuconfig.decode(parameters)
            except GpuConfigError as error:
                decoded[key] = error
            except Exception as error:  # noqa: BLE001 - a decoder bug on odd input: this claim's error
                decoded[key] = GpuConfigError("parameters", f"cannot be decoded: {_show(error)}")
        result = decoded[key]
        if isinstance(result, GpuConfigError):
            raise result
        return result

    chosen: dict[str, GpuConfig | ClaimError] = {}
    for request in sorted(requests):
        try:
            chosen[request] = gpuconfig.config_for_request(configs, driver, request, decode=decode_once)
        except GpuConfigError as error:
            chosen[request] = ClaimError(f"{ref}: {error}")
    return MappingProxyType(chosen)


def _node_names(ref: ClaimRef, raw: Any) -> tuple[frozenset[str], ...]:
    if raw is None:
        return ()
    where = "status.allocation.nodeSelector.nodeSelectorTerms"
    terms = _mapping(ref, raw, "status.allocation.nodeSelector").get("nodeSelectorTerms") or []
    names = []
    for t, term in enumerate(_list(ref, terms, where)):
        fields = _mapping(ref, term, f"{where}[{t}]").get("matchFields") or []
        for e, expression in enumerate(_list(ref, fields, f"{where}[{t}].matchFields")):
            expression = _mapping(ref, expression, f"{where}[{t}].matchFields[{e}]")
            if expression.get("key") == "metadata.name" and expression.get("operator") == "In":
                values = _list(ref, expression.get("values") or [], f"{where}[{t}].matchFields[{e}].values")
                names.append(frozenset(v for v in values if isinstance(v, str)))
    return tuple(names)


def json_size_at_least(value: object, limit: int) -> int:
    """A lower bound of the bytes ``value`` takes as JSON (the API server measures the raw JSON it
    was sent, escapes and spaces included, which is never less), counted only until it passes
    ``limit``: the walk costs O(``limit``) steps, whatever the value's size or depth. Each value
    taken from the stack adds at least one byte, and an object's or array's members are read only
    while its own punctuation (a byte or two per member) has not passed the limit, so all members
    read add up to at most ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item: Any = stack.pop()
        # JSON's own types by type() first: isinstance(..., Mapping) costs more than all the rest
        if type(item) is str or isinstance(item, str):
            total += len(item) + 2  # a code point is at least one byte; the quotes
        elif type(item) is dict or isinstance(item, Mapping):
            total += 1 + 2 * len(item)  # braces, commas, colons (at least as many as entries)
            if total > limit:  # a million keys are not read to learn what their count says
                break
            for key, member in item.items():
                total += len(key) + 2 if isinstance(key, str) else 1
                stack.append(member)
        elif isinstance(item, (list, tuple)):
            total += 1 + len(item)  # brackets and commas
            if total > limit:
                break
            stack.extend(item)
        elif isinstance(item, bool) or item is None:
            total += 4
        elif isinstance(item, int):  # digits: bit_length * log10(2), without formatting a huge int
            total += max(1, item.bit_length() * 3 // 10)
        else:  # a float (at least "1e0"), or anything else a JSON value is at least
            total += 1
    return total


def _mapping(ref: ClaimRef, value: Any, where: str) -> Mapping[str, Any]:
    if type(value) is dict:  # what JSON gives; isinstance(..., Mapping) is the slow path
        return value
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ClaimError(f"{ref}: {where}: {_show(value)} is not an object")
    return value


def _list(ref: ClaimRef, value: Any, where: str, limit: int | None = None) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ClaimError(f"{ref}: {where}: {_show(value)} is not a list")
    if limit is not None and len(value) > limit:
        raise ClaimError(f"{ref}: {where}: {len(value)} entries; the API allows at most {limit}")
    return value


def _show(value: Any, width: int = 40) -> str:
    """``value`` for an error message, in bounded time and length (it may be huge or deep)."""
    if isinstance(value, BaseException):
        text = f"{type(value).__name__}: {value}" if not isinstance(value, RecursionError) else "nested too deeply"
        return text if len(text) <= 2 * width else text[:2 * width] + "..."
    if isinstance(value, str):
        return repr(value) if len(value) <= width else repr(value[:width]) + "..."
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, Mapping):
        return "an object"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"
