"""Fake Nodes, scratch namespaces and Events on the local control plane.

A fake Node is what upstream's DRA integration tests use: a Node object that is Ready with
capacity, and no kubelet behind it. Pods bound to it stay Pending unless someone plays the
kubelet, and deleting them needs a zero grace period."""

from __future__ import annotations

import secrets
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, resource_type

from .waiting import wait_for

NODE = resource_type("v1", "Node")
NAMESPACE = resource_type("v1", "Namespace")
POD = resource_type("v1", "Pod")
SERVICE_ACCOUNT = resource_type("v1", "ServiceAccount")
EVENT = resource_type("v1", "Event")
CRD = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
FAKE_NODE_LABEL = "gpudra.io/fake-node"


def fake_node(name: str, labels: dict[str, str] | None = None) -> Obj:
    """A schedulable, Ready Node with modest capacity and no kubelet."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            FAKE_NODE_LABEL: "true", **(labels or {})}},
        "spec": {},
        # Nodes accept status on create (pkg/registry/core/node/strategy.go).
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "fake node (no kubelet)"}],
            "phase": "Running",
            "nodeInfo": {"kubeletVersion": "v1.35.4", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "fake://0", "kernelVersion": "", "osImage": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
        },
    }


async def create_fake_node(kube: Kube, name: str, labels: dict[str, str] | None = None) -> Obj:
    """Create a fake Node and remove the not-ready taint that TaintNodesByCondition admission adds
    (no node-lifecycle controller runs to lift it, as in upstream's DRA integration tests)."""
    await kube.create(fake_node(name, labels))
    node = await kube.patch(NODE, name, {"spec": {"taints": None}})
    return node


async def delete_node(kube: Kube, name: str) -> None:
    await kube.delete(NODE, name)


async def create_scratch_namespace(kube: Kube, prefix: str = "t") -> str:
    """A fresh namespace, returned once its default ServiceAccount exists (pods need it)."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    await wait_for(lambda: kube.get(SERVICE_ACCOUNT, "default", name), timeout=30,
                   what=f"ServiceAccount {name}/default")
    return name


async def delete_namespace(kube: Kube, name: str) -> None:
    """Force-delete pods (no kubelet confirms a graceful delete on fake nodes), then the namespace."""
    pods: list[dict[str, Any]] = [p async for p in kube.list(POD, name)]
    for pod in pods:
        await kube.delete(POD, pod["metadata"]["name"], name, grace_period_seconds=0)
    await kube.delete(NAMESPACE, name)


def fake_slice(name: str, driver: str, node: str, *, generation: int = 1, owner_uid: str | None = None,
               devices: int = 1, labels: dict[str, str] | None = None) -> Obj:
    """A ResourceSlice for ``node``'s pool as an agent would publish it (``owner_uid``: owned by
    that Node; None: no owner, which the Kubernetes garbage collector never collects)."""
    meta: Obj = {"name": name, "labels": dict(labels or {})}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": owner_uid,
                                    "controller": True}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{i}", "attributes": {"index": {"int": i}},
                                  "capacity": {"memory": {"value": "80Gi"}}} for i in range(devices)]}}


async def events_about(kube: Kube, name: str, namespace: str = "default") -> list[Obj]:
    """The Events in ``namespace`` whose involved object is named ``name``."""
    return [e async for e in kube.list(EVENT, namespace, field_selector=f"involvedObject.name={name}")]


async def install_crd(kube: Kube, timeout: float = 60) -> Obj:
    """The GpuDraConfig CRD applied (server-side) and Established; the live CRD."""
    from gpudra_operator.crd import load_crd

    crd = load_crd()
    await kube.apply(crd)

    async def established() -> Obj | None:
        live = await kube.get(CRD, crd["metadata"]["name"])
        conditions = ((live or {}).get("status") or {}).get("conditions") or []
        return live if any(c["type"] == "Established" and c["status"] == "True" for c in conditions) else None

    return await wait_for(established, timeout=timeout, what=f"CRD {crd['metadata']['name']} to be Established")
