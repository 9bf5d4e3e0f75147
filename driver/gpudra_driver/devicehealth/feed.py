"""Device health for the kubelet (KEP-4680, "health in pod status"): the latest health of every
device, as the monitor last determined it, for the kubelet plugin's ``NodeWatchResources`` stream.

The monitor calls :meth:`HealthFeed.set` after each probe round and each change; a watcher gets
the complete list each time (the kubelet wants the driver's complete list in every message).
Each round refreshes ``updated`` even when nothing changed: the kubelet marks a device Unknown
once its ``last_updated_time`` is older than its timeout, so a monitor that stopped probing (NVML
hung) shows up in pod status as Unknown, not as a health it no longer knows.

Only the newest list is kept: a slow watcher skips lists, never falls behind (memory bounded)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence

from gpudra_core.devicemodel import Device, DeviceTaint
from gpudra_driver.devicehealth.plan import describe, health_of
from gpudra_driver.plugin.model import DeviceHealth, Health

MESSAGE_MAX = 1024  # the kubelet truncates longer messages
# health.core's states -> the kubelet's: an unmonitored GPU's health is not known between probes
HEALTH: dict[str, Health] = {"healthy": "HEALTHY", "unhealthy": "UNHEALTHY", "unmonitored": "UNKNOWN"}


def device_health(pool: str, device: Device, device_taints: Sequence[DeviceTaint], driver: str,
                  updated: float) -> DeviceHealth:
    """One device's health from its taints: a NoSchedule/NoExecute taint is UNHEALTHY; a GPU whose
    NVML delivers no events is UNKNOWN (only a lost GPU would be noticed, by the probe); else HEALTHY."""
    health = HEALTH[health_of(device_taints, driver)]
    message = "; ".join(describe(t) for t in device_taints)
    if len(message) > MESSAGE_MAX:
        message = message[:MESSAGE_MAX - 3] + "..."
    return DeviceHealth(pool, device.name, health, updated, message)


def snapshot(pool: str, devices: Sequence[Device], computed: Mapping[str, Sequence[DeviceTaint]], driver: str,
             updated: float) -> tuple[DeviceHealth, ...]:
    """The complete list, in discovery order."""
    return tuple(device_health(pool, d, computed.get(d.name, ()), driver, updated) for d in devices)


class HealthFeed:
    def __init__(self, pool: str, timeout: float) -> None:
        """``pool``: the devices' pool (the node's name); ``timeout``: the
        health_check_timeout_seconds sent with each device."""
        self.pool, self.timeout = pool, timeout
        self.devices: tuple[DeviceHealth, ...] | None = None  # None: not probed yet
        self._version = 0
        self._closed = False
        self._changed = asyncio.Condition()

    async def close(self) -> None:
        """End every watch (the agent stops: its streams end, and the gRPC server need not wait for them)."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    async def set(self, devices: Sequence[Device], computed: Mapping[str, Sequence[DeviceTaint]], driver: str,
                  updated: float) -> None:
        """The devices' health from the taints the monitor computed for them, determined at ``updated``."""
        async with self._changed:
            self.devices = snapshot(self.pool, devices, computed, driver, updated)
            self._version += 1
            self._changed.notify_all()

    async def watch(self) -> AsyncIterator[tuple[DeviceHealth, ...]]:
        """The complete list once known, then each newer one."""
        seen = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._version != seen or self._closed)
                if self._closed:
                    return
                seen, devices = self._version, self.devices
            assert devices is not None
            yield devices
