"""`gpudra status`'s checks, on objects as the API server returns them."""

from __future__ import annotations

from typing import Any

from gpudra_operator.status_cmd import Check, config_checks, lease_check, report


def config(*, ready: str = "True", generation: int = 3, observed: int = 3, agents: tuple[int, int, int] = (2, 2, 2),
           reason: str = "Reconciled", message: str = "") -> dict[str, Any]:
    desired, ready_agents, updated = agents
    return {"metadata": {"name": "default", "generation": generation},
            "spec": {"driverName": "gpu.gpudra.io"},
            "status": {"agents": {"desired": desired, "ready": ready_agents, "updated": updated},
                       "conditions": [{"type": "Ready", "status": ready, "reason": reason, "message": message,
                                       "observedGeneration": observed}]}}


def test_a_ready_config_with_every_agent_publishing_passes() -> None:
    checks = config_checks(config(), {"node-a", "node-b"})
    assert [c.ok for c in checks] == [True, True, True], report(checks)


def test_a_config_that_is_not_ready_says_why_in_its_own_words() -> None:
    (ready, *_) = config_checks(config(ready="False", reason="TemplateError", message="deviceClasses[0]: bad"),
                                {"node-a", "node-b"})
    assert not ready.ok and "TemplateError: deviceClasses[0]: bad" in ready.detail


def test_ready_for_an_older_generation_is_not_ready() -> None:
    (ready, *_) = config_checks(config(generation=4, observed=3), {"node-a", "node-b"})
    assert not ready.ok and "generation 3" in ready.detail and "at 4" in ready.detail


def test_a_rollout_in_progress_and_a_node_without_slices_fail() -> None:
    _, agents, slices = config_checks(config(agents=(2, 2, 1)), {"node-a"})
    assert not agents.ok and agents.detail == "2 ready, 1 updated of 2"
    assert not slices.ok and "published by 1 node(s), 2 agent(s) ready" in slices.detail


def test_no_agent_at_all_fails_and_points_at_the_node_selector() -> None:
    _, agents, slices = config_checks(config(agents=(0, 0, 0)), set())
    assert not agents.ok and "nodeSelector" in agents.detail
    assert not slices.ok


def test_a_missing_status_is_an_operator_that_has_not_run() -> None:
    body = {"metadata": {"name": "x", "generation": 1}, "spec": {"driverName": "d"}}
    (ready, _, _) = config_checks(body, set())
    assert not ready.ok and "operator" in ready.detail


def lease(holder: str | None, renew: str) -> dict[str, Any]:
    return {"spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": 15}}


def test_the_lease_passes_only_when_renewed_while_watched() -> None:
    assert lease_check(lease("op-1", "t1"), lease("op-1", "t2"), 2).ok
    stale = lease_check(lease("op-1", "t1"), lease("op-1", "t1"), 17)
    assert not stale.ok and "not renewed in 17 s" in stale.detail
    assert not lease_check(lease(None, "t1"), lease(None, "t2"), 2).ok
    assert not lease_check(None, None, 0).ok


def test_the_report_marks_each_line() -> None:
    text = report([Check("operator", True, "op-1 leads"), Check("GpuDraConfig x", False, "not Ready")])
    assert text.splitlines() == ["ok   operator: op-1 leads", "FAIL GpuDraConfig x: not Ready"]
