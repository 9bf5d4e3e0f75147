"""Claim device status (KEP-4817) and the per-pod device series, on the real API server.

A real agent prepares a claim for a pod: the claim's ``status.devices`` gets the agent's entry
(Ready, the GPU's UUID and PCI bus ID), ``kubectl describe resourceclaim`` shows it, and the agent's
``gpudra_agent_claim_device_info`` joins the pod to the GPU's UUID; unprepare takes both away.
Then the shipped RBAC and admission policy with a pod-bound agent token: an agent writes the status
of claims allocated on its node, not another node's, never the allocation, and from Kubernetes 1.36
(granular status authorization) only its own drivers' entries."""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path

from kubernetes_asyncio.client.exceptions import ApiException
from scrape import scrape
from seedobjects import published_devices
from test_install import (AGENT_NS, TokenClient, agent_pod, denied, fake_node, installed, nodes,  # noqa: F401
                          request_token, suffix, token_kubeconfig)  # (fixtures too)
from test_kubelet_plugin import CLAIM, POD, driver, plugin_agents, ref  # noqa: F401 (fixtures)

from gpudra_core.kubeapi import Kube, Obj, error_message
from gpudra_driver.plugin.claimreport import device_status_entries, status_apply
from gpudra_driver.plugin.claimreporter import INFO_METRIC
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim, PreparedDevice
from gpudra_dev.kubelet_client import DraClient
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.waiting import wait_for


def our_entries(claim: Obj | None, driver: str) -> list[Obj]:
    return [e for e in ((claim or {}).get("status") or {}).get("devices") or [] if e["driver"] == driver]


def info_lines(port: int, claim: str) -> list[str]:
    return [line for line in scrape(port).splitlines() if line.startswith(INFO_METRIC + "{") and f'claim="{claim}"' in line]


async def test_a_prepared_claim_shows_its_gpu_in_status_and_metrics_until_unprepared(
        cluster: ControlPlane, kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    port = free_port()
    plugin = plugin_agents(node, driver, extra_args=("--metrics-port", str(port)))
    published = await published_devices(kube, driver, node, 8)
    # two GPUs of ours and another driver's device, whose driver writes its own entry (never touched)
    claim_obj, allocation = node_claim("trainer", namespace, node,
                                       [(driver, "gpu-1"), (driver, "gpu-2"), ("nic.example.com", "nic-0")])
    await kube.create(claim_obj)
    # the pod the claim is reserved for, as the scheduler records it
    pod = await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer-0", "namespace": namespace},
                             "spec": {"nodeName": node, "resourceClaims": [{"name": "gpus", "resourceClaimName": "trainer"}],
                                      "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                                      "resources": {"claims": [{"name": "gpus"}]}}]}})
    claim = await kube.patch(CLAIM, "trainer", {"status": {**allocation, "reservedFor": [
        {"resource": "pods", "name": "trainer-0", "uid": pod["metadata"]["uid"]}]}}, namespace=namespace,
        subresource="status")
    foreign = {"driver": "nic.example.com", "pool": node, "device": "nic-0",
               "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "",
                               "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    other_writer = Kube(kube.api, "nic-driver")
    await other_writer.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"name": "trainer", "namespace": namespace},
                              "status": {"devices": [foreign]}}, subresource="status")

    async with DraClient((await plugin.registered()).endpoint) as kubelet:
        response = await plugin.prepare(kubelet, [ref(claim)])
        assert not response.claims[claim["metadata"]["uid"]].error

        async def reported() -> list[Obj] | None:
            entries = our_entries(await kube.get(CLAIM, "trainer", namespace), driver)
            return entries if len(entries) == 2 else None

        entries = {e["device"]: e for e in await wait_for(reported, timeout=30, what="the claim's status.devices")}
        for name in ("gpu-1", "gpu-2"):
            attributes = published[name]["attributes"]
            entry = entries[name]
            assert entry["pool"] == node
            (ready,) = entry["conditions"]
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
            assert entry["data"]["uuid"] == attributes["uuid"]["string"]
            assert entry["data"]["pciBusID"] == attributes["resource.kubernetes.io/pciBusID"]["string"]
            assert entry["data"]["node"] == node and entry["data"]["deviceNodes"] == [
                f"/dev/nvidia{attributes['minor']['int']}"]

        # what a person sees
        described = cluster.kubectl("describe", "resourceclaim", "-n", namespace, "trainer").stdout
        assert published["gpu-1"]["attributes"]["uuid"]["string"] in described, described

        lines = info_lines(port, "trainer")
        assert len(lines) == 2, lines
        for name in ("gpu-1", "gpu-2"):
            uuid_label = f'UUID="{published[name]["attributes"]["uuid"]["string"]}"'
            assert any(f'device="{name}"' in line and 'pod="trainer-0"' in line and uuid_label in line
                       and f'namespace="{namespace}"' in line and 'request="gpu"' in line for line in lines), lines

        await kubelet.unprepare([ref(claim)])

        async def withdrawn() -> bool:
            return not our_entries(await kube.get(CLAIM, "trainer", namespace), driver)

        await wait_for(withdrawn, timeout=30, what="the agent's status.devices entries to go")
        assert info_lines(port, "trainer") == []
        # the allocation is the scheduler's and stays, and the other driver's entry is its own
        live = await kube.get(CLAIM, "trainer", namespace)
        assert len(live["status"]["allocation"]["devices"]["results"]) == 3
        assert our_entries(live, "nic.example.com") == [foreign]


# --- the shipped RBAC and admission policy --------------------------------------------------------
def node_claim(name: str, namespace: str, node: str, results: list[tuple[str, str]]) -> tuple[Obj, Obj]:
    """A claim, and its allocation as the scheduler writes it for node-local devices: results of
    (driver, device) from the node's pool, pinned to the node."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": namespace},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any"}}]}}}
    status = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": d, "pool": node, "device": dev} for d, dev in results]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    return claim, status


def entries_for(live: Obj, driver: str, node: str, device: str) -> Obj:  # noqa: F811
    meta = live["metadata"]
    ref_ = ClaimRef(meta["namespace"], meta["name"], meta["uid"])
    prepared = PreparedClaim(ref_, (PreparedDevice(("gpu",), node, device, f"GPU-{uuid.uuid4()}", ("/dev/nvidia0",),
                                                   f"k8s.{driver}/claim={meta['uid']}-{device}"),))
    return status_apply(ref_, device_status_entries(prepared, driver=driver, node=node, generation=1,
                                                    published={}, now=0))


async def test_the_shipped_role_writes_status_only_of_its_nodes_claims_and_drivers(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], nodes: list[str], suffix: str,
        namespace: str, tmp_path: Path) -> None:
    from test_consumable_capacity import minor_version

    own, other = await fake_node(kube, nodes, "own"), await fake_node(kube, nodes, "other")
    ours, foreign_driver = "gpu.gpudra.io", f"other-{secrets.token_hex(3)}.example.com"  # the role's driver
    claims = {}
    for name, node in (("here", own), ("there", other)):
        claim, status = node_claim(name, namespace, node, [(ours, "gpu-0"), (foreign_driver, "dev-0")])
        await kube.create(claim)
        claims[name] = await kube.patch(CLAIM, name, {"status": status}, namespace=namespace, subresource="status")
    pod = await kube.create(agent_pod(AGENT_NS, own, f"agent-{suffix}"))
    config = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent", pod), tmp_path / "a")
    async with TokenClient(config, "gpudra-agent") as agent:
        mine = entries_for(claims["here"], ours, own, "gpu-0")
        theirs = entries_for(claims["there"], ours, other, "gpu-0")

        async def refused() -> ApiException | None:  # the policy is in force within a second of its creation
            try:
                await agent.apply(theirs, subresource="status", dry_run=True)
            except ApiException as error:
                return error
            return None

        # another node's claim: refused (the policy; from 1.36 the associated-node verb first)
        error = await wait_for(refused, timeout=30, what="the agent's write to another node's claim refused")
        assert error.status in (403, 422), error_message(error)
        assert "may only write the status of claims allocated on its own node" in error_message(error) \
            or "resourceclaims/driver" in error_message(error), error_message(error)
        error = await denied(agent.apply(theirs, subresource="status"))
        assert error.status in (403, 422), error_message(error)

        live = await agent.apply(mine, subresource="status")
        assert [e["device"] for e in our_entries(live, ours)] == ["gpu-0"]

        # the allocation is never the agent's to change
        moved = {**mine, "status": {**mine["status"], "allocation": {
            **claims["here"]["status"]["allocation"],
            "devices": {"results": [{"request": "gpu", "driver": ours, "pool": own, "device": "gpu-1"}]}}}}
        error = await denied(agent.apply(moved, subresource="status"))
        assert error.status in (403, 422), error_message(error)

        if await minor_version(kube) >= 36:
            # granular status authorization: a driver the role does not name is refused
            error = await denied(agent.apply(entries_for(claims["here"], foreign_driver, own, "dev-0"),
                                             subresource="status"))
            assert error.status in (403, 422) and "resourceclaims/driver" in error_message(error), error_message(error)

        # and it removes its own entries again
        removed = await agent.apply(status_apply(ClaimRef(namespace, "here", claims["here"]["metadata"]["uid"]), []),
                                    subresource="status")
        assert our_entries(removed, ours) == []
    await kube.delete(POD, pod["metadata"]["name"], AGENT_NS)
