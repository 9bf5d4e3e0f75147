"""Pods on the host network by admission: the stand-in for a pod network on a test node that has
none (tests/realruntime.py runs no CNI plugin, so only hostNetwork pods start there).

A mutating admission webhook, served by this process, changes every Pod created in the given
namespaces, whoever creates it (a Deployment, a DaemonSet, a Job):

* ``hostNetwork: true``;
* ``KUBERNETES_SERVICE_HOST=127.0.0.1`` and ``KUBERNETES_SERVICE_PORT=<the API server's port>`` in
  every container: without kube-proxy the ``kubernetes`` Service's IP leads nowhere, and the API
  server's certificate names 127.0.0.1;
* every container port moved to a free port of the host, wherever the pod names it: the port
  itself (and its ``hostPort``), probes that give it as a number, and arguments that carry it
  (``8080`` or ``--port=8080``). On the host network the ports are the host's, shared with
  whatever else runs there.

The server runs in a thread: the API server calls it while a test blocks on a subprocess. The
webhook fails closed (``failurePolicy: Fail``), so a pod it cannot change is refused, never
started without its network."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpudra_core.kubeapi import Obj
from gpudra_dev.localcluster.controlplane import free_port
from gpudra_dev.localcluster.pki import CertPair

SERVICE_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


def moved_ports(spec: Obj) -> dict[int, int]:
    """Every container port of the pod -> a free port of the host."""
    ports = {p["containerPort"] for c in [*spec.get("initContainers", []), *spec["containers"]]
             for p in c.get("ports") or []}
    return {port: free_port() for port in sorted(ports)}


def _move_token(token: str, moved: dict[int, int]) -> str:
    head, eq, value = token.rpartition("=")
    if value.isdigit() and int(value) in moved:
        return f"{head}{eq}{moved[int(value)]}"
    return token


def on_host_network(container: Obj, moved: dict[int, int], apiserver_port: int) -> Obj:
    """``container`` as it runs on the host network (see the module docstring). Pure."""
    out = copy.deepcopy(container)
    env = [e for e in out.get("env") or [] if e["name"] not in SERVICE_ENV]
    out["env"] = [*env, {"name": SERVICE_ENV[0], "value": "127.0.0.1"}, {"name": SERVICE_ENV[1], "value": str(apiserver_port)}]
    for port in out.get("ports") or []:
        port["containerPort"] = port["hostPort"] = moved[port["containerPort"]]
    for field in ("command", "args"):
        if field in out:
            out[field] = [_move_token(token, moved) for token in out[field]]
    for probe in PROBES:
        for handler in ("httpGet", "tcpSocket", "grpc"):
            action = (out.get(probe) or {}).get(handler)
            if action and isinstance(action.get("port"), int) and action["port"] in moved:
                action["port"] = moved[action["port"]]
    return out


def pod_patch(pod: Obj, apiserver_port: int) -> list[Obj]:
    """The JSON patch that puts ``pod`` on the host network."""
    spec = pod["spec"]
    moved = moved_ports(spec)
    patch: list[Obj] = [{"op": "add", "path": "/spec/hostNetwork", "value": True}]
    for field in ("initContainers", "containers"):
        if spec.get(field):
            patch.append({"op": "replace", "path": f"/spec/{field}",
                          "value": [on_host_network(c, moved, apiserver_port) for c in spec[field]]})
    return patch


class HostNetworkWebhook:
    """The webhook's HTTPS server (``cert``: a serving certificate for 127.0.0.1, issued by the CA
    in ``ca_pem``) and the MutatingWebhookConfiguration that points the API server at it."""

    def __init__(self, name: str, cert: CertPair, ca_pem: bytes, apiserver_port: int, namespaces: list[str]) -> None:
        self.name, self.ca_pem, self.namespaces = name, ca_pem, namespaces
        self.apiserver_port = apiserver_port
        self.admitted: list[str] = []  # namespace/name (or generateName) of every pod changed
        self.errors: list[str] = []
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                try:
                    review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    request = review["request"]
                    pod = request["object"]
                    patch = pod_patch(pod, webhook.apiserver_port)
                    meta = pod.get("metadata") or {}
                    webhook.admitted.append(f"{request.get('namespace')}/{meta.get('name') or meta.get('generateName')}")
                    response: dict[str, Any] = {"uid": request["uid"], "allowed": True, "patchType": "JSONPatch",
                                                "patch": base64.b64encode(json.dumps(patch).encode()).decode()}
                except Exception as error:  # noqa: BLE001 - answered as a refusal, kept for the test
                    webhook.errors.append(f"{type(error).__name__}: {error}")
                    response = {"uid": locals().get("request", {}).get("uid", ""), "allowed": False,
                                "status": {"message": f"host-network webhook: {error}"}}
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                   "response": response}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert.cert, cert.key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="host-network-webhook", daemon=True)

    def configuration(self) -> Obj:
        return {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": self.name},
            "webhooks": [{
                "name": "host-network.tests.gpudra.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "timeoutSeconds": 10, "reinvocationPolicy": "Never",
                "clientConfig": {"url": f"https://127.0.0.1:{self.port}/mutate",
                                 "caBundle": base64.b64encode(self.ca_pem).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                           "scope": "Namespaced"}],
                "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                                            "values": self.namespaces}]},
            }],
        }

    def start(self) -> HostNetworkWebhook:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(timeout=10)
        self.server.server_close()
