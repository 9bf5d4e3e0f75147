"""The one typed view of a GpuDraConfig: frozen dataclasses parsed from the object's dict.

The CRD (``crds/gpudraconfig.yaml``) is the description of the spec; this module only reads it.
Defaults here mirror the CRD's ``default:`` values (a unit test applies the CRD's defaults and
compares), so an object that skipped API-server defaulting, e.g. a file given to ``gpudra render``,
reads the same as one the API server stored. Validation is the CRD's job (schema + CEL); parsing
here only refuses values of the wrong shape, with :class:`SpecError` naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpudra_core.consumable import MAX_SHARES, parse_memory_step
from gpudra_core.migpolicy import DEFAULT_MIG_MODE, MIG_MODES, MigNodeGroup, MigPolicy

DEFAULT_DRIVER_NAME = "gpu.gpudra.io"
DEFAULT_NAMESPACE = "gpudra-system"

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class SpecError(ValueError):
    """A GpuDraConfig field of the wrong shape; ``path`` is the field (e.g. ``spec.agent.image``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


# -- durations -----------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                 "h": 3600.0}


def parse_duration(text: str) -> float:
    """A Go ``time.Duration`` string (``90s``, ``5m``, ``1h30m``, ``1.5h``, ``0``) in seconds."""
    if not isinstance(text, str):
        raise ValueError(f"a duration must be a string such as '60s', got {text!r}")
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"{text!r} is not a duration")
    total, pos = 0.0, 0
    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if not m or m.group(1) in ("", "."):
            raise ValueError(f"{text!r} is not a duration (e.g. 60s, 5m, 1h30m)")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    return sign * total


# -- small readers -------------------------------------------------------------------------------

def _map(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return _EMPTY
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(path, f"must be a list, got {type(value).__name__}")
    return value


def _str(value: Any, path: str, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {value!r}")
    return value


def _bool(value: Any, path: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, got {value!r}")
    return value


def _int_or_str(value: Any, path: str, default: int | str) -> int | str:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(path, f"must be an integer or a percentage string, got {value!r}")
    return value


def _str_map(value: Any, path: str) -> Mapping[str, str]:
    items = _map(value, path)
    for key, val in items.items():
        if not isinstance(val, str):
            raise SpecError(f"{path}.{key}", f"must be a string, got {val!r}")
    return MappingProxyType(dict(items))


def _duration(value: Any, path: str, default: str) -> float:
    try:
        return parse_duration(_str(value, path, default))
    except ValueError as error:
        raise SpecError(path, str(error)) from None


def _freeze(value: Any) -> Any:
    """Deep read-only copy of plain JSON data (dicts become mappingproxies, lists tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The plain-dict/list form of a frozen value, ready to go into a manifest."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


# -- the view ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str = ""


@dataclass(frozen=True)
class UpdateStrategy:
    """DaemonSet rolling update: exactly one of the two is non-zero (the CRD enforces it)."""

    max_unavailable: int | str = 0
    max_surge: int | str = 1


@dataclass(frozen=True)
class AgentSpec:
    image: str = ""  # unset: the operator's own agent image (render's agent_image)
    image_pull_policy: str = "IfNotPresent"
    namespace: str = DEFAULT_NAMESPACE
    node_selector: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    affinity: Mapping[str, Any] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _EMPTY)
    priority_class_name: str = "system-node-critical"
    update_strategy: UpdateStrategy = field(default_factory=UpdateStrategy)
    kubelet_dir: str = "/var/lib/kubelet"
    cdi_dir: str = "/var/run/cdi"
    driver_root: str = "/"
    allow_device_plugin: bool = False
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[EnvVar, ...] = ()

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec.agent") -> AgentSpec:
        d = _map(data, path)
        strategy = _map(d.get("updateStrategy"), f"{path}.updateStrategy")
        defaults = UpdateStrategy()
        env: list[EnvVar] = []
        for i, item in enumerate(_list(d.get("extraEnv"), f"{path}.extraEnv")):
            item = _map(item, f"{path}.extraEnv[{i}]")
            env.append(EnvVar(_str(item.get("name"), f"{path}.extraEnv[{i}].name", ""),
                              _str(item.get("value"), f"{path}.extraEnv[{i}].value", "")))
        args = [_str(a, f"{path}.extraArgs[{i}]", "")
                for i, a in enumerate(_list(d.get("extraArgs"), f"{path}.extraArgs"))]
        tolerations = [_freeze(_map(t, f"{path}.tolerations[{i}]"))
                       for i, t in enumerate(_list(d.get("tolerations"), f"{path}.tolerations"))]
        affinity = d.get("affinity")
        return cls(
            image=_str(d.get("image"), f"{path}.image", cls.image),
            image_pull_policy=_str(d.get("imagePullPolicy"), f"{path}.imagePullPolicy",
                                   cls.image_pull_policy),
            namespace=_str(d.get("namespace"), f"{path}.namespace", cls.namespace),
            node_selector=_str_map(d.get("nodeSelector"), f"{path}.nodeSelector"),
            affinity=None if affinity is None else _freeze(_map(affinity, f"{path}.affinity")),
            tolerations=tuple(tolerations),
            resources=_freeze(_map(d.get("resources"), f"{path}.resources")),
            priority_class_name=_str(d.get("priorityClassName"), f"{path}.priorityClassName",
                                     cls.priority_class_name),
            update_strategy=UpdateStrategy(
                max_unavailable=_int_or_str(strategy.get("maxUnavailable"),
                                            f"{path}.updateStrategy.maxUnavailable",
                                            defaults.max_unavailable),
                max_surge=_int_or_str(strategy.get("maxSurge"), f"{path}.updateStrategy.maxSurge",
                                      defaults.max_surge),
            ),
            kubelet_dir=_str(d.get("kubeletDir"), f"{path}.kubeletDir", cls.kubelet_dir),
            cdi_dir=_str(d.get("cdiDir"), f"{path}.cdiDir", cls.cdi_dir),
            driver_root=_str(d.get("driverRoot"), f"{path}.driverRoot", cls.driver_root),
            allow_device_plugin=_bool(d.get("allowDevicePlugin"), f"{path}.allowDevicePlugin", cls.allow_device_plugin),
            extra_args=tuple(args),
            extra_env=tuple(env),
        )


@dataclass(frozen=True)
class DeviceClassSpec:
    """One entry of spec.deviceClasses: a built-in ``template`` or an ``inline`` Jinja2 source."""

    name: str
    template: str | None = None
    parameters: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    inline: str | None = None
    extended_resource_name: str | None = None

    @classmethod
    def from_dict(cls, data: Any, path: str) -> DeviceClassSpec:
        d = _map(data, path)
        template, inline = d.get("template"), d.get("inline")
        return cls(
            name=_str(d.get("name"), f"{path}.name", ""),
            template=None if template is None else _str(template, f"{path}.template", ""),
            parameters=_str_map(d.get("parameters"), f"{path}.parameters"),
            inline=None if inline is None else _str(inline, f"{path}.inline", ""),
            extended_resource_name=None if d.get("extendedResourceName") is None
            else _str(d.get("extendedResourceName"), f"{path}.extendedResourceName", ""),
        )


@dataclass(frozen=True)
class GcSpec:
    """ResourceSlice GC settings; durations in seconds."""

    enabled: bool = True
    interval: float = 60.0
    grace_period: float = 300.0
    dry_run: bool = False

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec.resourceSliceGC") -> GcSpec:
        d = _map(data, path)
        return cls(
            enabled=_bool(d.get("enabled"), f"{path}.enabled", cls.enabled),
            interval=_duration(d.get("interval"), f"{path}.interval", "60s"),
            grace_period=_duration(d.get("gracePeriod"), f"{path}.gracePeriod", "5m"),
            dry_run=_bool(d.get("dryRun"), f"{path}.dryRun", cls.dry_run),
        )


def _int(value: Any, path: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ConsumableCapacitySpec:
    """spec.sharing.consumableCapacity (KEP-5075): full GPUs published for several claims each.
    ``memory_step`` as written (a quantity), ``memory_step_bytes`` its value."""

    memory_step: str = "1Gi"
    shares: int = 0

    @property
    def memory_step_bytes(self) -> int:
        return parse_memory_step(self.memory_step)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> ConsumableCapacitySpec:
        d = _map(data, path)
        spec = cls(memory_step=_str(d.get("memoryStep"), f"{path}.memoryStep", cls.memory_step),
                   shares=_int(d.get("shares"), f"{path}.shares", cls.shares))
        try:  # the CRD's CEL refuses these too; a file given to `gpudra render` has not been through it
            spec.memory_step_bytes
        except ValueError as error:
            raise SpecError(f"{path}.memoryStep", str(error)) from None
        if not 0 <= spec.shares <= MAX_SHARES:
            raise SpecError(f"{path}.shares", f"must be 0..{MAX_SHARES}, got {spec.shares}")
        return spec


@dataclass(frozen=True)
class MpsSpec:
    """spec.sharing.mps: the MPS supervisor runs. ``shm_size``: the size of an MPS claim's /dev/shm
    tmpfs unless its GpuConfig asks (``sharing.mps.shmSize``), ``max_shm_size`` the most it may ask
    for; quantities as written."""

    shm_size: str = "64Mi"
    max_shm_size: str = "1Gi"

    @classmethod
    def from_dict(cls, data: Any, path: str) -> MpsSpec:
        d = _map(data, path)
        spec = cls(shm_size=_str(d.get("shmSize"), f"{path}.shmSize", cls.shm_size),
                   max_shm_size=_str(d.get("maxShmSize"), f"{path}.maxShmSize", cls.max_shm_size))
        # the CRD's CEL refuses these too; a file given to `gpudra render` has not been through it
        sizes = {name: _shm_bytes(value, f"{path}.{name}")
                 for name, value in (("shmSize", spec.shm_size), ("maxShmSize", spec.max_shm_size))}
        if sizes["shmSize"] > sizes["maxShmSize"]:
            raise SpecError(f"{path}.shmSize", f"{spec.shm_size} is more than maxShmSize ({spec.max_shm_size})")
        return spec


def _shm_bytes(text: str, path: str) -> int:
    try:
        size = parse_memory_step(text)
    except ValueError as error:
        raise SpecError(path, str(error)) from None
    if size < MIN_SHM_SIZE:
        raise SpecError(path, f"{text!r} is less than 1Mi")
    return size


MIN_SHM_SIZE = 2**20  # below a MiB, MPS's own files in /dev/shm would not fit


@dataclass(frozen=True)
class SharingSpec:
    """spec.sharing: how GPUs may be shared between ResourceClaims. ``consumable_capacity`` None:
    not at all (one claim per device). ``mps``: the MPS supervisor DaemonSet runs, so that claims
    may ask for MPS (their GpuConfig); None: they are refused, saying so."""

    consumable_capacity: ConsumableCapacitySpec | None = None
    mps: MpsSpec | None = None

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec.sharing") -> SharingSpec:
        d = _map(data, path)
        consumable = d.get("consumableCapacity")
        return cls(consumable_capacity=None if consumable is None else
                   ConsumableCapacitySpec.from_dict(consumable, f"{path}.consumableCapacity"),
                   mps=None if d.get("mps") is None else MpsSpec.from_dict(d["mps"], f"{path}.mps"))


@dataclass(frozen=True)
class MigSpec:
    """spec.mig: how the agents publish MIG-capable GPUs, by default and per node group (the
    agent's ``--mig`` and ``--mig-node-group``; :mod:`gpudra_core.migpolicy`)."""

    mode: str = DEFAULT_MIG_MODE
    node_groups: tuple[MigNodeGroup, ...] = ()

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec.mig") -> MigSpec:
        d = _map(data, path)
        mode = _str(d.get("mode"), f"{path}.mode", cls.mode)
        if mode not in MIG_MODES:
            raise SpecError(f"{path}.mode", f"must be one of {', '.join(MIG_MODES)}, not {mode!r}")
        groups = []
        for i, g in enumerate(_list(d.get("nodeGroups"), f"{path}.nodeGroups")):
            where = f"{path}.nodeGroups[{i}]"
            group = _map(g, where)
            try:
                groups.append(MigNodeGroup(_str(group.get("name"), f"{where}.name", ""),
                                           _str(group.get("mode"), f"{where}.mode", ""),  # type: ignore[arg-type]
                                           _str_map(group.get("nodeSelector"), f"{where}.nodeSelector")))
            except ValueError as error:
                raise SpecError(where, str(error)) from None
        try:
            return cls(mode=mode, node_groups=MigPolicy(mode, tuple(groups)).groups)  # type: ignore[arg-type]
        except ValueError as error:
            raise SpecError(f"{path}.nodeGroups", str(error)) from None

    @property
    def policy(self) -> MigPolicy:
        return MigPolicy(self.mode, self.node_groups)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GpuDraConfigSpec:
    driver_name: str = DEFAULT_DRIVER_NAME
    agent: AgentSpec = field(default_factory=AgentSpec)
    device_classes: tuple[DeviceClassSpec, ...] = ()
    resource_slice_gc: GcSpec = field(default_factory=GcSpec)
    sharing: SharingSpec = field(default_factory=SharingSpec)
    mig: MigSpec = field(default_factory=MigSpec)

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec") -> GpuDraConfigSpec:
        d = _map(data, path)
        classes = _list(d.get("deviceClasses"), f"{path}.deviceClasses")
        return cls(
            driver_name=_str(d.get("driverName"), f"{path}.driverName", cls.driver_name),
            agent=AgentSpec.from_dict(d.get("agent"), f"{path}.agent"),
            device_classes=tuple(DeviceClassSpec.from_dict(c, f"{path}.deviceClasses[{i}]")
                                 for i, c in enumerate(classes)),
            resource_slice_gc=GcSpec.from_dict(d.get("resourceSliceGC"), f"{path}.resourceSliceGC"),
            sharing=SharingSpec.from_dict(d.get("sharing"), f"{path}.sharing"),
            mig=MigSpec.from_dict(d.get("mig"), f"{path}.mig"),
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> GpuDraConfigSpec:
        """The spec of a GpuDraConfig object (kopf body or plain dict)."""
        return cls.from_dict(_map(body, "body").get("spec"))


@dataclass(frozen=True)
class GpuDraConfig:
    """A GpuDraConfig's identity (what owner references and labels need) plus its spec."""

    name: str
    uid: str | None
    generation: int | None
    spec: GpuDraConfigSpec

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> GpuDraConfig:
        meta = _map(_map(body, "body").get("metadata"), "metadata")
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError("metadata.name", "a GpuDraConfig needs a name")
        generation = meta.get("generation")
        return cls(
            name=name,
            uid=meta.get("uid") or None,
            generation=generation if isinstance(generation, int) else None,
            spec=GpuDraConfigSpec.from_body(body),
        )
