"""Status conditions of a GpuDraConfig, pure: what they say (:func:`summarize`) and how they are
written into the list without churn (:func:`set_condition`, like apimachinery's
``meta.SetStatusCondition``: ``lastTransitionTime`` moves only when ``status`` flips).

The four conditions, always all present (from the first reconcile on):

``AgentsReady``
    True when the DaemonSet controller has observed the current DaemonSet generation and every
    scheduled agent is updated and ready (zero nodes matching the agent's nodeSelector counts as
    ready: there is nothing to wait for). False while rolling out (``RollingOut``), when the
    DaemonSet does not exist (``DaemonSetNotFound``), when applying it failed (``ApplyFailed``) or
    when the config conflicts with another one (``Conflict``).
``DeviceClassesReady``
    True when every class in the spec rendered and was applied (``Applied``). False with
    ``Conflict``, ``RenderFailed`` or ``ApplyFailed``, in that order of precedence; the message
    names each failing class and its error.
``Degraded``
    True when a person has to act: a conflict, a render error, an apply error (same reasons as
    above), or NVIDIA's device plugin on nodes whose agents therefore publish nothing
    (``DevicePluginConflict``), or a spec option the API server cannot honour (its reason, e.g.
    ``ConsumableCapacityUnsupported``), or what agents report of their nodes: dynamic MIG falling
    back to static (``DynamicMigUnsupported``), GPUs that do not match their MIG mode
    (``MigNotReady``); the first one wins, the message lists them all. A rollout in progress is not
    degraded.
    False with ``AsExpected`` otherwise.
``Ready``
    True (``Ready``) exactly when AgentsReady and DeviceClassesReady are True and Degraded is
    False; otherwise False with the reason and message of the first of Degraded, DeviceClassesReady,
    AgentsReady that is not as it should be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpudra_core.kubeapi import rfc3339

READY = "Ready"
AGENTS_READY = "AgentsReady"
DEVICE_CLASSES_READY = "DeviceClassesReady"
DEGRADED = "Degraded"
CLASS_MATCHES_NO_DEVICE = "ClassMatchesNoDevice"
CONDITION_TYPES = (READY, AGENTS_READY, DEVICE_CLASSES_READY, DEGRADED)

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
MAX_MESSAGE = 32768  # metav1.Condition.message limit


@dataclass(frozen=True)
class ConditionValue:
    """What a condition says, without bookkeeping (time, generation)."""

    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class Unsupported:
    """A spec option this cluster's API server cannot honour, so the operator leaves it out:
    ``reason`` (CamelCase, e.g. ConsumableCapacityUnsupported) and what to do, in ``message``."""

    reason: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class NodeProblem:
    """What agents report of their nodes that a person has to fix (e.g. ``MigNotReady``): the
    reason, and a message naming the nodes and what to do."""

    reason: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ApplyError:
    """A child the API server refused: ``kind`` (DaemonSet/DeviceClass), ``name``, its message."""

    kind: str
    name: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name!r}: {self.message}"


def format_time(now: datetime | str) -> str:
    """A condition's time as metav1.Time serialises (a string is one already)."""
    return now if isinstance(now, str) else rfc3339(now)


def find_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def set_condition(conditions: Sequence[Mapping[str, Any]] | None, type: str, status: str,  # noqa: A002
                  reason: str, message: str, observed_generation: int | None,
                  now: datetime | str) -> list[dict[str, Any]]:
    """A new list with condition ``type`` set; the input is not modified.

    ``lastTransitionTime`` becomes ``now`` only for a new condition or when ``status`` changed;
    reason, message and observedGeneration are always updated. Other conditions keep their place.
    """
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True, False or Unknown, not {status!r}")
    if not reason:
        raise ValueError("a condition needs a reason")
    message = message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."
    result: list[dict[str, Any]] = []
    found = False
    for existing in conditions or ():
        if existing.get("type") != type:
            result.append(dict(existing))
            continue
        found = True
        moved = existing.get("status") != status or not existing.get("lastTransitionTime")
        result.append(_condition(type, status, reason, message, observed_generation,
                                 format_time(now) if moved else existing["lastTransitionTime"]))
    if not found:
        result.append(_condition(type, status, reason, message, observed_generation, format_time(now)))
    return result


def _condition(type_: str, status: str, reason: str, message: str, generation: int | None,
               when: str) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": type_, "status": status}
    if generation is not None:
        cond["observedGeneration"] = generation
    cond.update(lastTransitionTime=when, reason=reason, message=message)
    return cond


def apply_conditions(conditions: Sequence[Mapping[str, Any]] | None, values: Iterable[ConditionValue],
                     observed_generation: int | None, now: datetime | str) -> list[dict[str, Any]]:
    """:func:`set_condition` for each value, in order."""
    result: list[dict[str, Any]] = [dict(c) for c in conditions or ()]
    for v in values:
        result = set_condition(result, v.type, v.status, v.reason, v.message, observed_generation, now)
    return result


def agents_status(daemonset: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.agents`` from the live DaemonSet (zeros when it does not exist)."""
    st = (daemonset or {}).get("status") or {}
    desired = int(st.get("desiredNumberScheduled") or 0)
    ready = int(st.get("numberReady") or 0)
    updated = int(st.get("updatedNumberScheduled") or 0)
    return {"desired": desired, "ready": ready, "updated": updated, "summary": f"{ready}/{desired}"}


def _agents(daemonset: Mapping[str, Any] | None, apply_errors: Sequence[ApplyError],
            conflicts: Sequence[str]) -> ConditionValue:
    if conflicts:
        return ConditionValue(AGENTS_READY, FALSE, "Conflict", "; ".join(conflicts))
    ds_errors = [e for e in apply_errors if e.kind == "DaemonSet"]
    if ds_errors:
        return ConditionValue(AGENTS_READY, FALSE, "ApplyFailed", "; ".join(map(str, ds_errors)))
    if daemonset is None:
        return ConditionValue(AGENTS_READY, FALSE, "DaemonSetNotFound", "the agent DaemonSet does not exist yet")
    generation = (daemonset.get("metadata") or {}).get("generation")
    st = daemonset.get("status") or {}
    observed = st.get("observedGeneration")
    a = agents_status(daemonset)
    counts = f"{a['ready']}/{a['desired']} agents ready, {a['updated']}/{a['desired']} updated"
    if generation is not None and (observed is None or observed < generation):
        return ConditionValue(AGENTS_READY, FALSE, "RollingOut",
                              f"the DaemonSet controller has not yet observed generation {generation}; {counts}")
    if a["desired"] == 0:
        return ConditionValue(AGENTS_READY, TRUE, "NoMatchingNodes",
                              "no node matches the agent's nodeSelector/affinity/tolerations; nothing to run")
    if a["ready"] < a["desired"] or a["updated"] < a["desired"] or int(st.get("numberUnavailable") or 0):
        return ConditionValue(AGENTS_READY, FALSE, "RollingOut", counts)
    return ConditionValue(AGENTS_READY, TRUE, "AgentsReady", counts)


def _classes(device_classes: Sequence[str], render_errors: Sequence[Any],
             apply_errors: Sequence[ApplyError], conflicts: Sequence[str]) -> ConditionValue:
    if conflicts:
        return ConditionValue(DEVICE_CLASSES_READY, FALSE, "Conflict", "; ".join(conflicts))
    if render_errors:
        return ConditionValue(DEVICE_CLASSES_READY, FALSE, "RenderFailed", "; ".join(map(str, render_errors)))
    dc_errors = [e for e in apply_errors if e.kind == "DeviceClass"]
    if dc_errors:
        return ConditionValue(DEVICE_CLASSES_READY, FALSE, "ApplyFailed", "; ".join(map(str, dc_errors)))
    n = len(device_classes)
    return ConditionValue(DEVICE_CLASSES_READY, TRUE, "Applied",
                          f"{n} DeviceClass{'es' if n != 1 else ''} applied" + (f": {', '.join(device_classes)}" if n else ""))


MAX_NODES_NAMED = 10


def named_nodes(nodes: Sequence[str]) -> str:
    """The first :data:`MAX_NODES_NAMED` of ``nodes`` by name, and how many more."""
    shown = ", ".join(sorted(nodes)[:MAX_NODES_NAMED])
    return shown + (f" and {len(nodes) - MAX_NODES_NAMED} more" if len(nodes) > MAX_NODES_NAMED else "")


def device_plugin_problem(nodes: Sequence[str]) -> str:
    return (f"NVIDIA's device plugin advertises nvidia.com/gpu on {len(nodes)} node(s) ({named_nodes(nodes)}): their "
            "agents publish no GPUs, so none is handed out twice; disable the device plugin there "
            "(docs/deploy.md) or set spec.agent.allowDevicePlugin: true")


def _degraded(render_errors: Sequence[Any], apply_errors: Sequence[ApplyError],
              conflicts: Sequence[str], device_plugin_nodes: Sequence[str] = (),
              unsupported: Sequence[Unsupported] = (), node_problems: Sequence[NodeProblem] = ()) -> ConditionValue:
    problems = [*conflicts, *map(str, render_errors), *map(str, apply_errors)]
    if device_plugin_nodes:
        problems.append(device_plugin_problem(device_plugin_nodes))
    problems += map(str, unsupported)
    problems += map(str, node_problems)
    if not problems:
        return ConditionValue(DEGRADED, FALSE, "AsExpected", "")
    reason = ("Conflict" if conflicts else "RenderFailed" if render_errors else "ApplyFailed" if apply_errors
              else "DevicePluginConflict" if device_plugin_nodes else unsupported[0].reason if unsupported
              else node_problems[0].reason)
    return ConditionValue(DEGRADED, TRUE, reason, "; ".join(problems))


def class_matches_no_device(counts: Sequence[Any], driver: str, devices: int, *,
                            agents_ready: bool) -> ConditionValue:
    """True (a warning) when a class matches none of the devices the ready agents publish: a typo in
    a selector, a template or its parameters is caught the moment the config is applied, not when a
    claim stays Pending. ``counts``: :class:`~gpudra_operator.classcounts.ClassCount` per class."""
    empty = [c.name for c in counts if c.devices == 0]
    if not agents_ready or devices == 0:
        return ConditionValue(CLASS_MATCHES_NO_DEVICE, FALSE, "NoDevicesYet",
                              "the agents are not all ready, or publish no device yet: nothing to match")
    if empty:
        return ConditionValue(CLASS_MATCHES_NO_DEVICE, TRUE, "ClassMatchesNoDevice",
                              f"DeviceClass {', '.join(empty)} matches none of the {devices} devices driver "
                              f"{driver} publishes: check its selectors (`gpudra explain` shows a device's "
                              "values); claims for it stay Pending")
    return ConditionValue(CLASS_MATCHES_NO_DEVICE, FALSE, "EveryClassMatches",
                          f"every DeviceClass matches at least one of the {devices} devices")


def summarize(*, daemonset: Mapping[str, Any] | None, device_classes: Sequence[str] = (),
              render_errors: Sequence[Any] = (), apply_errors: Sequence[ApplyError] = (),
              conflicts: Sequence[str] = (), device_plugin_nodes: Sequence[str] = (),
              unsupported: Sequence[Unsupported] = (), node_problems: Sequence[NodeProblem] = ()) -> list[ConditionValue]:
    """The four conditions, in the order Ready, AgentsReady, DeviceClassesReady, Degraded.

    ``daemonset``: the live agent DaemonSet (whole object: its generation is compared with
    ``status.observedGeneration``) or None. ``device_classes``: names applied. ``render_errors``:
    :class:`~gpudra_operator.deviceclasses.RenderError` (anything printable that names the class).
    ``apply_errors``: :class:`ApplyError`. ``conflicts``: one sentence per conflict with another
    GpuDraConfig (e.g. ``driver name gpu.gpudra.io is already claimed by GpuDraConfig 'a'``).
    ``device_plugin_nodes``: nodes whose agent publishes nothing because NVIDIA's device plugin
    advertises ``nvidia.com/gpu`` there. ``unsupported``: spec options the API server cannot honour
    (:class:`Unsupported`), left out of what was applied. ``node_problems``: what agents report of
    their nodes that a person has to fix (:class:`NodeProblem`)."""
    agents = _agents(daemonset, apply_errors, conflicts)
    classes = _classes(device_classes, render_errors, apply_errors, conflicts)
    degraded = _degraded(render_errors, apply_errors, conflicts, device_plugin_nodes, unsupported, node_problems)
    if degraded.status == TRUE:
        ready = ConditionValue(READY, FALSE, degraded.reason, degraded.message)
    elif classes.status != TRUE:
        ready = ConditionValue(READY, FALSE, classes.reason, classes.message)
    elif agents.status != TRUE:
        ready = ConditionValue(READY, FALSE, agents.reason, agents.message)
    else:
        ready = ConditionValue(READY, TRUE, "Ready", f"{agents.message}; {classes.message}")
    return [ready, agents, classes, degraded]
