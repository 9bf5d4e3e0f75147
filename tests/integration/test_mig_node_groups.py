"""MIG modes per node group, end to end on a real control plane (issue 34, configuration): the
operator renders spec.mig into the agents' flags, each agent resolves its mode from its own Node's
labels and follows them as they change, and a GPU that does not match its node's mode reaches the
config's Degraded condition (and leaves it once it matches), as do nodes whose API server drops
counters (1.35: DynamicMigUnsupported)."""

from __future__ import annotations

from typing import Any

from gpudra_core.kubeapi import Kube, Obj
from gpudra_dev.localcluster.waiting import wait_for
from test_operator import (  # noqa: F401 - fixtures: this module gets an operator of its own
    DAEMONSET, NODE, agent_namespace, condition, configs, has_condition, make_config, operator, suffix)

SLICE_LIST = "spec.driver={driver},spec.nodeName={node}"


def mig_flags(daemonset: Obj) -> tuple[str, ...]:
    """The --mig and --mig-node-group flags the operator rendered for the agents, with their values."""
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    return tuple(a for i, a in enumerate(args)
                 if a.startswith("--mig") or (i and args[i - 1].startswith("--mig")))


async def devices_of(kube: Kube, driver: str, node: str) -> dict[str, Obj] | None:
    """The node's published devices by name, once its pool is complete in one generation."""
    from gpudra_core.kubeapi import resource_type

    found = [s async for s in kube.list(resource_type("resource.k8s.io/v1", "ResourceSlice"),
                                        field_selector=SLICE_LIST.format(driver=driver, node=node))]
    if not found or len({s["spec"]["pool"]["generation"] for s in found}) != 1 \
            or len(found) != found[0]["spec"]["pool"]["resourceSliceCount"]:
        return None
    return {d["name"]: d for s in found for d in s["spec"].get("devices") or []}


async def test_each_node_follows_its_groups_mode_and_a_gpu_that_does_not_match_degrades_the_config(
        kube: Kube, configs: Any, namespace: str, fake_nodes: Any, agents: Any, suffix: str) -> None:
    from test_consumable_capacity import minor_version

    await agent_namespace(kube, namespace)
    plain = (await fake_nodes("plain", labels={"gpudra-test": suffix}))["metadata"]["name"]
    mig = (await fake_nodes("mig", labels={"gpudra-test": suffix, f"pool-{suffix}": "mig"}))["metadata"]["name"]
    name, driver = f"mig-{suffix}", f"mig{suffix}.gpudra.io"
    body = make_config(name, namespace, driver, [], nodeSelector={"gpudra-test": suffix})
    body["spec"]["mig"] = {"mode": "whole", "nodeGroups": [
        {"name": "mig", "mode": "dynamic", "nodeSelector": {f"pool-{suffix}": "mig"}}]}
    await configs(body)

    daemonset = await wait_for(lambda: kube.get(DAEMONSET, "gpudra-agent", namespace), timeout=30,
                               what="the agent DaemonSet")
    flags = mig_flags(daemonset)
    assert flags == ("--mig", "whole", "--mig-node-group", f"mig:dynamic:pool-{suffix}=mig"), flags
    # The agents run as the DaemonSet would start them on these (fake) nodes: with its flags.
    agents(plain, "fake:dgx-h100", driver, rescan_interval=0.2, extra_args=flags)  # MIG mode off
    mig_agent = agents(mig, "fake:h100-dynamic-mig", driver, rescan_interval=0.2, extra_args=flags)  # MIG mode on

    if await minor_version(kube) < 36:
        # Counters would be dropped: the group's node publishes static MIG (no MIG devices there,
        # so nothing, and not ready), and the config says both.
        degraded = await wait_for(has_condition(kube, name, "Degraded", "True", "DynamicMigUnsupported"),
                                  timeout=60, what="Degraded=True DynamicMigUnsupported")
        message = condition(degraded, "Degraded")["message"]
        assert f"1 node(s) ({mig}) publish static MIG instead of dynamic" in message, message
        assert f"1 node(s) ({mig}) have GPUs that do not match their MIG mode" in message, message
        return

    whole = await wait_for(lambda: devices_of(kube, driver, plain), timeout=60, what=f"{plain}'s devices")
    assert sorted(whole) == [f"gpu-{i}" for i in range(8)]  # mode whole, MIG mode off: as it should be
    placements = await wait_for(lambda: devices_of(kube, driver, mig), timeout=60, what=f"{mig}'s devices")
    assert "gpu-0-mig-1g10gb-at6" in placements and placements["gpu-0-mig-1g10gb-at6"]["consumesCounters"]
    ready = await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what=f"{name} Ready=True")
    assert condition(ready, "Degraded")["reason"] == "AsExpected"

    # The plain node joins the group: its agent follows the label, and its GPUs (MIG mode off) do
    # not match dynamic mode; the config names the node and what to do.
    await kube.patch(NODE, plain, {"metadata": {"labels": {f"pool-{suffix}": "mig"}}})
    degraded = await wait_for(has_condition(kube, name, "Degraded", "True", "MigNotReady"), timeout=60,
                              what="Degraded=True MigNotReady")
    message = condition(degraded, "Degraded")["message"]
    assert f"1 node(s) ({plain}) have GPUs that do not match their MIG mode" in message, message
    assert "8 GPU(s) do not match the node's MIG mode dynamic" in message and "nvidia-smi -i 0 -mig 1" in message
    assert condition(degraded, "Ready")["status"] == "False"

    # Out of the group again: whole GPUs are what its mode asks for; Ready again.
    await kube.patch(NODE, plain, {"metadata": {"labels": {f"pool-{suffix}": None}}})
    await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what=f"{name} Ready=True again")
    assert sorted(await wait_for(lambda: devices_of(kube, driver, plain), timeout=30, what="devices")) == \
        [f"gpu-{i}" for i in range(8)]
    assert "MIG mode by node labels: dynamic (node group mig)" in mig_agent.log_tail()
