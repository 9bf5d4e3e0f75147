"""manifests/argocd/health.lua on the statuses the operator writes: Healthy, Progressing while the
operator has not observed the latest generation (or agents roll out), Degraded when a person must act."""

from __future__ import annotations

from typing import Any

from argocd_health import health


def config(generation: int = 3, status: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                            "metadata": {"name": "default", "generation": generation, **meta},
                            "spec": {"driverName": "gpu.gpudra.io"}}
    if status is not None:
        body["status"] = status
    return body


def cond(type_: str, status: str, reason: str, message: str = "", generation: int = 3) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": "2026-11-01T00:00:00Z"}


def status(observed: int = 3, ready: str = "True", ready_reason: str = "Ready", degraded: str = "False",
           degraded_reason: str = "AsExpected", message: str = "2/2 agents ready; 4 classes applied",
           condition_generation: int | None = None) -> dict[str, Any]:
    gen = observed if condition_generation is None else condition_generation
    return {"observedGeneration": observed, "conditions": [
        cond("Ready", ready, ready_reason, message, gen),
        cond("AgentsReady", "True", "AgentsReady", "2/2", gen),
        cond("DeviceClassesReady", "True", "Applied", "4 classes", gen),
        cond("Degraded", degraded, degraded_reason, message if degraded == "True" else "", gen)],
        "agents": {"desired": 2, "ready": 2, "updated": 2, "summary": "2/2"}}


def test_ready_for_the_current_generation_is_healthy() -> None:
    assert health(config(status=status())) == {"status": "Healthy", "message": "2/2 agents ready; 4 classes applied"}


def test_no_status_yet_is_progressing() -> None:
    assert health(config())["status"] == "Progressing"
    assert health(config(status={}))["status"] == "Progressing"


def test_observed_generation_lagging_is_progressing_even_when_ready() -> None:
    result = health(config(generation=4, status=status(observed=3)))
    assert result == {"status": "Progressing",
                      "message": "Waiting for the gpudra operator to observe generation 4 (status is for generation 3)"}


def test_ready_condition_of_an_older_generation_is_progressing() -> None:
    result = health(config(generation=4, status=status(observed=4, condition_generation=3)))
    assert result["status"] == "Progressing"
    assert "generation 4" in result["message"]


def test_degraded_wins_and_carries_the_reason() -> None:
    result = health(config(status=status(ready="False", ready_reason="RenderFailed", degraded="True",
                                         degraded_reason="RenderFailed",
                                         message="DeviceClass 'x.gpudra.io': 'nope' is undefined")))
    assert result == {"status": "Degraded", "message": "RenderFailed: DeviceClass 'x.gpudra.io': 'nope' is undefined"}


def test_rolling_out_is_progressing_not_degraded() -> None:
    result = health(config(status=status(ready="False", ready_reason="RollingOut", message="1/2 agents ready")))
    assert result == {"status": "Progressing", "message": "RollingOut: 1/2 agents ready"}


def test_being_deleted_is_progressing() -> None:
    result = health(config(status=status(), deletionTimestamp="2026-11-01T00:00:00Z"))
    assert result == {"status": "Progressing", "message": "Pending deletion"}
