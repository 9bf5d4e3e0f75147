"""Which MIG mode a node's agent uses: ``spec.mig`` of the GpuDraConfig, pure.

A config names a default mode and, optionally, node groups: each a name, a mode and a node
selector (labels a Node must all carry, as a pod's ``nodeSelector``). The first group whose
selector matches the node's labels wins; no match means the default. The operator writes the policy
into the agent's arguments (:func:`policy_args`); each agent reads it back (:func:`parse_node_group`)
and resolves it against its own Node's labels (:meth:`MigPolicy.for_labels`), again when they change.

The modes, for a MIG-capable GPU (docs/mig.md):

``whole``
    the GPU as one device; a GPU whose MIG mode is enabled cannot be used whole, so it publishes
    nothing and is reported not ready.
``static``
    the MIG devices that exist (created beforehand, by an administrator or NVIDIA's mig-manager).
``dynamic``
    every placement the GPU could have, over counters; gpudra creates the MIG device at prepare.

A GPU without MIG support is a whole GPU in any mode; so is one whose MIG mode is disabled, which
``dynamic`` reports as not ready (MIG mode is for an administrator to enable).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

MigMode: TypeAlias = Literal["whole", "static", "dynamic"]
MIG_MODES: tuple[MigMode, ...] = ("whole", "static", "dynamic")
DEFAULT_MIG_MODE: MigMode = "static"

MAX_NODE_GROUPS = 16
MAX_SELECTOR_LABELS = 8
_GROUP_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A qualified label key (an optional DNS-subdomain prefix and '/', then a name) and a label value:
# neither can hold ':' or ',', so they separate the parts of the agent's argument unambiguously.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class MigNodeGroup:
    """Nodes whose labels include all of ``node_selector`` use ``mode``."""

    name: str
    mode: MigMode
    node_selector: Mapping[str, str]

    def __post_init__(self) -> None:
        if not _GROUP_NAME.match(self.name):
            raise ValueError(f"MIG node group name {self.name!r} must be a DNS label")
        if self.mode not in MIG_MODES:
            raise ValueError(f"MIG node group {self.name}: mode must be one of {', '.join(MIG_MODES)}, not {self.mode!r}")
        if not 1 <= len(self.node_selector) <= MAX_SELECTOR_LABELS:
            raise ValueError(f"MIG node group {self.name}: nodeSelector needs 1 to {MAX_SELECTOR_LABELS} labels")
        for key, value in self.node_selector.items():
            if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
                raise ValueError(f"MIG node group {self.name}: {key}={value} is not a valid label")

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.node_selector.items())


@dataclass(frozen=True)
class Resolved:
    """A node's mode, and why: the group that matched (None: the default)."""

    mode: MigMode
    group: str | None = None

    def __str__(self) -> str:
        return f"{self.mode} (node group {self.group})" if self.group else f"{self.mode} (the default)"


@dataclass(frozen=True)
class MigPolicy:
    default: MigMode = DEFAULT_MIG_MODE
    groups: tuple[MigNodeGroup, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.default not in MIG_MODES:
            raise ValueError(f"the MIG mode must be one of {', '.join(MIG_MODES)}, not {self.default!r}")
        if len(self.groups) > MAX_NODE_GROUPS:
            raise ValueError(f"at most {MAX_NODE_GROUPS} MIG node groups, not {len(self.groups)}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"MIG node group names must be unique: {', '.join(names)}")

    def for_labels(self, labels: Mapping[str, str]) -> Resolved:
        """The first group matching ``labels`` decides; none matching, the default."""
        for group in self.groups:
            if group.matches(labels):
                return Resolved(group.mode, group.name)
        return Resolved(self.default)

    @property
    def needs_node_labels(self) -> bool:
        """Whether the mode depends on the node (a node group could change it)."""
        return any(g.mode != self.default for g in self.groups)

    @property
    def may_be_dynamic(self) -> bool:
        return self.default == "dynamic" or any(g.mode == "dynamic" for g in self.groups)


def format_node_group(group: MigNodeGroup) -> str:
    """``NAME:MODE:KEY=VALUE,KEY=VALUE``: the agent's ``--mig-node-group`` value."""
    labels = ",".join(f"{k}={v}" for k, v in sorted(group.node_selector.items()))
    return f"{group.name}:{group.mode}:{labels}"


def parse_node_group(text: str) -> MigNodeGroup:
    """The inverse of :func:`format_node_group`; ValueError says what is wrong."""
    parts = text.split(":", 2)
    if len(parts) != 3 or not parts[2]:
        raise ValueError(f"{text!r} is not NAME:MODE:KEY=VALUE[,KEY=VALUE...]")
    name, mode, labels = parts
    selector: dict[str, str] = {}
    for pair in labels.split(","):
        key, sep, value = pair.partition("=")
        if not sep or key in selector:
            raise ValueError(f"{text!r}: {pair!r} is not KEY=VALUE, or repeats a key")
        selector[key] = value
    if mode not in MIG_MODES:
        raise ValueError(f"{text!r}: the mode must be one of {', '.join(MIG_MODES)}, not {mode!r}")
    return MigNodeGroup(name, mode, selector)  # type: ignore[arg-type]  # checked just above


def policy_args(policy: MigPolicy) -> list[str]:
    """The agent's flags for ``policy`` (none for the default policy, so that a config without
    ``spec.mig`` renders the same DaemonSet as before the field existed)."""
    return [*(["--mig", policy.default] if policy.default != DEFAULT_MIG_MODE else []),
            *(arg for g in policy.groups for arg in ("--mig-node-group", format_node_group(g)))]


def policy_from_args(default: str, groups: Sequence[str]) -> MigPolicy:
    return MigPolicy(default, tuple(parse_node_group(g) for g in groups))  # type: ignore[arg-type]
