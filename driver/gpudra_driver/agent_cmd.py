"""`gpudra agent`: the node agent. Discovers GPUs through NVML and keeps this node's
ResourceSlices equal to them.

NVML failures never crash-loop the pod: the agent logs the reason with what to check, keeps the
slices it already published (the kubelet wipes them if the agent goes away for good) and retries
on every rescan."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpudra_driver import eventloop

if TYPE_CHECKING:
    from gpudra_core.consumable import ConsumableCapacity
    from gpudra_driver.publishing.migmode import MigModeSource
    from gpudra_driver.devicehealth.feed import HealthFeed
    from gpudra_driver.devicehealth.apply import HealthMonitor

log = logging.getLogger("gpudra.agent")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from gpudra_core import consumable

    parser = subparsers.add_parser("agent", help="run the node agent (discovery, ResourceSlice publishing)")
    parser.add_argument("--driver", default=os.environ.get("GPUDRA_DRIVER", "gpu.gpudra.io"),
                        help="DRA driver name (default: %(default)s)")
    parser.add_argument("--config", default=os.environ.get("GPUDRA_CONFIG") or None,
                        help="the GpuDraConfig this agent runs for: when it is gone or being deleted at SIGTERM, "
                             "the agent removes its node's slices and files (an uninstall; docs/deploy.md#uninstall) "
                             "(default: $GPUDRA_CONFIG, which the operator sets; none: never)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                        help="this node's name (default: $NODE_NAME, else the hostname)")
    parser.add_argument("--nvml", default=None,
                        help="'real' (default) or 'fake:<profile>' (also $GPUDRA_NVML)")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="kubeconfig file (default: $KUBECONFIG, else the in-cluster ServiceAccount)")
    parser.add_argument("--rescan-interval", type=float, default=60.0,
                        help="seconds between NVML rescans (default: %(default)s)")
    parser.add_argument("--kubelet-dir", default="/var/lib/kubelet", help="the kubelet's root directory")
    parser.add_argument("--cdi-dir", default="/var/run/cdi", help="where CDI specs are written")
    parser.add_argument("--driver-root", default="/",
                        help="the NVIDIA driver's root as the host sees it: / for a host install, "
                             "/run/nvidia/driver for the GPU Operator's driver container (default: %(default)s)")
    parser.add_argument("--container-driver-root", default=None,
                        help="where this process reads the driver root (the DaemonSet mounts it at "
                             "/driver-root; default: --driver-root)")
    parser.add_argument("--host-dev", default="/dev",
                        help="where the host's /dev is seen, to check device nodes when the driver root "
                             "has none (the DaemonSet mounts it at /host-dev: a container's own /dev is a "
                             "copy made at its start) (default: %(default)s)")
    parser.add_argument("--sysfs", default="/sys",
                        help="the host's sysfs: NUMA nodes of GPUs, and NVIDIA devices on the PCI bus, which "
                             "tell a CPU-only node from a GPU node whose driver fails (default: %(default)s)")
    parser.add_argument("--checkpoint-sweep-interval", type=float, default=300.0,
                        help="seconds between sweeps that release prepared claims whose unprepare never came "
                             "(deleted, re-created or deallocated claims); one also runs at start "
                             "(default: %(default)s)")
    parser.add_argument("--claim-status", action=argparse.BooleanOptionalAction, default=True,
                        help="write each prepared claim's status.devices (KEP-4817: Ready, and the GPU it got) "
                             "with the agent's field manager, and remove it at unprepare (default: on)")
    parser.add_argument("--allow-device-plugin", action="store_true",
                        help="publish GPUs even where NVIDIA's device plugin advertises nvidia.com/gpu on the "
                             "node (by default nothing is published there: a GPU must not be handed out twice)")
    consumable.add_arguments(parser)
    from gpudra_driver.discovery import add_mig_argument

    add_mig_argument(parser)
    parser.add_argument("--mig-node-group", action="append", default=[], metavar="NAME:MODE:KEY=VALUE[,...]",
                        type=_mig_node_group,
                        help="a MIG mode for nodes carrying all of these labels, ahead of --mig; repeatable, the first "
                             "match wins; the agent follows its Node's labels (docs/mig.md)")
    parser.add_argument("--nvidia-cdi-hook", default=None, metavar="PATH",
                        help="host path of NVIDIA's nvidia-cdi-hook for the CDI specs' hooks (default: "
                             "looked up in the driver root; none found: libraries are also mounted at "
                             "their sonames)")
    parser.add_argument("--pod-uid", default=os.environ.get("POD_UID") or None, type=_pod_uid,
                        help="this agent pod's UID, for unique plugin socket names during rolling updates "
                             "(default: $POD_UID, else a random ID)")
    parser.add_argument("--ready-file", default=os.environ.get("GPUDRA_READY_FILE") or None,
                        help="create this file once the kubelet registered the plugin and the slices are "
                             "published (the DaemonSet's readiness probe tests for it)")
    parser.add_argument("--device-metadata", action=argparse.BooleanOptionalAction, default=True,
                        help="mount each claim's device attributes into its containers at the standard "
                             "path (KEP-5304, docs/kubelet-plugin.md#device-metadata) (default: on)")
    health = parser.add_argument_group("device health (docs/health.md)")
    health.add_argument("--device-health", action=argparse.BooleanOptionalAction, default=True,
                        help="watch NVML events and probe the GPUs; taint unhealthy devices (default: on)")
    health.add_argument("--informational-xids", default="13,31,43,45,68,109", metavar="LIST", type=_xid_list,
                        help="XIDs that are application errors, not device faults: an informational taint "
                             "(effect None) only (default: %(default)s; '' makes every XID fatal)")
    health.add_argument("--health-quiet-period", type=float, default=300.0, metavar="SECONDS",
                        help="an event's taint goes after this long without a new one, once the GPU is not "
                             "lost and needs no recovery action (default: %(default)s)")
    health.add_argument("--health-probe-interval", type=float, default=5.0, metavar="SECONDS",
                        help="seconds between probes of every GPU (lost, recovery action) (default: %(default)s)")
    health.add_argument("--health-taint-effect", choices=["NoSchedule", "NoExecute"], default="NoSchedule",
                        help="effect of the taints of faults: NoExecute also evicts the pods using the device "
                             "(default: %(default)s)")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("--event-loop", choices=eventloop.LOOPS,
                        default=os.environ.get("GPUDRA_EVENT_LOOP") or eventloop.DEFAULT,
                        help="the asyncio event loop: the standard one or uvloop (~1 MiB more memory) "
                             "(default: $GPUDRA_EVENT_LOOP, else %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("GPUDRA_METRICS_PORT") or 0),
                        help="serve Prometheus /metrics on this port; 0 disables (default: $GPUDRA_METRICS_PORT or 0)")
    parser.add_argument("--health-port", type=int, default=int(os.environ.get("GPUDRA_HEALTH_PORT") or 0),
                        help="serve grpc.health.v1 (service 'liveness') on this port for the kubelet's gRPC "
                             "probes; 0 disables (default: $GPUDRA_HEALTH_PORT or 0)")
    parser.set_defaults(run=run)


def _xid_list(value: str) -> frozenset[int]:
    from gpudra_driver.devicehealth.xids import parse_list

    try:
        return parse_list(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pod_uid(value: str) -> str:
    """The pod UID goes into the plugin's socket file names: a UID, nothing path-like."""
    from gpudra_driver.plugin.model import is_uid

    if not is_uid(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a pod UID (letters, digits and '-', at most 64)")
    return value


def run(args: argparse.Namespace) -> int:
    from gpudra_core import consumable
    from gpudra_driver.logsetup import configure_logging

    configure_logging(args.log_format)
    try:
        args.sharing = consumable.from_args(args)
    except ValueError as error:
        log.error("%s", error)
        return 2
    from gpudra_driver import metrics

    metrics.serve(args.metrics_port)
    return eventloop.run(_main(args), args.event_loop)


async def _rescan_loop(args: argparse.Namespace, publisher: object, plugin: object, kube: object,
                       events: object, root: object) -> None:
    from gpudra_driver.discovery import numa_node_from_sysfs, pcie_root_from_sysfs
    from gpudra_driver.devicepluginguard import DevicePluginGuard
    from gpudra_driver.publishing.rescan import Rescanner

    # the Node every 5 rescans (5 minutes by default): one GET, not a watch per agent
    guard = DevicePluginGuard(kube, args.node_name, allow=args.allow_device_plugin,  # type: ignore[arg-type]
                              report=events.post, interval=5 * args.rescan_interval)  # type: ignore[attr-defined]

    def publish_slices(devices):  # type: ignore[no-untyped-def]
        return publisher.set_devices([] if guard.blocked else devices)  # type: ignore[attr-defined]

    from gpudra_driver.devicehealth.podevents import PodNotifier

    tell_pods = PodNotifier(plugin.state.prepared_claims, plugin.get_claim,  # type: ignore[attr-defined]
                            events.post_on_pod)  # type: ignore[attr-defined]
    health = _health_monitor(args, root, publish_slices, events, plugin.health, tell_pods)  # type: ignore[attr-defined]
    if health is not None:  # an event NVML attributes to a dynamic MIG instance is placed by the checkpoint
        health.mig_instances = plugin.state.mig_placements  # type: ignore[attr-defined]

    def publish(devices):  # type: ignore[no-untyped-def]
        plugin.set_devices(devices)  # type: ignore[attr-defined]  # prepared claims keep working
        return health.set_devices(devices) if health is not None else publish_slices(devices)

    sysfs = Path(args.sysfs)
    rescanner = Rescanner(args.nvml, publish, interval=args.rescan_interval,
                          numa_node_of=functools.partial(numa_node_from_sysfs, sysfs=sysfs), sysfs=sysfs,
                          pcie_root_of=functools.partial(pcie_root_from_sysfs, sysfs=sysfs),
                          driver_root=root,  # type: ignore[arg-type]
                          report=events.post, gate=guard.check,  # type: ignore[attr-defined]
                          sharing=await _sharing(args, kube, events), mig_source=_mig_mode(args, kube, events).current,
                          owned_mig=plugin.state.owned_mig_instances,  # type: ignore[attr-defined]
                          mig_mode_off=plugin.state.mig_mode_off_gpus)  # type: ignore[attr-defined]
    if health is None:
        await rescanner.run()
        return
    publisher.on_taints_dropped = health.taints_dropped  # type: ignore[attr-defined]  # 1.35: leave them out

    async def check_api() -> None:  # once the API server answered the publisher: start-up goes first
        await publisher.published.wait()  # type: ignore[attr-defined]
        await health.check_api(kube, args.node_name)

    await asyncio.gather(rescanner.run(), health.run(), check_api())


def _health_monitor(args: argparse.Namespace, root: object, publish: object, events: object,
                    feed: HealthFeed | None = None, tell_pods: Any = None) -> HealthMonitor | None:
    """The device health monitor the flags ask for (None: --no-device-health); ``feed``: where it
    tells the kubelet plugin each device's health."""
    if not args.device_health:
        log.info("device health is off (--no-device-health): GPUs are published without taints")
        return None
    from gpudra_driver.devicehealth.plan import Policy
    from gpudra_driver.devicehealth.apply import HealthMonitor

    policy = Policy(driver=args.driver, informational_xids=args.informational_xids,
                    quiet_period=args.health_quiet_period, effect=args.health_taint_effect)
    return HealthMonitor(nvml_spec=args.nvml, driver_root=root, policy=policy,  # type: ignore[arg-type]
                         publish=publish, report=events.post,  # type: ignore[arg-type, attr-defined]
                         probe_interval=args.health_probe_interval, feed=feed, on_transition=tell_pods)


def _health_feed(args: argparse.Namespace) -> HealthFeed | None:
    """The device health the kubelet plugin streams to the kubelet (KEP-4680), if health is monitored."""
    if not args.device_health:
        return None
    from gpudra_driver.devicehealth.feed import HealthFeed

    # A device's health goes Unknown in pod status when no probe round refreshed it for this long:
    # a few rounds missed, not one late.
    return HealthFeed(args.node_name, timeout=max(30.0, 6 * args.health_probe_interval))


async def _sharing(args: argparse.Namespace, kube: object, events: object) -> ConsumableCapacity | None:
    """The sharing policy the flags ask for, if the API server keeps what it publishes (one dry
    run, retried until the server answers); else None, said once in the log and a Node event."""
    from gpudra_core.consumable import api_server_keeps_sharing
    from gpudra_driver.publishing.apply import retrying

    sharing: ConsumableCapacity | None = args.sharing
    if sharing is None:
        return None

    def retry(state):  # type: ignore[no-untyped-def]
        log.warning("checking consumable capacity failed (%r); retrying", state.outcome.exception())

    answer: tuple[bool, str] = await retrying(retry)(api_server_keeps_sharing, kube, args.driver, args.node_name)
    kept, why = answer
    if kept:
        log.info("publishing full GPUs for sharing: memory in steps of %d bytes%s", sharing.memory_step,
                 f", {sharing.shares} shares each" if sharing.shares else "")
        return sharing
    message = (f"--consumable-memory-step is ignored: {why}. GPUs are published unshared, one claim each; "
               "upgrade to Kubernetes 1.36 or enable the gate on the API server, scheduler and kubelets")
    log.error("%s", message)
    await events.post("Warning", "ConsumableCapacityUnsupported", message)  # type: ignore[attr-defined]
    return None



def _mig_node_group(text: str) -> object:
    from gpudra_core.migpolicy import parse_node_group

    try:
        return parse_node_group(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _mig_mode(args: argparse.Namespace, kube: object, events: object) -> MigModeSource:
    """The MIG mode by the flags, the Node's labels and the API server (:mod:`.publishing.migmode`)."""
    import functools

    from gpudra_core.migpartitions import api_server_keeps_counters
    from gpudra_core.migpolicy import MigPolicy
    from gpudra_driver.publishing.migmode import MigModeSource, node_labels_reader

    policy = MigPolicy(args.mig, tuple(args.mig_node_group))
    return MigModeSource(policy, node_labels=node_labels_reader(kube, args.node_name),
                         counters_kept=functools.partial(api_server_keeps_counters, kube, args.driver, args.node_name),
                         report=events.post,  # type: ignore[attr-defined]
                         node_recheck=5 * args.rescan_interval)  # as the device plugin guard reads the Node


async def _watch_mig_instances(plugin: object, events: object, interval: float) -> None:
    """At start and every rescan interval: prepared claims whose dynamic MIG instance a GPU reset or
    a driver reload destroyed get it made again, and each is said in Warning Events on the Node and
    the claim's pods (plugin.migrepair, migevents)."""
    from gpudra_driver.migevents import Reporter

    state = plugin.state  # type: ignore[attr-defined]
    report = Reporter(events.post, plugin.get_claim, events.post_on_pod)  # type: ignore[attr-defined]
    while True:
        try:
            found = await state.check_mig_instances()
        except Exception as error:  # noqa: BLE001 - the lock held by a peer, a disk fault: next time
            log.warning("checking the prepared claims' MIG instances failed: %r", error)
            found = []
        await report(found)
        await asyncio.sleep(interval)  # the rescan period itself, not a synchronisation


READINESS_RECHECK = 1.0  # seconds between looks at whether the registration still holds


async def _report_ready(path: Path, plugin: object, published: asyncio.Event) -> None:
    """Ready means usable: the kubelet accepted the plugin and this node's slices are current. A
    rolling update (maxSurge 1) retires the old agent only then, so the node never lacks one. The
    file goes as soon as the registration is lost (the kubelet refused it, or the registration
    socket is gone, which deregisters the plugin), and comes back once it is registered again."""
    registration = plugin.registration  # type: ignore[attr-defined]
    try:
        while True:
            await registration.registered.wait()
            await published.wait()
            path.touch()
            log.info("ready: registered with the kubelet and published (%s)", path)
            while registration.registered.is_set() and plugin.registration_socket.exists():  # type: ignore[attr-defined]
                await asyncio.sleep(READINESS_RECHECK)  # a periodic look, not a synchronisation
            path.unlink(missing_ok=True)
            registration.registered.clear()  # a lost socket: wait for the kubelet's next registration
            log.warning("not ready: the registration with the kubelet was lost (%s removed)", path)
    finally:
        path.unlink(missing_ok=True)


async def _main(args: argparse.Namespace) -> int:
    from gpudra_core.kubeapi import Kube, connect
    from gpudra_driver.nodeevents import NodeEvents
    from gpudra_driver.plugin.sharing.mps.apply import watch_daemons
    from gpudra_driver.plugin.sweep import LeakSweeper
    from gpudra_driver.plugin.plugin import KubeletPlugin, claim_getter
    from gpudra_driver.plugin.claimreporter import ClaimReporter
    from gpudra_driver.publishing.apply import SlicePublisher

    from gpudra_driver.driverroot import DriverRoot, DriverRootError

    try:
        root = DriverRoot.at(args.driver_root, args.container_driver_root)
    except DriverRootError as error:
        log.error("%s", error)
        return 2
    try:  # a driver container may still be starting: discovery retries, and says why on each failure
        root.check()
        log.info("driver root %s", root.describe())
    except DriverRootError as error:
        log.error("%s", error)
    api = await connect(args.kubeconfig)
    kube = Kube(api, field_manager="gpudra-agent")
    events = NodeEvents(kube, args.node_name, driver=args.driver)
    publisher = SlicePublisher(kube, args.driver, args.node_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("gpudra agent starting: driver %s, node %s, event loop %s, Python optimization level %d",
             args.driver, args.node_name, type(loop).__module__.split(".")[0], sys.flags.optimize)
    plugin = KubeletPlugin(driver=args.driver, node=args.node_name, kubelet_dir=Path(args.kubelet_dir),
                           cdi_dir=Path(args.cdi_dir), driver_root=root, cdi_hook=args.nvidia_cdi_hook,
                           host_dev=Path(args.host_dev), instance=args.pod_uid, nvml=args.nvml,
                           get_claim=claim_getter(kube), health=_health_feed(args),
                           device_metadata=args.device_metadata)
    plugin.reporter = reporter = ClaimReporter(kube, driver=args.driver, node=args.node_name,
                                               prepared_claims=plugin.state.prepared_claims,
                                               write_status=args.claim_status)
    try:
        await plugin.start()
    except RuntimeError as error:  # the node's checkpoint cannot be used as it is (plugin.recovery)
        log.error("the kubelet plugin cannot start: %s", error)
        await api.close()
        return 1
    health = None
    if args.health_port:
        from gpudra_driver.plugin import liveness
        try:
            health, _ = await liveness.serve(args.health_port, plugin)
        except OSError as error:  # the probes could never pass: say why instead of being restarted
            log.error("%s", error)
            await plugin.stop()
            await api.close()
            return 1
    tasks = [asyncio.create_task(publisher.run(), name="publisher"),
             asyncio.create_task(_rescan_loop(args, publisher, plugin, kube, events, root), name="rescan"),
             asyncio.create_task(LeakSweeper(prepared=plugin.state.held_claims, get_claim=plugin.get_claim,
                                             unprepare=plugin.unprepare, driver=args.driver, node=args.node_name,
                                             report=events.post, interval=args.checkpoint_sweep_interval,
                                             seen=reporter.seen).run(),
                                 name="checkpoint-sweep"),
             asyncio.create_task(reporter.run(), name="claim-status"),
             asyncio.create_task(plugin.watch(), name="kubelet-plugin"),
             asyncio.create_task(_watch_mig_instances(plugin, events, args.rescan_interval), name="mig-instances"),
             asyncio.create_task(watch_daemons(plugin.state.sharing.mps, plugin.state.prepared_claims, events.post),
                                 name="mps-daemons")]
    heard = None
    if args.config:  # what its config's watch last said, for the uninstall decision at SIGTERM
        from gpudra_driver.uninstall import HeardOfConfig, watch_config

        heard = HeardOfConfig(args.config)
        tasks.append(asyncio.create_task(watch_config(kube, heard), name="config-watch"))
    if args.ready_file:
        tasks.append(asyncio.create_task(
            _report_ready(Path(args.ready_file), plugin, publisher.published),
            name="readiness"))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if health is not None:  # first: probes of a stopping agent would fail, and say so in its log
        await health.stop(0)
    await plugin.stop()
    failed = [t for t in done if t is not stopper and t.exception()]
    for ended in failed:
        log.error("agent task %s failed: %r", ended.get_name(), ended.exception())
    uninstalled = False
    if stopper in done:  # SIGTERM: an uninstall takes what this agent put on the node with it
        from gpudra_driver.uninstall import leave_node

        uninstalled = await leave_node(plugin, kube, events, config=args.config, driver=args.driver, heard=heard,
                                       node=args.node_name)
    await api.close()
    log.info("gpudra agent stopped%s", "" if uninstalled else "; ResourceSlices left in place for the next instance")
    return 1 if failed else 0
