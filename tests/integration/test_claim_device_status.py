"""Claim device status (KEP-4817) and the per-pod device series, on the real API server.

A real agent prepares a claim for a pod: the claim's ``status.devices`` gets the agent's entry
(Ready, the GPU's UUID and PCI bus ID), ``kubectl describe resourceclaim`` shows it, and the agent's
``gpudra_agent_claim_device_info`` joins the pod to the GPU's UUID; unprepare takes both away.
Then the shipped RBAC and admission policy with a pod-bound agent token: an agent writes the status
of claims allocated on its node, not another node's, never the allocation, and from Kubernetes 1.36
(granular status authorization) only its own drivers' entries. And claims whose opaque parameters
the API server re-encodes (kube-scheduler copied their bytes into the allocation): the agent's
merge patch where its apply is refused, or one warning where nothing passes."""

from __future__ import annotations

import json
import secrets
import uuid
from pathlib import Path

from kubernetes_asyncio.client.exceptions import ApiException
from schedpods import pinned_pod
from scrape import sample_value, scrape
from seedobjects import published_devices
from test_install import (AGENT_NS, TokenClient, agent_pod, denied, fake_node, installed, nodes,  # noqa: F401
                          request_token, suffix, token_kubeconfig)  # (fixtures too)
from test_kubelet_plugin import (CLAIM, DEVICE_CLASS, POD, allocated_claim, driver, plugin_agents,  # noqa: F401
                                 ref)  # (fixtures too)

from gpudra_core.kubeapi import Kube, Obj, error_message
from gpudra_driver.plugin.claimreport import device_status_entries, status_apply
from gpudra_driver.plugin.claimreporter import INFO_METRIC
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim, PreparedDevice
from gpudra_dev.kubelet_client import DraClient
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import events_about
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


# --- opaque parameters the API server re-encodes (kube-scheduler copies the claim's bytes) -----------
def claim_json(name: str, namespace: str, driver: str, *, separators: tuple[str, str]) -> str:
    """A claim of one GPU with a TimeSlicing GpuConfig, as the exact JSON text a client sends; the
    parameters' keys deliberately unsorted (kind before apiVersion), as Go clients write them."""
    parameters = {"kind": "GpuConfig", "apiVersion": "gpudra.io/v1alpha1",
                  "sharing": {"timeSlicing": {"interval": "Long"}, "strategy": "TimeSlicing"}}
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": namespace},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}],
                                  "config": [{"requests": ["gpu"], "opaque": {"driver": driver,
                                                                             "parameters": parameters}}]}}}
    return json.dumps(claim, separators=separators)


async def test_a_claim_whose_parameters_the_api_server_re_encodes_gets_its_status_or_one_warning(
        cluster: ControlPlane, kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str,
        tmp_path: Path) -> None:
    """kube-scheduler copies a claim's opaque parameters into status.allocation byte for byte; a
    status write is decoded and re-encoded, and the API server's immutability check of the
    allocation (a byte-wise DeepEqual of the RawExtension) refuses the apply for parameters that
    are not compact and key-sorted. Compact with unsorted keys: the agent's merge patch passes.
    Python's json.dumps default (", " and ": "): nothing passes, and the agent says so once."""
    node = (await fake_nodes("h100"))["metadata"]["name"]
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    port = free_port()
    plugin = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root,
                           extra_args=("--metrics-port", str(port), "--checkpoint-sweep-interval", "1"))
    devices = await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    try:
        bodies = {"compact": claim_json("compact", namespace, driver, separators=(",", ":")),
                  "spaced": claim_json("spaced", namespace, driver, separators=(", ", ": "))}
        compact_params = json.dumps(json.loads(bodies["compact"])["spec"]["devices"]["config"][0]["opaque"]
                                    ["parameters"], separators=(",", ":"), sort_keys=True)
        assert compact_params not in bodies["compact"]  # unsorted: SSA's re-encoding differs
        for name, body in bodies.items():  # the exact bytes, as a client that is not kubectl sends them
            (tmp_path / f"{name}.json").write_text(body)
            cluster.kubectl("create", "--raw", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
                            "-f", str(tmp_path / f"{name}.json"))
            await kube.create(pinned_pod(f"{name}-0", namespace, node, name))

        async def allocated(name: str) -> Obj | None:  # by the real kube-scheduler, reserved for the pod
            claim = await kube.get(CLAIM, name, namespace)
            status = (claim or {}).get("status") or {}
            return claim if status.get("allocation") and status.get("reservedFor") else None

        claims = {name: await wait_for(lambda: allocated(name), timeout=30, what=f"claim {name} allocated")
                  for name in bodies}
        for claim in claims.values():
            (config,) = claim["status"]["allocation"]["devices"]["config"]
            assert config["opaque"]["parameters"]["sharing"]["strategy"] == "TimeSlicing"
        compact, spaced = claims["compact"], claims["spaced"]
        device_of = {name: c["status"]["allocation"]["devices"]["results"][0]["device"] for name, c in claims.items()}

        def refused_total() -> float | None:
            return sample_value(scrape(port), "gpudra_agent_claim_status_refused_total",
                                'reason="allocation-immutable"')

        def agent_log() -> str:
            return plugin.agent.log_path.read_text(errors="replace")

        async def warnings() -> list[Obj]:
            return [e for e in await events_about(kube, "spaced", namespace) if e.get("reason") == "StatusNotWritten"]

        async with DraClient(registered.endpoint) as kubelet:
            response = await plugin.prepare(kubelet, [ref(compact), ref(spaced)])
            assert [response.claims[c["metadata"]["uid"]].error for c in (compact, spaced)] == ["", ""]
            uuid_of = {name: devices[device]["attributes"]["uuid"]["string"] for name, device in device_of.items()}
            # the parameters the scheduler copied were read: both GPUs time-sliced (Long)
            assert [mockstate.timeslice(root, uuid_of[name]) for name in bodies] == [3, 3]

            # 1. compact, unsorted keys: the apply is refused, the merge patch writes the entry
            async def reported() -> list[Obj] | None:
                return our_entries(await kube.get(CLAIM, "compact", namespace), driver) or None

            (entry,) = await wait_for(reported, timeout=30, what="claim compact's status.devices")
            assert (entry["pool"], entry["device"]) == (node, device_of["compact"])
            assert entry["data"]["uuid"] == uuid_of["compact"]
            (ready,) = entry["conditions"]
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
            written = await kube.get(CLAIM, "compact", namespace)
            assert [m["operation"] for m in (written or {})["metadata"]["managedFields"]
                    if m["manager"] == "gpudra-agent"] == ["Update"]  # the merge patch wrote it, not the apply

            # 2. spaces: refused for good, said once (a warning Event on the claim, the counter)
            (event,) = await wait_for(warnings, timeout=30, what="the StatusNotWritten Event on claim spaced")
            assert event["type"] == "Warning" and event["involvedObject"]["uid"] == spaced["metadata"]["uid"]
            assert "field is immutable" in event["message"] and "compact JSON" in event["message"], event
            assert refused_total() == 1
            assert our_entries(await kube.get(CLAIM, "spaced", namespace), driver) == []

            # and not again: neither for a kubelet retry nor for the leak sweep's reads. A third claim
            # deleted without its unprepare is released after two sweeps, which read "spaced" too.
            again = await plugin.prepare(kubelet, [ref(spaced)])
            assert again.claims[spaced["metadata"]["uid"]].error == ""
            free = sorted(set(devices) - set(device_of.values()))[0]
            leaked = await allocated_claim(kube, namespace, "leaked", driver, node, [free])
            assert (await plugin.prepare(kubelet, [ref(leaked)])).claims[leaked["metadata"]["uid"]].error == ""

            async def leaked_reported() -> list[Obj] | None:
                return our_entries(await kube.get(CLAIM, "leaked", namespace), driver) or None

            await wait_for(leaked_reported, timeout=30, what="claim leaked's status.devices")
            async def compact_version() -> str:
                return str(((await kube.get(CLAIM, "compact", namespace)) or {}).get("metadata", {}).get("resourceVersion"))

            written_version = await compact_version()
            await kube.delete(CLAIM, "leaked", namespace)

            async def released() -> bool:
                return any(e.get("reason") == "LeakedClaimReleased" for e in await events_about(kube, node))

            await wait_for(released, timeout=30, what="two leak sweeps (the deleted claim released)")
            assert len(await warnings()) == 1 and refused_total() == 1
            assert agent_log().count(f"status.devices of claim {namespace}/spaced not written") == 1
            # the written entry is not rewritten by each sweep either
            assert await compact_version() == written_version

            # 3. unprepare: the entry withdrawn (the merge patch again); nothing to withdraw, nothing thrown
            unprepared = await kubelet.unprepare([ref(compact), ref(spaced)])
            assert [unprepared.claims[c["metadata"]["uid"]].error for c in (compact, spaced)] == ["", ""]

            async def withdrawn() -> bool:
                return not our_entries(await kube.get(CLAIM, "compact", namespace), driver)

            await wait_for(withdrawn, timeout=30, what="claim compact's entry withdrawn")
            assert len(await warnings()) == 1 and refused_total() == 1
            assert "Traceback" not in agent_log(), agent_log()
            assert plugin.agent.process.poll() is None
    finally:
        await kube.delete(DEVICE_CLASS, driver)
