"""A published device's health as one word, read off its taints (pure).

One reading for every place that shows it: the agent's ``gpudra_agent_devices{health}`` and
``gpudra discover``'s HEALTH column (from the taints it computes), and the operator's
``status.unhealthyDevices`` / ``status.unmonitoredDevices`` (from the taints in the slices), so a
device is never healthy in one and unhealthy in another (docs/health.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeAlias

HealthName: TypeAlias = Literal["healthy", "unhealthy", "unmonitored"]
HEALTH_NAMES: tuple[HealthName, ...] = ("healthy", "unhealthy", "unmonitored")


def health_state(taints: Iterable[tuple[str, str]], driver: str) -> HealthName:
    """``taints``: (key, effect) of the device's taints. Unhealthy: a taint of the driver's own
    that keeps pods off (any effect but None); unmonitored: the driver's informational
    ``<driver>/unmonitored`` (no NVML events for it); healthy otherwise."""
    own = [(key, effect) for key, effect in taints if key.startswith(f"{driver}/")]
    if any(effect != "None" for _, effect in own):
        return "unhealthy"
    if any(key == f"{driver}/unmonitored" for key, _ in own):
        return "unmonitored"
    return "healthy"


def published_health(device: Mapping[str, Any], driver: str) -> HealthName:
    """The health of a device as a ResourceSlice publishes it (its ``taints``)."""
    taints = device.get("taints") or []
    return health_state(((str(t.get("key", "")), str(t.get("effect", ""))) for t in taints if isinstance(t, Mapping)),
                        driver)
