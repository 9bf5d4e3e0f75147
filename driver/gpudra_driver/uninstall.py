"""What a stopping agent leaves on its node: everything for a restart, nothing for an uninstall.

A SIGTERM alone does not tell a rolling update, a deleted pod or a drain (a new agent comes and
needs the node's state) from an uninstall (nothing comes). The API server does: the agent's
GpuDraConfig (``--config``, which the operator renders as ``$GPUDRA_CONFIG``) is *retired* when it
is gone (or the CRD is) or being deleted, or when the API server no longer accepts the agent's
credentials (401: its ServiceAccount or pod is gone, as `kubectl delete -k` deletes them). Anything
else (403, a timeout, a server error) cannot tell: then what a watch on the config, open since
start-up, last said decides (a deletion everything at once can take the agent's RBAC before its
pod, and an open watch still delivers), and without word of a deletion the agent keeps everything,
as it always did; so does an agent run without ``--config``.

Retired, the agent removes its node's ResourceSlices of its driver. Its files go only when the
checkpoint holds nothing (no claim prepared, adopted or half done, no GPU whose sharing settings
it still has to put back) and no other instance of the driver serves on this node: then the
driver's CDI specs, the checkpoint and its scratch files, the device metadata and MPS directories,
stale sockets, the node lock and the plugin directory itself. Prepared claims keep all of it
(their containers may restart, and a reinstalled agent unprepares them when their pods end); the
agent says so in its log and in a Warning Event on its Node. :func:`plan_files`,
:func:`config_retired` and :func:`decide` are pure; :func:`remove_files`, :func:`retired` and :func:`leave_node` are
the shell."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, Obj, error_message, resource_type
from gpudra_core.listwatch import ListThenWatch

log = logging.getLogger(__name__)
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
# The whole look at the API server (the configs, then the slices): well inside the pod's default
# 30 s termination grace period, after the plugin's own stop.
API_BUDGET = 10.0


def config_retired(config: Mapping[str, Any] | None) -> bool:
    """True when the agent's GpuDraConfig is gone (None) or being deleted."""
    return config is None or bool((config.get("metadata") or {}).get("deletionTimestamp"))


class HeardOfConfig:
    """What a watch opened at start-up last said of the agent's GpuDraConfig (a
    :class:`~gpudra_core.listwatch.ListWatchState`): None before its first list, then whether the
    config is retired. Asked at SIGTERM when the API server no longer answers this agent: an
    uninstall that deletes everything at once (`kubectl delete -k`, a GitOps prune) may remove the
    agent's RBAC before its pod, but a watch opened before keeps delivering, the config's deletion
    (or the CRD's, which deletes the config) included."""

    def __init__(self, config_name: str) -> None:
        self.config_name = config_name
        self.retired: bool | None = None
        self._listed = False

    def list_started(self) -> None:
        self._listed = False

    async def list_page(self, items: list[Obj]) -> None:
        for item in items:
            if item["metadata"]["name"] == self.config_name:
                self._listed = True
                self._hear(config_retired(item))

    async def list_done(self) -> None:
        if not self._listed:
            self._hear(True)  # gone (deleted while the watch was down, or never there)

    def changed(self, obj: Obj) -> None:
        self._hear(config_retired(obj))

    def deleted(self, obj: Obj) -> None:
        self._hear(True)

    def _hear(self, retired: bool) -> None:
        if retired != self.retired:
            log.info("GpuDraConfig %s is %s (watched)", self.config_name,
                     "gone or being deleted: stopped, this agent uninstalls" if retired else "in place")
        self.retired = retired


def watch_config(kube: Kube, heard: HeardOfConfig) -> Coroutine[Any, Any, None]:
    """Keep ``heard`` current for the agent's life (a list, then a watch of that one config)."""
    return ListThenWatch(kube, CONFIG, f"GpuDraConfig {heard.config_name}",
                         field_selector=f"metadata.name={heard.config_name}").run(heard)


async def retired(kube: Kube, config_name: str) -> tuple[bool | None, str]:
    """(retired, why) from the API server, None where its answer cannot tell; never raises."""
    try:
        config = await kube.get(CONFIG, config_name)  # None: the config or the whole CRD is gone
    except ApiException as error:
        if error.status == 401:
            return True, "the API server no longer accepts this agent's credentials (its ServiceAccount or pod is gone)"
        return None, f"reading GpuDraConfig {config_name} failed ({error.status}: {error_message(error)})"
    except Exception as error:  # noqa: BLE001 - a deadline, a dropped connection: cannot tell
        return None, f"reading GpuDraConfig {config_name} failed ({error!r})"
    if config_retired(config):
        return True, f"GpuDraConfig {config_name} is {'gone' if config is None else 'being deleted'}"
    return False, f"GpuDraConfig {config_name} is in place"


def decide(answer: tuple[bool | None, str], heard: bool | None, config_name: str) -> tuple[bool, str]:
    """Whether a stopping agent uninstalls (pure): the API server's answer where it tells, else
    what the agent's watch last heard, else not (everything stays for the next instance)."""
    is_retired, why = answer
    if is_retired is not None:
        return is_retired, why
    if heard:
        return True, f"{why}, and the watch saw GpuDraConfig {config_name} deleted"
    return False, why


async def delete_node_slices(kube: Kube, driver: str, node: str) -> int:
    """Delete this node's slices of ``driver`` (what the agent published); the number deleted."""
    deleted = 0
    async for item in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}"):
        deleted += await kube.delete(SLICE, item["metadata"]["name"], uid=item["metadata"]["uid"])
    return deleted


@dataclass(frozen=True)
class FilePlan:
    """What to remove from the node; ``kept_claims`` non-empty means nothing at all."""
    kept_claims: tuple[str, ...] = ()  # "namespace/name" (or the UID where no name is known)
    other_instance: Path | None = None  # a live socket of another instance: nothing either
    files: tuple[Path, ...] = ()  # removed first
    empty_dirs: tuple[Path, ...] = ()  # then removed if empty, deepest first
    trees: tuple[Path, ...] = field(default=())  # removed whole (directories with orphans only)

    @property
    def removes(self) -> bool:
        return not self.kept_claims and self.other_instance is None


def held_claims(checkpoint: Any) -> tuple[str, ...]:
    """What the checkpoint still holds: prepared (or half-prepared) and adopted claims by name, or,
    with none, GPUs whose sharing settings are still to be put back."""
    claims = [f"claim {e.claim.ref.namespace}/{e.claim.ref.name}" for e in checkpoint.claims.values()]
    claims += [f"claim {'/'.join(checkpoint.adopted_names[uid])}" if uid in checkpoint.adopted_names
               else f"claim UID {uid}" for uid in checkpoint.adopted]
    return tuple(sorted(claims) or [f"the sharing settings of GPU {uuid}" for uuid in sorted(checkpoint.touched)])


def plan_files(*, held: Sequence[str], other_instance: Path | None, cdi_specs: Sequence[Path],
               plugin_dir: Path, plugin_files: Sequence[Path], subdirs: Sequence[Path]) -> FilePlan:
    """The removal plan. ``plugin_files``: the plugin directory's files (checkpoint, its scratch
    files, stale sockets, the node lock); ``subdirs``: its directories (MPS, an earlier release's
    device metadata) and the driver's device metadata directory in the CDI directory, removed
    whole: with nothing held, whatever is in them is an orphan."""
    if held:
        return FilePlan(kept_claims=tuple(held))
    if other_instance is not None:
        return FilePlan(other_instance=other_instance)
    return FilePlan(files=(*cdi_specs, *plugin_files), trees=tuple(subdirs), empty_dirs=(plugin_dir,))


def remove_files(plan: FilePlan) -> list[str]:
    """Carry out ``plan``; what could not be removed (each with its error)."""
    steps: list[tuple[Callable[[Path], object], Path]] = [
        *((os.unlink, p) for p in plan.files), *((shutil.rmtree, p) for p in plan.trees),
        *((os.rmdir, p) for p in plan.empty_dirs)]
    problems: list[str] = []
    for remove, path in steps:
        try:
            remove(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            if remove is os.rmdir and error.errno == errno.EBUSY and os.path.ismount(path) and not os.listdir(path):
                continue  # the agent pod's own volume (the plugin directory, hostPath): emptied, it stays
            # a busy mount point (an MPS shm tmpfs still mounted), a file nobody planned for
            left = f" ({', '.join(sorted(os.listdir(path)))})" if error.errno == errno.ENOTEMPTY else ""
            problems.append(f"{path}: {error.strerror or error}{left}")
    return problems


async def leave_node(plugin: Any, kube: Kube, events: Any, *, config: str | None, driver: str, node: str,
                     heard: HeardOfConfig | None = None, budget: float = API_BUDGET) -> bool:
    """After the plugin stopped on SIGTERM: if the agent's GpuDraConfig ``config`` is retired,
    remove what this agent put on the node (see the module docstring) and return True. An agent
    that knows no config (run by hand, not by the operator) leaves everything. Never raises: a stop
    must finish."""
    if config is None:
        log.info("stopping; no --config, so never an uninstall")
        return False
    answer: tuple[bool | None, str]
    try:
        async with asyncio.timeout(budget):
            answer = await retired(kube, config)
    except TimeoutError:
        answer = None, f"the API server did not answer within {budget:g}s"
    is_retired, why = decide(answer, heard.retired if heard else None, config)
    if not is_retired:
        log.info("stopping, not uninstalling (%s)", why)
        return False
    log.info("uninstall: %s; removing what this agent put on node %s", why, node)
    try:
        plan, problems = await asyncio.to_thread(plugin.remove_node_files)
    except Exception as error:  # noqa: BLE001 - the lock held past its timeout, an unreadable checkpoint
        log.error("uninstall: the node's files stay: %r", error)
    else:
        await _report(plan, problems, plugin.plugin_dir, events, driver)
    try:
        async with asyncio.timeout(budget):
            deleted = await delete_node_slices(kube, driver, node)
        log.info("uninstall: deleted %d ResourceSlice(s) of driver %s on node %s", deleted, driver, node)
    except Exception as error:  # noqa: BLE001 - the kubelet wipes them once the plugin stays away
        log.warning("uninstall: deleting this node's ResourceSlices failed (%s); the kubelet removes them "
                    "once the driver stays unregistered",
                    error_message(error) if isinstance(error, ApiException) else repr(error))
    return True


async def _report(plan: FilePlan, problems: list[str], plugin_dir: Path, events: Any, driver: str) -> None:
    if plan.kept_claims:
        shown = ", ".join(plan.kept_claims[:10]) + (f" and {len(plan.kept_claims) - 10} more"
                                                     if len(plan.kept_claims) > 10 else "")
        message = (f"gpudra driver {driver} is being uninstalled, but this node still holds {shown}: the CDI specs, "
                   "MPS daemons and checkpoint stay, so that containers can restart; the kubelet cannot unprepare "
                   "these claims until gpudra is installed again (docs/deploy.md#uninstall)")
        log.warning("uninstall: %s", message)
        await _post(events, "Warning", "UninstallKeptPreparedClaims", message)
    elif plan.other_instance is not None:
        log.info("uninstall: another agent instance serves on this node (%s): the files stay", plan.other_instance)
    else:
        for problem in problems:
            log.warning("uninstall: could not remove %s", problem)
        specs = sum(1 for p in plan.files if p.parent != plugin_dir and p.suffix == ".json")
        log.info("uninstall: removed %d CDI spec(s) of driver %s and the plugin directory %s%s", specs, driver,
                 plugin_dir, f" ({len(problems)} problem(s))" if problems else "")


async def _post(events: Any, kind: str, reason: str, message: str) -> None:
    try:
        async with asyncio.timeout(API_BUDGET / 2):
            await events.post(kind, reason, message)
    except Exception as error:  # noqa: BLE001 - the log line above says it already
        log.warning("uninstall: posting the Node event failed: %r", error)
