"""The host-network webhook's patch (tests/hostnetwork.py), which the getting-started e2e test puts
on the README's pods: the operator's and the agent's containers as render and manifests/base make them."""

from __future__ import annotations

import copy

from hostnetwork import pod_patch

OPERATOR = {"name": "operator", "args": ["operator", "--liveness-port=8080", "--metrics-port=8081"],
            "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.1"}, {"name": "HOME", "value": "/tmp"}],
            "ports": [{"name": "healthz", "containerPort": 8080}, {"name": "metrics", "containerPort": 8081}],
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "healthz"}}}
AGENT = {"name": "agent", "command": ["gpudra"], "args": ["agent", "--metrics-port", "8082", "--health-port", "8083"],
         "ports": [{"name": "metrics", "containerPort": 8082}, {"name": "health", "containerPort": 8083}],
         "startupProbe": {"grpc": {"port": 8083, "service": "liveness"}},
         "readinessProbe": {"exec": {"command": ["test", "-f", "/tmp/ready"]}}}


def patched(*containers: dict) -> dict:
    pod = {"spec": {"containers": copy.deepcopy(list(containers))}}
    out = copy.deepcopy(pod)
    for op in pod_patch(pod, 6443):  # add or replace of a key of spec: all the patch does
        assert op["op"] in ("add", "replace") and op["path"].startswith("/spec/"), op
        out["spec"][op["path"].removeprefix("/spec/")] = op["value"]
    assert pod == {"spec": {"containers": list(containers)}}, "the patch changed its input"
    return out


def test_every_port_moves_with_its_arguments_and_probes() -> None:
    spec = patched(OPERATOR, AGENT)["spec"]
    assert spec["hostNetwork"] is True
    operator, agent = spec["containers"]
    healthz, metrics = (p["containerPort"] for p in operator["ports"])
    assert operator["args"] == ["operator", f"--liveness-port={healthz}", f"--metrics-port={metrics}"]
    assert all(p["hostPort"] == p["containerPort"] for c in (operator, agent) for p in c["ports"])
    assert operator["livenessProbe"]["httpGet"]["port"] == "healthz"  # by name: follows the port
    agent_metrics, health = (p["containerPort"] for p in agent["ports"])
    assert agent["args"] == ["agent", "--metrics-port", str(agent_metrics), "--health-port", str(health)]
    assert agent["startupProbe"]["grpc"]["port"] == health
    assert len({healthz, metrics, agent_metrics, health}) == 4


def test_the_api_server_is_at_127_0_0_1() -> None:
    (operator,) = patched(OPERATOR)["spec"]["containers"]
    env = {e["name"]: e["value"] for e in operator["env"]}
    assert env == {"HOME": "/tmp", "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
