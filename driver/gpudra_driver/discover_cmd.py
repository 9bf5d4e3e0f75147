"""`gpudra discover`: what this node's agent would publish, without a cluster.

Runs discovery (real NVML or a simulated profile) and prints the devices and the ResourceSlices the
agent would write. Imports of NVML, YAML and the driver modules happen inside :func:`run` so the
`gpudra` CLI stays fast for every other subcommand.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

DEFAULT_DRIVER = "gpu.gpudra.io"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "discover",
        help="list this node's GPUs and the ResourceSlices the agent would publish (no cluster needed)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument(
        "--nvml",
        default=None,
        metavar="real|fake:PROFILE",
        help="NVML to use: 'real' or 'fake:<profile name or YAML path>' (default: $GPUDRA_NVML or real)",
    )
    parser.add_argument("--driver-root", default="/",
                        help="the NVIDIA driver's root: libnvidia-ml.so.1 is loaded from it by full path "
                             "(default: %(default)s)")
    parser.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
    parser.add_argument(
        "--node-name",
        default=None,
        help="node (and pool) name (default: $NODE_NAME, else the hostname)",
    )
    parser.add_argument("--node-uid", default=None, help="Node UID for ownerReferences (default: none)")
    parser.add_argument("--driver", default=DEFAULT_DRIVER, help="DRA driver name (default: %(default)s)")
    parser.add_argument("--generation", type=int, default=1, help="pool generation (default: %(default)s)")
    parser.add_argument("--health", action=argparse.BooleanOptionalAction, default=True,
                        help="probe each GPU once (lost, recovery action pending, NVML events supported) and show "
                             "the taints the agent would publish (docs/health.md) (default: on)")
    from gpudra_core import consumable
    from gpudra_driver.discovery import add_mig_argument

    consumable.add_arguments(parser)
    add_mig_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpudra_core import limits
    from gpudra_core.consumable import from_args, share_devices
    from gpudra_core.quantity import format_quantity
    from gpudra_driver.discovery import numa_node_from_sysfs, nvidia_gpus_on_pci, pcie_root_from_sysfs, scan
    from gpudra_driver.driverroot import DriverRoot, DriverRootError
    from gpudra_driver.nvml import NvmlUnavailable, load_nvml, resolve_spec
    from gpudra_driver.publishing.slices import build_slices
    from gpudra_driver.deviceapi import device_to_api

    node = args.node_name or os.environ.get("NODE_NAME") or socket.gethostname().lower()
    spec = resolve_spec(args.nvml)
    try:
        nvml = load_nvml(spec, DriverRoot.at(args.driver_root))
        # sysfs knows NUMA nodes NVML may not, and PCIe roots; only consult it for the real hardware.
        real = spec == "real"
        result = scan(nvml, numa_node_of=numa_node_from_sysfs if real else None, mig=args.mig,
                      pcie_root_of=pcie_root_from_sysfs if real else None)
        sharing = from_args(args)
        devices, unshared = share_devices(result.devices, sharing)
        if args.health:
            devices = _with_health(nvml, devices, args.driver)
        slices = build_slices(args.driver, node, args.node_uid, args.generation, devices)
    except (NvmlUnavailable, DriverRootError) as exc:
        from gpudra_driver.publishing.rescan import NO_GPU_ON_PCI

        cpu_only = spec == "real" and nvidia_gpus_on_pci() == []
        print(f"gpudra discover: {exc}" + (f" ({NO_GPU_ON_PCI})" if cpu_only else ""), file=sys.stderr)
        return 1
    except (ValueError, limits.LimitError) as exc:
        print(f"gpudra discover: {exc}", file=sys.stderr)
        return 2
    warnings = [*result.warnings, *unshared]
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)

    if not devices:
        print("gpudra discover: NVML works but finds no GPU on this node; the agent would publish no devices",
              file=sys.stderr)
    if args.output == "table":
        print(_table(devices, args.driver if args.health else None))
        print(f"\n{len(devices)} device(s) in {len(slices)} ResourceSlice(s) for node {node}, "
              f"driver {args.driver}")
        print(summary(devices, args.driver if args.health else None))
        if sharing is not None:
            shared = [d.name for d in devices if d.allow_multiple_allocations]
            print(f"consumable capacity: {len(shared)} GPU(s) published for sharing ({', '.join(shared) or 'none'}), "
                  f"memory in steps of {format_quantity(sharing.memory_step, binary=True)}"
                  + (f", {sharing.shares} shares each" if sharing.shares else ""))
        return 0
    doc = {
        "node": node,
        "driver": args.driver,
        "devices": [device_to_api(d) for d in devices],
        "resourceSlices": slices,
        "warnings": warnings,
    }
    if args.output == "json":
        import json

        print(json.dumps(doc, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False), end="")
    return 0


def summary(devices: list[Any], driver: str | None) -> str:
    """The counts the agent's metrics and ``kubectl get gdc -o wide`` give for these devices, in
    their words: gpudra_agent_devices{health} (Unhealthy, Unmonitored) and
    gpudra_agent_shareable_devices (Shareable)."""
    from gpudra_core.devicehealthstate import HEALTH_NAMES, health_state

    parts = []
    if driver is not None:
        states = [health_state(((t.key, t.effect) for t in d.taints), driver) for d in devices]
        parts.append("health: " + ", ".join(f"{states.count(name)} {name}" for name in HEALTH_NAMES))
    parts.append(f"shareable: {sum(d.allow_multiple_allocations for d in devices)} (several claims at once)")
    return "; ".join(parts)


def _with_health(nvml: Any, devices: list[Any], driver: str) -> list[Any]:
    from gpudra_driver.devicehealth.plan import Moment, Policy
    from gpudra_driver.devicehealth.apply import snapshot

    return snapshot(nvml, devices, Policy(driver=driver), Moment.now())


def _health(device: Any, driver: str) -> str:
    """``healthy``, ``unmonitored``, or ``unhealthy (<taint>, ...)``."""
    from gpudra_driver.devicehealth.plan import health_of

    state = health_of(device.taints, driver)
    if state != "unhealthy":
        return state
    shown = [f"{t.key.rpartition('/')[2]}{'=' + t.value if t.value else ''}" for t in device.taints if t.effect != "None"]
    return f"unhealthy ({', '.join(shown)})"


def _table(devices: list[Any], driver: str | None = None) -> str:
    header = ("NAME", "TYPE", "PRODUCT", "MEMORY(GiB)", "CC", "UUID", *(("HEALTH",) if driver else ()))
    rows = [header] + [
        (
            d.name,
            d.type,
            str(d.attr("productName") or "") + (f" MIG {d.attr('profile')}" if d.type == "mig" else ""),
            f"{d.capacity.get('memory', 0) / 2**30:.1f}",
            ".".join(str(d.attr("cudaComputeCapability") or "").split(".")[:2]),
            str(d.attr("uuid") or ""),
            *((_health(d, driver),) if driver else ()),
        )
        for d in devices
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
