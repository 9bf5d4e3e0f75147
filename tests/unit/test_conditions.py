"""Conditions: lastTransitionTime moves only when the status flips (meta.SetStatusCondition), and
summarize() maps DaemonSet state, render/apply errors and conflicts to the four conditions."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from gpudra_operator.conditions import (ApplyError, ConditionValue, agents_status, apply_conditions,
                                        find_condition, format_time, set_condition, summarize)
from gpudra_operator.deviceclasses import RenderError

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 1, 12, 5, 0, tzinfo=timezone.utc)


def test_new_condition_gets_now() -> None:
    out = set_condition([], "Ready", "False", "RollingOut", "1/2", 3, T0)
    assert out == [{"type": "Ready", "status": "False", "observedGeneration": 3,
                    "lastTransitionTime": "2026-01-01T12:00:00Z", "reason": "RollingOut", "message": "1/2"}]


def test_same_status_keeps_transition_time_but_updates_the_rest() -> None:
    first = set_condition([], "Ready", "False", "RollingOut", "1/2", 3, T0)
    second = set_condition(first, "Ready", "False", "RenderFailed", "bad class", 4, T1)
    assert second[0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert (second[0]["reason"], second[0]["message"], second[0]["observedGeneration"]) == (
        "RenderFailed", "bad class", 4)


def test_status_flip_moves_transition_time() -> None:
    first = set_condition([], "Ready", "False", "RollingOut", "", 3, T0)
    second = set_condition(first, "Ready", "True", "Ready", "", 3, T1)
    assert second[0]["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_other_conditions_untouched_and_input_not_mutated() -> None:
    existing = [{"type": "Custom", "status": "True", "lastTransitionTime": "x", "reason": "R", "message": ""},
                {"type": "Ready", "status": "False", "lastTransitionTime": "y", "reason": "R", "message": ""}]
    snapshot = [dict(c) for c in existing]
    out = set_condition(existing, "Ready", "True", "Ready", "ok", 1, T1)
    assert existing == snapshot
    assert out[0] == snapshot[0]
    assert [c["type"] for c in out] == ["Custom", "Ready"]


def test_bad_status_or_reason_refused() -> None:
    with pytest.raises(ValueError):
        set_condition([], "Ready", "true", "Ready", "", 1, T0)
    with pytest.raises(ValueError):
        set_condition([], "Ready", "True", "", "", 1, T0)


def test_long_messages_are_truncated_to_the_api_limit() -> None:
    (cond,) = set_condition([], "Degraded", "True", "RenderFailed", "x" * 40000, 1, T0)
    assert len(cond["message"]) == 32768 and cond["message"].endswith("...")


def test_format_time_naive_is_utc() -> None:
    assert format_time(datetime(2026, 1, 1, 0, 0, 0)) == "2026-01-01T00:00:00Z"
    assert format_time("2026-01-01T00:00:00Z") == "2026-01-01T00:00:00Z"


def test_apply_conditions_is_idempotent() -> None:
    values = summarize(daemonset=None)
    once = apply_conditions([], values, 1, T0)
    twice = apply_conditions(once, values, 1, T1)
    assert once == twice
    assert [c["type"] for c in once] == ["Ready", "AgentsReady", "DeviceClassesReady", "Degraded"]


# -- summarize -----------------------------------------------------------------------------

def daemonset(desired: int, ready: int, updated: int, generation: int = 2, observed: int | None = 2,
              unavailable: int = 0) -> dict[str, Any]:
    status: dict[str, Any] = {"desiredNumberScheduled": desired, "numberReady": ready,
                              "updatedNumberScheduled": updated, "numberUnavailable": unavailable}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


def by_type(values: list[ConditionValue]) -> dict[str, ConditionValue]:
    return {v.type: v for v in values}


def test_all_good_is_ready() -> None:
    c = by_type(summarize(daemonset=daemonset(3, 3, 3), device_classes=["a", "b"]))
    assert c["Ready"].status == "True" and c["Ready"].reason == "Ready"
    assert c["AgentsReady"] == ConditionValue("AgentsReady", "True", "AgentsReady",
                                              "3/3 agents ready, 3/3 updated")
    assert c["DeviceClassesReady"] == ConditionValue("DeviceClassesReady", "True", "Applied",
                                                     "2 DeviceClasses applied: a, b")
    assert c["Degraded"] == ConditionValue("Degraded", "False", "AsExpected", "")


def test_always_four_conditions_in_order() -> None:
    assert [v.type for v in summarize(daemonset=None)] == ["Ready", "AgentsReady", "DeviceClassesReady", "Degraded"]


@pytest.mark.parametrize("ds, reason", [
    (None, "DaemonSetNotFound"),
    (daemonset(3, 2, 3), "RollingOut"),
    (daemonset(3, 3, 2), "RollingOut"),
    (daemonset(3, 3, 3, unavailable=1), "RollingOut"),
    (daemonset(3, 3, 3, generation=3, observed=2), "RollingOut"),
    (daemonset(3, 3, 3, observed=None), "RollingOut"),
])
def test_agents_not_ready_is_not_degraded(ds: dict[str, Any] | None, reason: str) -> None:
    c = by_type(summarize(daemonset=ds))
    assert (c["AgentsReady"].status, c["AgentsReady"].reason) == ("False", reason)
    assert (c["Ready"].status, c["Ready"].reason) == ("False", reason)
    assert c["Degraded"].status == "False"


def test_no_matching_nodes_counts_as_ready() -> None:
    c = by_type(summarize(daemonset=daemonset(0, 0, 0)))
    assert (c["AgentsReady"].status, c["AgentsReady"].reason) == ("True", "NoMatchingNodes")
    assert c["Ready"].status == "True"


def test_render_errors_degrade_and_name_the_class() -> None:
    errors = [RenderError("bad.gpudra.io", "undefined variable: 'oops' is undefined")]
    c = by_type(summarize(daemonset=daemonset(1, 1, 1), device_classes=["ok.gpudra.io"], render_errors=errors))
    for t in ("Ready", "DeviceClassesReady", "Degraded"):
        assert "bad.gpudra.io" in c[t].message and "oops" in c[t].message
    assert (c["DeviceClassesReady"].status, c["DeviceClassesReady"].reason) == ("False", "RenderFailed")
    assert (c["Degraded"].status, c["Degraded"].reason) == ("True", "RenderFailed")
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "RenderFailed")
    assert c["AgentsReady"].status == "True"


def test_apply_errors_split_by_kind() -> None:
    dc_err = ApplyError("DeviceClass", "x.gpudra.io", "spec.selectors[0].cel.expression: Invalid value")
    ds_err = ApplyError("DaemonSet", "gpudra-system/gpudra-agent", "namespaces \"gpudra-system\" not found")
    c = by_type(summarize(daemonset=None, apply_errors=[dc_err]))
    assert (c["DeviceClassesReady"].reason, c["Degraded"].reason) == ("ApplyFailed", "ApplyFailed")
    assert c["AgentsReady"].reason == "DaemonSetNotFound"
    c = by_type(summarize(daemonset=None, apply_errors=[ds_err]))
    assert (c["AgentsReady"].status, c["AgentsReady"].reason) == ("False", "ApplyFailed")
    assert c["DeviceClassesReady"].status == "True"
    assert "gpudra-system" in c["Degraded"].message and c["Degraded"].status == "True"


def test_conflict_wins_over_everything() -> None:
    conflict = "driver name gpu.gpudra.io is already claimed by GpuDraConfig 'default'"
    c = by_type(summarize(daemonset=daemonset(1, 1, 1), render_errors=[RenderError("a", "b")],
                          apply_errors=[ApplyError("DeviceClass", "c", "d")], conflicts=[conflict]))
    assert {t: (v.status, v.reason) for t, v in c.items()} == {
        "Ready": ("False", "Conflict"), "AgentsReady": ("False", "Conflict"),
        "DeviceClassesReady": ("False", "Conflict"), "Degraded": ("True", "Conflict")}
    assert conflict in c["Ready"].message and "'a'" in c["Degraded"].message


def test_agents_status_summary() -> None:
    assert agents_status(daemonset(4, 3, 2)) == {"desired": 4, "ready": 3, "updated": 2, "summary": "3/4"}
    assert agents_status(None) == {"desired": 0, "ready": 0, "updated": 0, "summary": "0/0"}


def test_find_condition() -> None:
    conds = apply_conditions([], summarize(daemonset=None), 1, T0)
    ready = find_condition(conds, "Ready")
    assert ready is not None and ready["status"] == "False"
    assert find_condition(conds, "Nope") is None and find_condition(None, "Ready") is None


def test_nodes_with_nvidias_device_plugin_make_the_config_degraded_and_name_them() -> None:
    c = by_type(summarize(daemonset=daemonset(3, 3, 3), device_classes=["a"], device_plugin_nodes=["gpu-b", "gpu-a"]))
    assert c["Degraded"].status == "True" and c["Degraded"].reason == "DevicePluginConflict"
    assert "advertises nvidia.com/gpu on 2 node(s) (gpu-a, gpu-b)" in c["Degraded"].message
    assert "spec.agent.allowDevicePlugin: true" in c["Degraded"].message
    assert c["Ready"].status == "False" and c["Ready"].reason == "DevicePluginConflict"
    assert c["AgentsReady"].status == "True"  # the agents run; they publish nothing there
    many = by_type(summarize(daemonset=daemonset(3, 3, 3), device_plugin_nodes=[f"n{i:02d}" for i in range(25)]))
    assert "(n00, n01, n02, n03, n04, n05, n06, n07, n08, n09 and 15 more)" in many["Degraded"].message
    # an error of the config's own comes first
    first = by_type(summarize(daemonset=daemonset(1, 1, 1), conflicts=["driver taken"], device_plugin_nodes=["x"]))
    assert first["Degraded"].reason == "Conflict"


def test_an_option_the_api_server_cannot_honour_makes_the_config_degraded_with_its_reason() -> None:
    from gpudra_operator.conditions import Unsupported

    gone = Unsupported("ConsumableCapacityUnsupported", "spec.sharing.consumableCapacity is not in effect: ...")
    c = by_type(summarize(daemonset=daemonset(2, 2, 2), device_classes=["a"], unsupported=[gone]))
    assert (c["Degraded"].status, c["Degraded"].reason) == ("True", "ConsumableCapacityUnsupported")
    assert c["Degraded"].message == gone.message
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "ConsumableCapacityUnsupported")
    assert c["AgentsReady"].status == "True" and c["DeviceClassesReady"].status == "True"
    # the config's own errors and the device plugin come first; every problem is in the message
    both = by_type(summarize(daemonset=daemonset(1, 1, 1), device_plugin_nodes=["x"], unsupported=[gone]))
    assert both["Degraded"].reason == "DevicePluginConflict" and gone.message in both["Degraded"].message
