"""`gpudra explain` as a user runs it: the command as a subprocess against the real control plane
and the real gpudra-allocator of its release, for a pod that cannot fit (an 8-GPU claim asking for
64Gi on 40Gi A100s), with the RBAC that docs/explain.md documents and nothing more, and for bad
input: a missing pod, a claim of another driver, a user the API refuses, a feature gate the
release does not know, no gpudra-allocator installed. Exit 1 with one line on stderr, never a
traceback."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

from gpudra_driver.discovery import discover
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices
from gpudra_operator.deviceclasses import render_device_class
from gpudra_dev.localcluster.controlplane import ControlPlane

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "explain.md"


def explain(kubeconfig: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpudra.cli", "explain", *args, "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **(env or {})})


def documented_rbac(namespace: str, user: str) -> list[Obj]:
    """docs/explain.md's ClusterRole and Role, for ``namespace``, bound to ``user``."""
    block = re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert block is not None, "docs/explain.md lost its RBAC block"
    cluster_role, role = yaml.safe_load_all(block.group(1))
    suffix = secrets.token_hex(3)
    cluster_role["metadata"]["name"] = f"gpudra-explain-{suffix}"
    role["metadata"].update(namespace=namespace)
    subject = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    return [cluster_role, role,
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": f"gpudra-explain-{suffix}"}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role["metadata"]["name"]}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "gpudra-explain", "namespace": namespace}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpudra-explain"}}]


async def test_explain_tells_a_user_why_the_pod_is_pending(
        kube: Kube, cluster: ControlPlane, namespace: str, fake_nodes, tmp_path: Path) -> None:
    suffix = secrets.token_hex(3)
    driver, class_name = f"x{suffix}.gpudra.io", f"gpu-{suffix}.gpudra.io"
    node = (await fake_nodes("a100"))["metadata"]["name"]
    slices = build_slices(driver, node, None, 1, discover(FakeNvml(load_profile("dgx-a100-40gb"))))
    device_class = render_device_class(class_name, driver, template="full-gpu")
    foreign_class: Obj = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"fpga-{suffix}.example.com"},
                     "spec": {"selectors": [{"cel": {"expression": 'device.driver == "fpga.example.com"'}}]}}
    created: list[Obj] = []
    try:
        for obj in [*slices, device_class, foreign_class]:
            created.append(await kube.create(obj))
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": "big", "namespace": namespace},
                           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                               "deviceClassName": class_name, "count": 8, "selectors": [{"cel": {"expression":
                                   f'device.capacity["{driver}"].memory.compareTo(quantity("64Gi")) >= 0'}}]}}]}}})
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": "fpga", "namespace": namespace},
                           "spec": {"devices": {"requests": [{"name": "fpga", "exactly": {
                               "deviceClassName": foreign_class["metadata"]["name"]}}]}}})
        await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "namespace": namespace},
                           "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": "big"}],
                                    "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                    "resources": {"claims": [{"name": "gpus"}]}}]}})
        user = f"alice-{suffix}"
        alice = cluster.user_kubeconfig(tmp_path / "alice.kubeconfig", user, groups=())

        # A user with no rights at all: a clear refusal.
        refused = explain(alice, "pod", f"{namespace}/trainer", "--driver", driver)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert refused.stderr.startswith(f"gpudra explain: not allowed to read pod {namespace}/trainer: ")

        # With docs/explain.md's RBAC: the verdict, and notes on what it could not read.
        for obj in documented_rbac(namespace, user):
            created.append(await kube.create(obj))
        answer = explain(alice, "pod", f"{namespace}/trainer", "--driver", driver)
        assert answer.returncode == 0, answer.stderr
        lines = answer.stdout.splitlines()
        assert lines[-1].startswith("no node can satisfy request gpu: 8 devices match the class, 0 pass request gpu #0")
        assert f"(largest: 40Gi on {node}/gpu-" in lines[-1]
        assert f"{namespace}/big  gpu      {class_name}  {node}" in answer.stdout
        assert "note: Nodes are not readable" in answer.stdout
        assert "note: ResourceClaims of other namespaces are not readable" in answer.stdout
        minor = await kube.server_minor()
        assert re.search(rf"^  allocator: Kubernetes 1\.{minor}\.\d+$", answer.stdout, re.M), answer.stdout

        # The cluster's scheduler started with other gates: the allocator is told, and says so.
        gated = explain(alice, "pod", f"{namespace}/trainer", "--driver", driver, "--feature-gates", "DRAAdminAccess=false")
        assert gated.returncode == 0, gated.stderr
        assert "feature gates DRAAdminAccess=false" in gated.stdout and gated.stdout.splitlines()[-1] == lines[-1]

        as_json = json.loads(explain(alice, "claim", f"{namespace}/big", "--driver", driver, "-o", "json").stdout)
        assert as_json["satisfiable"] is False and as_json["claims"][0]["requests"][0]["nodes"][0]["class_match"] == 8

        # Bad input: one line, exit 1.
        for args, message in [
            (("pod", f"{namespace}/nope"), f"gpudra explain: pod {namespace}/nope not found"),
            (("claim", f"{namespace}/fpga"), f"gpudra explain: claim {namespace}/fpga: no request is for {driver}'s devices"),
            (("claim", "a/b/c"), "gpudra explain: 'a/b/c' is not NAMESPACE/NAME"),
            (("pod", f"{namespace}/trainer", "--feature-gates", "DRANope=true"),
             f"gpudra explain: unknown DRA feature gate(s) for Kubernetes 1.{minor}."),
        ]:
            result = explain(alice, *args, "--driver", driver)
            assert result.returncode == 1 and result.stderr.startswith(message), result.stderr
            assert len(result.stderr.splitlines()) == 1 and result.stdout == ""
        # No gpudra-allocator: the message says how to get one.
        missing = explain(alice, "pod", f"{namespace}/trainer", "--driver", driver,
                          env={"GPUDRA_ALLOCATOR_DIR": str(tmp_path / "no-allocator")})
        assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1 and missing.stdout == ""
        assert missing.stderr.startswith("gpudra explain: gpudra-allocator (Kubernetes' own DRA allocator") \
            and "hack/allocator-bin.sh" in missing.stderr, missing.stderr
    finally:
        for obj in reversed(created):
            rtype = resource_type(obj["apiVersion"], obj["kind"])
            await kube.delete(rtype, obj["metadata"]["name"], obj["metadata"].get("namespace"))
