"""The agent's rescan loop: NVML discovery on an interval, logged the way a node operator needs it.

Failure behaviour (documented in docs/agent.md):

* NVML missing or failing (library not found, kernel driver not loaded, no permission, a bad
  simulated profile): one ERROR line naming the cause and what to do, then the same failure again
  only at DEBUG, and one INFO line when discovery works again. The loop never raises, so the pod
  does not crash-loop; it publishes nothing new while NVML fails (nothing at all if it never
  worked, the last published devices otherwise) and retries every interval.
* Per-GPU problems (one GPU erroring mid-scan, a MIG mode change pending): a WARNING when the
  problem appears, not again on every rescan while it persists.
* GPUs that do not match their MIG mode (:attr:`Discovery.mig_not_ready`): one ``MigNotReady``
  Warning on the Node naming them all, again when the set changes and every ``REPOST_INTERVAL``
  while it lasts (Events expire, and the config's Degraded condition reads them), then one
  ``MigReady`` when none is left.

With a sharing policy (:mod:`gpudra_core.consumable`) the discovered GPUs are handed on as
published for sharing, to the publisher and the kubelet plugin alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path

from gpudra_core.agentcontract import MIG_NOT_READY, MIG_READY
from gpudra_core.consumable import ConsumableCapacity, share_devices
from gpudra_core.devicemodel import Device
from gpudra_core.migpartitions import MigGeometry
from gpudra_core.migpolicy import MigMode
from gpudra_driver.discovery import Discovery, NvmlUnavailable, nvidia_gpus_on_pci, scan
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.nvml import load_nvml, resolve_spec

log = logging.getLogger("gpudra.agent")

Publish = Callable[[Sequence[Device]], bool]  # True when the devices changed
# (type, reason, message) of a Node event: a failure's reason when it changes, and the recovery
Report = Callable[[str, str, str], Awaitable[None]]
REPOST_INTERVAL = 900.0  # seconds between MigNotReady events while it lasts (Events live an hour)
MAX_EVENT_MESSAGE = 4096  # characters of a MigNotReady message: a node's few GPUs fit, a storm does not
NO_GPU_ON_PCI = ("no NVIDIA GPU on this node: no PCI device of vendor 10de under /sys/bus/pci/devices "
                 "(a CPU-only node: check spec.agent.nodeSelector/affinity)")


class Rescanner:
    """One scan per :meth:`scan_once`; remembers what it logged so repeats stay quiet.

    ``numa_node_of`` (e.g. :func:`gpudra_driver.discovery.numa_node_from_sysfs`) and
    ``pcie_root_of`` (:func:`gpudra_driver.discovery.pcie_root_from_sysfs`) are used with real NVML
    only, as ``gpudra discover`` does."""

    def __init__(self, spec: str | None, publish: Publish, *, interval: float = 60.0,
                 numa_node_of: Callable[[str], int | None] | None = None,
                 pcie_root_of: Callable[[str], str | None] | None = None,
                 driver_root: DriverRoot | None = None, report: Report | None = None,
                 sysfs: Path = Path("/sys"), gate: Callable[[], Awaitable[str | None]] | None = None,
                 sharing: ConsumableCapacity | None = None, mig: MigMode = "static",
                 mig_source: Callable[[], Awaitable[MigMode]] | None = None,
                 owned_mig: Callable[[], Collection[tuple[str, int]]] = tuple,
                 mig_mode_off: Callable[[], Mapping[str, MigGeometry | None]] = dict,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``mig``: the MIG mode, or ``mig_source`` asked before each scan
        (:class:`.migmode.MigModeSource`); ``owned_mig``: the dynamic MIG instances the agent made
        for claims (:func:`scan`'s ``owned``)."""
        self.sharing = sharing
        self.mig = mig
        self.mig_source = mig_source
        self.owned_mig = owned_mig
        self.mig_mode_off = mig_mode_off  # the GPUs whose MIG mode claims of the whole GPU turned off (scan's)
        self.clock = clock
        self.mig_not_ready: tuple[str, ...] = ()  # as last reported
        self._mig_posted: float | None = None
        self.gate = gate  # checked before each publish (the device plugin guard); the publish reads it
        self.spec = resolve_spec(spec)
        self.sysfs = sysfs
        self.device_count: int | None = None  # the last scan's, None before the first
        self.driver_root = driver_root
        self.report = report
        self.publish = publish
        self.interval = interval
        # The sysfs fallback describes this machine's PCI devices, which a simulated GPU is not.
        self.numa_node_of = numa_node_of if self.spec == "real" else None
        self.pcie_root_of = pcie_root_of if self.spec == "real" else None
        self.failure: str | None = None  # the current failure's message; None while scans work
        self.failures = 0  # consecutive failed scans
        self.warnings: set[str] = set()

    async def run(self) -> None:
        while True:
            await self.scan_once()
            await asyncio.sleep(self.interval)  # the rescan period itself, not a synchronisation

    async def scan_once(self) -> bool:
        """Scan and hand the devices to ``publish``; False when discovery failed."""
        if self.mig_source is not None:
            self.mig = await self.mig_source()
        try:
            result = await asyncio.to_thread(self._scan)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever NVML does, the agent stays up
            message = self._failed(error)
            if message is not None and self.report is not None:
                await self.report("Warning", "GpuDiscoveryFailed", f"GPU discovery failed: {message}")
            return False
        if self.failure is not None:
            log.info("GPU discovery works again after %d failed scan(s)", self.failures)
            if self.report is not None:
                await self.report("Normal", "GpuDiscoveryRecovered",
                                  f"GPU discovery works again after {self.failures} failed scan(s)")
            self.failure, self.failures = None, 0
        for warning in result.warnings:
            if warning not in self.warnings:
                log.warning("%s", warning)
                if (self.report is not None and not warning.startswith(NO_GPU_ON_PCI)
                        and warning not in result.mig_not_ready):
                    await self.report("Warning", "DiscoveryWarning", warning)
        self.warnings = set(result.warnings)
        await self._report_mig_readiness(tuple(result.mig_not_ready))
        if self.gate is not None:
            await self.gate()
        try:
            changed = self.publish(result.devices)
        except Exception as error:  # noqa: BLE001 - a bad device must not end the loop (no crash loop)
            log.error("handing %d discovered device(s) to the publisher and plugin failed: %r",
                      len(result.devices), error)
            return False
        if changed:
            log.info("discovered %d device(s) via NVML (%s): %s", len(result.devices), self.spec,
                     ", ".join(d.name for d in result.devices) or "none")
        else:
            log.debug("rescan: %d device(s), unchanged", len(result.devices))
        if not result.devices and self.device_count != 0 and self.report is not None:
            reason = next((w for w in result.warnings if w.startswith(NO_GPU_ON_PCI)),
                          "NVML works but finds no GPU on this node")
            await self.report("Warning", "NoGpusFound", f"{reason}; the agent publishes no devices")
        self.device_count = len(result.devices)
        return True

    async def _report_mig_readiness(self, not_ready: tuple[str, ...]) -> None:
        now = self.clock()
        if not_ready:
            if not_ready != self.mig_not_ready or self._mig_posted is None or now - self._mig_posted >= REPOST_INTERVAL:
                self._mig_posted = now
                if self.report is not None:
                    message = f"{len(not_ready)} GPU(s) do not match the node's MIG mode {self.mig}: " + "; ".join(not_ready)
                    await self.report("Warning", MIG_NOT_READY, message[:MAX_EVENT_MESSAGE])
        elif self.mig_not_ready:
            self._mig_posted = None
            if self.report is not None:
                await self.report("Normal", MIG_READY, f"every GPU matches the node's MIG mode {self.mig}")
        self.mig_not_ready = not_ready

    def _scan(self) -> Discovery:
        try:
            # owned whatever the mode: a GPU keeps the placements its prepared claims were given
            found = scan(load_nvml(self.spec, self.driver_root), numa_node_of=self.numa_node_of, mig=self.mig,
                         owned=self.owned_mig(), mig_mode_off=self.mig_mode_off(), pcie_root_of=self.pcie_root_of)
        except NvmlUnavailable as error:
            if self.spec != "real" or nvidia_gpus_on_pci(self.sysfs) != []:  # GPUs, or unreadable
                raise
            # No NVIDIA GPU on the PCI bus: a CPU-only node, not a broken one. It publishes nothing
            # and turns ready, so a DaemonSet that reaches such a node never holds the config's Ready.
            return Discovery([], [f"{NO_GPU_ON_PCI}; NVML: {error}"])
        devices, warnings = share_devices(found.devices, self.sharing)
        return Discovery(devices, found.warnings + warnings, found.mig_not_ready)

    def _failed(self, error: Exception) -> str | None:
        """Log the failure; returns its message when it is new (not the same as the last scan's)."""
        self.failures += 1
        if isinstance(error, (NvmlUnavailable, ValueError)):
            message = str(error)  # written for a human: the cause and what to check
        else:
            message = f"unexpected {type(error).__name__}: {error}"
        if message == self.failure:
            log.debug("GPU discovery still failing (%d consecutive scans): %s", self.failures, message)
            return None
        self.failure = message
        log.error("GPU discovery failed: %s. The agent stays up, publishes no new devices and retries "
                  "every %gs", message, self.interval)
        return message
