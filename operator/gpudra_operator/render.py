"""``render(config) -> Rendered``: the desired children of one GpuDraConfig, as plain dicts. Pure.

Children: the agent DaemonSet ``gpudra-agent`` in ``spec.agent.namespace`` and one DeviceClass per
``spec.deviceClasses`` entry. Every child carries

* the labels ``app.kubernetes.io/managed-by: gpudra-operator`` and ``gpudra.io/config: <name>``
  (the operator prunes by them), and never the GpuDraConfig's own labels or annotations: copying
  them would copy GitOps tracking labels (Argo CD's ``app.kubernetes.io/instance``) and get the
  children pruned or shown OutOfSync;
* an ownerReference to the GpuDraConfig (``controller: true``, ``blockOwnerDeletion: true``), set
  here explicitly rather than with ``kopf.adopt``, which is wrong for a cluster-scoped owner. A
  cluster-scoped owner may own both the namespaced DaemonSet and the cluster-scoped DeviceClasses.
  Without ``metadata.uid`` (a file given to ``gpudra render``) no ownerReference is emitted.

The agent's ServiceAccount ``gpudra-agent`` and its RBAC are **not** rendered: they ship statically
in ``manifests/``. An operator that creates RBAC must already hold every permission it grants (or the
``escalate``/``bind`` verbs, which security scanners rightly flag), so creating the agent's
ResourceSlice/ResourceClaim permissions would widen the operator's own role for no benefit: the
agent's permissions do not depend on the spec. See docs/design.md.

The agent pod (a DRA kubelet plugin) needs:

* ``<kubeletDir>/plugins_registry``: the kubelet's plugin watcher finds the registration socket
  there; mounted at the same path, since the kubelet is told socket paths as host paths.
* ``<kubeletDir>/plugins/<driverName>``: the DRA gRPC socket (and the agent's checkpoint). Only the
  driver's own directory is mounted, not all of ``plugins/``. No mount propagation: the agent
  creates sockets and files there, never mounts, so ``Bidirectional`` (NVIDIA's choice) would only
  let mounts leak between container and host.
* ``cdiDir``: the agent writes one CDI spec per prepared claim; the container runtime reads it.
* ``driverRoot`` read-only at ``/driver-root`` (``HostToContainer`` so a driver container that
  mounts its root after the agent started is still seen): the agent opens ``libnvidia-ml.so.1``
  from it by full path and reads the driver files that claims' CDI specs mount
  (``--driver-root`` is the host path those specs name, ``--container-driver-root`` where the
  agent reads it). ``NVIDIA_VISIBLE_DEVICES=void``: an NVIDIA runtime in legacy mode injects nothing.
* the host's ``/dev`` read-only at ``/host-dev`` (``--host-dev``): a claim's device nodes are checked
  there before its spec is written when the driver root has none. The container's own ``/dev`` is
  a copy made when it started, without nodes the driver creates later (MIG capability nodes after
  a MIG change, every node when the driver loads after the agent).
* ``privileged: true``: NVML needs the host's ``/dev/nvidia*`` device nodes (a privileged container
  sees the host's ``/dev``, so no ``/dev`` hostPath is needed) and hostPath writes need root.
  Hence the agent namespace must be labelled ``pod-security.kubernetes.io/enforce: privileged``.
* ``--metrics-port 8082`` and a container port named ``metrics`` for Prometheus (docs/metrics.md);
  a later ``--metrics-port`` in ``spec.agent.extraArgs`` wins.
* ``NODE_NAME``/``POD_UID``/``POD_NAMESPACE`` from the downward API: the node whose slices the
  agent publishes, and the pod identity for its own bookkeeping; ``GPUDRA_CONFIG``, the config's
  name: an agent stopped while it is gone or being deleted cleans its node up (an uninstall).
* ``SSL_CERT_FILE`` (the ServiceAccount CA) and ``PYTHONOPTIMIZE=2``: see ``AGENT_PROCESS_ENV``;
  ``spec.agent.extraEnv`` overrides them (in the agent's DaemonSet; the MPS supervisor's gets them
  as they are).
* ``--consumable-memory-step``/``--consumable-shares`` from ``spec.sharing.consumableCapacity``
  (docs/sharing.md), unless the caller says the API server would drop what they publish
  (``consumable_capacity=False``: the operator's probe, :mod:`gpudra_operator.features`).
* ``--mig`` and ``--mig-node-group`` from ``spec.mig`` (docs/mig.md): each agent resolves them
  against its Node's labels, and checks itself whether the API server keeps counters (static MIG
  where it does not).
* RollingUpdate with ``maxSurge: 1, maxUnavailable: 0`` by default: the new agent starts next to the
  old one, so the kubelet never sees the driver deregister and never wipes the node's slices.
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudra_core.agentcontract import MPS_SUPERVISOR_SOCKET
from gpudra_core.migpolicy import MigPolicy, policy_args
from gpudra_operator.deviceclasses import RenderError, render_device_classes
from gpudra_operator.spec import AgentSpec, ConsumableCapacitySpec, GpuDraConfig, thaw


def _release() -> str:
    try:
        return importlib.metadata.version("gpudra")
    except importlib.metadata.PackageNotFoundError:  # a source tree without the package installed
        return "0.1.0"

API_VERSION = "gpudra.io/v1alpha1"
KIND = "GpuDraConfig"
AGENT_NAME = "gpudra-agent"
AGENT_SERVICE_ACCOUNT = "gpudra-agent"
AGENT_CONTAINER = "agent"
MPS_NAME = "gpudra-mps"  # the MPS supervisor's DaemonSet (spec.sharing.mps)
MPS_CONTAINER = "mps-supervisor"
MANAGED_BY = "gpudra-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_CONFIG = "gpudra.io/config"
DRIVER_ROOT_MOUNT = "/driver-root"
HOST_DEV_MOUNT = "/host-dev"
AGENT_READY_FILE = "/tmp/gpudra-ready"  # written by `gpudra agent --ready-file`
AGENT_METRICS_PORT = 8082  # the port named "metrics" (PodMonitor: manifests/monitoring/)
AGENT_HEALTH_PORT = 8083  # the port named "health": grpc.health.v1 for the kubelet's probes
AGENT_HEALTH_SERVICE = "liveness"
SERVICE_ACCOUNT_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
# Process settings of the agent, which the local harness applies as well. The cluster CA as the
# default CA file: aiohttp loads the default CA file into a TLS context at import, and the agent
# verifies only the API server, against the cluster CA. Optimisation level 2: no docstrings kept in
# memory (kubernetes-asyncio's generated classes, which the agent imports but never uses, are mostly
# docstrings); the image ships bytecode compiled for it (images/agent.Dockerfile). What each saves,
# and why no other setting is here: docs/agent.md, "Footprint" (bench/agent_footprint.py measures
# each both ways).
AGENT_PROCESS_ENV = {"SSL_CERT_FILE": SERVICE_ACCOUNT_CA, "PYTHONOPTIMIZE": "2"}
# In the container only: an NVIDIA runtime in legacy mode would otherwise give the agent every GPU
# and the driver's libraries; the agent opens NVML from the driver root itself.
AGENT_CONTAINER_ENV = {"NVIDIA_VISIBLE_DEVICES": "void", **AGENT_PROCESS_ENV}
# The agent image when spec.agent.image is unset: the operator's own setting (its Deployment's
# env, which kustomize `images:` and the Helm chart set), else this release's image.
AGENT_IMAGE_ENV = "GPUDRA_AGENT_IMAGE"
DEFAULT_AGENT_IMAGE = f"ghcr.io/gpudra/gpudra:{_release()}"


def configured_agent_image() -> str:
    """The operator's agent image: ``$GPUDRA_AGENT_IMAGE``, else this release's."""
    return os.environ.get(AGENT_IMAGE_ENV) or DEFAULT_AGENT_IMAGE

Obj = dict[str, Any]

# Where agents run when spec.agent sets neither nodeSelector nor affinity: nodes that a label says
# have an NVIDIA GPU. Any one label is enough (the terms are ORed): Node Feature Discovery's PCI
# vendor label (NVIDIA is PCI vendor 10de), GPU Feature Discovery's (the GPU Operator installs it),
# or gpudra's own for labelling a node by hand (docs/deploy.md, "Which nodes run an agent").
GPU_NODE_LABELS = ("feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present", "gpudra.io/gpu-node")
DEFAULT_AGENT_AFFINITY: Obj = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": label, "operator": "In", "values": ["true"]}]}
                          for label in GPU_NODE_LABELS]}}}


@dataclass
class Rendered:
    """What one GpuDraConfig should produce: ``objects`` (the agents' DaemonSet first, the MPS
    supervisor's when spec.sharing.mps asks for it, then the DeviceClasses in spec order) and the ``errors`` of classes that could not be rendered (those
    classes are simply absent from ``objects``; the caller must leave their live objects alone)."""

    objects: list[Obj] = field(default_factory=list)
    errors: list[RenderError] = field(default_factory=list)

    @property
    def daemonset(self) -> Obj | None:
        """The agents' DaemonSet."""
        return next((o for o in self.objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == AGENT_NAME),
                    None)

    @property
    def mps_daemonset(self) -> Obj | None:
        """The MPS supervisor's DaemonSet; None unless spec.sharing.mps asks for it."""
        return next((o for o in self.objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == MPS_NAME),
                    None)

    @property
    def device_classes(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == "DeviceClass"]

    @property
    def failed_classes(self) -> list[str]:
        return [e.class_name for e in self.errors]


def child_labels(config_name: str) -> dict[str, str]:
    """The labels on every object a GpuDraConfig owns: the operator's label selector."""
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_CONFIG: config_name}


def label_selector(labels: Mapping[str, str]) -> str:
    """The string form of an equality-based label selector."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def child_selector(config_name: str) -> str:
    """Label selector matching every child of ``config_name``."""
    return label_selector(child_labels(config_name))


def agent_selector(config_name: str) -> str:
    """Label selector matching the agent pods of ``config_name``."""
    return label_selector(agent_labels(config_name))


def owner_reference(config: GpuDraConfig) -> Obj | None:
    if not config.uid:
        return None
    return {"apiVersion": API_VERSION, "kind": KIND, "name": config.name, "uid": config.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(config: GpuDraConfig, name: str, *, namespace: str | None = None,
              labels: Mapping[str, str] | None = None,
              annotations: Mapping[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = {**(labels or {}), **child_labels(config.name)}
    if annotations:
        meta["annotations"] = dict(annotations)
    ref = owner_reference(config)
    if ref is not None:
        meta["ownerReferences"] = [ref]
    return meta


def agent_labels(config_name: str) -> dict[str, str]:
    return {LABEL_NAME: AGENT_NAME, **child_labels(config_name)}


def sharing_args(consumable: ConsumableCapacitySpec | None) -> list[str]:
    """The agent's flags for consumable capacity (none without it)."""
    if consumable is None:
        return []
    return ["--consumable-memory-step", consumable.memory_step,
            *(["--consumable-shares", str(consumable.shares)] if consumable.shares else [])]


def agent_args(driver_name: str, agent: AgentSpec, consumable: ConsumableCapacitySpec | None = None,
               mig: MigPolicy = MigPolicy()) -> list[str]:
    return ["agent", "--driver", driver_name, "--kubelet-dir", agent.kubelet_dir,
            "--cdi-dir", agent.cdi_dir, "--driver-root", agent.driver_root,
            "--container-driver-root", DRIVER_ROOT_MOUNT, "--host-dev", HOST_DEV_MOUNT,
            *(["--allow-device-plugin"] if agent.allow_device_plugin else []),
            *sharing_args(consumable),
            *policy_args(mig),
            "--metrics-port", str(AGENT_METRICS_PORT), *agent.extra_args,
            # last, so that it wins over extraArgs: the probes dial this port
            "--health-port", str(AGENT_HEALTH_PORT)]


def _host_volume(name: str, path: str, kind: str) -> Obj:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def render_daemonset(config: GpuDraConfig, agent_image: str = DEFAULT_AGENT_IMAGE, *,
                     consumable_capacity: bool = True) -> Obj:
    """``consumable_capacity``: whether the API server keeps consumable capacity's fields (False
    leaves spec.sharing.consumableCapacity out of the agent's flags)."""
    spec = config.spec
    agent = spec.agent
    labels = agent_labels(config.name)
    registry_dir = posixpath.join(agent.kubelet_dir, "plugins_registry")
    plugin_dir = posixpath.join(agent.kubelet_dir, "plugins", spec.driver_name)

    def field_env(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}

    container: Obj = {
        "name": AGENT_CONTAINER,
        "image": agent.image or agent_image,
        "imagePullPolicy": agent.image_pull_policy,
        "command": ["gpudra"],
        "args": agent_args(spec.driver_name, agent,
                           spec.sharing.consumable_capacity if consumable_capacity else None, spec.mig.policy),
        "env": [
            field_env("NODE_NAME", "spec.nodeName"),
            field_env("POD_UID", "metadata.uid"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            {"name": "GPUDRA_READY_FILE", "value": AGENT_READY_FILE},
            # at SIGTERM, the agent removes its node's slices and files if this config is gone
            {"name": "GPUDRA_CONFIG", "value": config.name},
            # spec.agent.extraEnv may override these (env is a list keyed by name: no duplicates)
            *({"name": name, "value": value} for name, value in AGENT_CONTAINER_ENV.items()
              if name not in {e.name for e in agent.extra_env}),
            # The API server drops an empty value; leaving it out keeps a no-op drift tick a no-op.
            *({"name": e.name, "value": e.value} if e.value else {"name": e.name} for e in agent.extra_env),
        ],
        "securityContext": {"privileged": True},
        # Ready once the kubelet registered the plugin and the node's slices are published, so a
        # rolling update (maxSurge 1, maxUnavailable 0) retires the old agent only after that.
        "readinessProbe": {"exec": {"command": ["test", "-f", AGENT_READY_FILE]}, "periodSeconds": 5},
        # Alive while its own sockets answer a fresh dial, as the kubelet's would (a socket file
        # removed from under it, a wedged event loop: restarted). Start-up (the checkpoint and CDI
        # reconciliation) gets five minutes; waiting for NVML is alive (gpudra_driver.plugin.liveness).
        "startupProbe": {"grpc": {"port": AGENT_HEALTH_PORT, "service": AGENT_HEALTH_SERVICE},
                         "periodSeconds": 5, "timeoutSeconds": 10, "failureThreshold": 60},
        "livenessProbe": {"grpc": {"port": AGENT_HEALTH_PORT, "service": AGENT_HEALTH_SERVICE},
                          "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3},
        "ports": [{"name": "metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"},
                  {"name": "health", "containerPort": AGENT_HEALTH_PORT, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "plugins-registry", "mountPath": registry_dir},
            # HostToContainer: the MPS supervisor's /dev/shm tmpfs under mps/ come and go on the
            # host; a private copy here would keep an unmounted one (and its pages) alive
            {"name": "plugin", "mountPath": plugin_dir, "mountPropagation": "HostToContainer"},
            {"name": "cdi", "mountPath": agent.cdi_dir},
            {"name": "driver-root", "mountPath": DRIVER_ROOT_MOUNT, "readOnly": True,
             "mountPropagation": "HostToContainer"},
            {"name": "host-dev", "mountPath": HOST_DEV_MOUNT, "readOnly": True, "mountPropagation": "HostToContainer"},
        ],
    }
    if agent.resources:
        container["resources"] = thaw(agent.resources)

    pod_spec: Obj = {
        "serviceAccountName": AGENT_SERVICE_ACCOUNT,
        "priorityClassName": agent.priority_class_name,
        "containers": [container],
        "volumes": [
            _host_volume("plugins-registry", registry_dir, "DirectoryOrCreate"),
            _host_volume("plugin", plugin_dir, "DirectoryOrCreate"),
            _host_volume("cdi", agent.cdi_dir, "DirectoryOrCreate"),
            _host_volume("driver-root", agent.driver_root, "Directory"),
            _host_volume("host-dev", "/dev", "Directory"),
        ],
    }
    _place_like_the_agents(pod_spec, agent)

    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(config, AGENT_NAME, namespace=agent.namespace, labels=labels),
        "spec": {
            # Immutable once created: only labels that never change for this config.
            "selector": {"matchLabels": {LABEL_NAME: AGENT_NAME, LABEL_CONFIG: config.name}},
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": agent.update_strategy.max_unavailable,
                                  "maxSurge": agent.update_strategy.max_surge},
            },
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _place_like_the_agents(pod_spec: Obj, agent: AgentSpec) -> None:
    """spec.agent's priority class, node selector, affinity and tolerations on ``pod_spec``."""
    if not agent.priority_class_name:
        del pod_spec["priorityClassName"]
    if agent.node_selector:
        pod_spec["nodeSelector"] = dict(agent.node_selector)
    if agent.affinity:
        pod_spec["affinity"] = thaw(agent.affinity)
    elif agent.affinity is None and not agent.node_selector:  # `affinity: {}` opts out: every node
        pod_spec["affinity"] = copy.deepcopy(DEFAULT_AGENT_AFFINITY)
    if agent.tolerations:
        pod_spec["tolerations"] = thaw(agent.tolerations)


def render_mps_daemonset(config: GpuDraConfig, agent_image: str = DEFAULT_AGENT_IMAGE) -> Obj:
    """The MPS supervisor (gpudra_driver.plugin.sharing.mps.supervisor) on every node that runs an agent: the same
    image and placement. Never rolled with the agents: replacing its pod stops the MPS daemons of
    that node's claims, so it is replaced only when its pod is deleted (OnDelete). No API access
    (no token); its process namespace is shared with the pod's pause container, which reaps the
    daemons' exited children.

    Of the plugin directory it sees only ``mps/`` (the agent's checkpoint and the kubelet's sockets
    stay out of reach of a process that runs tenants' daemons), at the host's path, with
    Bidirectional propagation: the claims' /dev/shm tmpfs it mounts there must reach the host,
    where the container runtime binds them into the claims' containers (the CDI specs name them by
    host path). Its own file system is read-only: the daemons write only under ``mps/``."""
    spec = config.spec
    mps = spec.sharing.mps
    assert mps is not None
    agent = spec.agent
    labels = {LABEL_NAME: MPS_NAME, **child_labels(config.name)}
    plugin_dir = posixpath.join(agent.kubelet_dir, "plugins", spec.driver_name)
    mps_dir = posixpath.join(plugin_dir, "mps")
    container: Obj = {
        "name": MPS_CONTAINER,
        "image": agent.image or agent_image,
        "imagePullPolicy": agent.image_pull_policy,
        "command": ["gpudra"],
        "args": ["mps-supervisor", "--plugin-dir", plugin_dir, "--driver-root", DRIVER_ROOT_MOUNT, "--isolate-shm",
                 "--shm-size", mps.shm_size, "--max-shm-size", mps.max_shm_size],
        "env": [{"name": name, "value": value} for name, value in AGENT_CONTAINER_ENV.items()],
        # the daemons open the GPUs' device nodes and get a mount namespace of their own (/dev/shm);
        # the claims' /dev/shm are tmpfs it mounts, propagated to the host (Bidirectional needs privileged)
        "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
        "readinessProbe": {"exec": {"command": ["test", "-S", posixpath.join(mps_dir, MPS_SUPERVISOR_SOCKET)]},
                           "periodSeconds": 5},
        "volumeMounts": [
            {"name": "mps", "mountPath": mps_dir, "mountPropagation": "Bidirectional"},
            {"name": "driver-root", "mountPath": DRIVER_ROOT_MOUNT, "readOnly": True,
             "mountPropagation": "HostToContainer"},
        ],
    }
    pod_spec: Obj = {
        "automountServiceAccountToken": False,
        "shareProcessNamespace": True,
        "priorityClassName": agent.priority_class_name,
        "containers": [container],
        "volumes": [_host_volume("mps", mps_dir, "DirectoryOrCreate"),
                    _host_volume("driver-root", agent.driver_root, "Directory")],
    }
    _place_like_the_agents(pod_spec, agent)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(config, MPS_NAME, namespace=agent.namespace, labels=labels),
        "spec": {
            "selector": {"matchLabels": {LABEL_NAME: MPS_NAME, LABEL_CONFIG: config.name}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _finish_device_class(config: GpuDraConfig, doc: Obj) -> Obj:
    meta = doc.get("metadata") or {}
    spec = dict(doc["spec"])
    entry = next((c for c in config.spec.device_classes if c.name == meta["name"]), None)
    if entry is not None and entry.extended_resource_name:  # the entry wins over what a template wrote
        spec["extendedResourceName"] = entry.extended_resource_name
    return {
        "apiVersion": doc["apiVersion"],
        "kind": doc["kind"],
        "metadata": _metadata(config, meta["name"], labels=meta.get("labels"),
                              annotations=meta.get("annotations")),
        "spec": spec,
    }


def render(config_body: Mapping[str, Any], *, agent_image: str = DEFAULT_AGENT_IMAGE,
           consumable_capacity: bool = True) -> Rendered:
    """The desired objects of the GpuDraConfig ``config_body`` (a kopf body or a plain dict);
    ``agent_image`` is the agent's image unless ``spec.agent.image`` names one;
    ``consumable_capacity`` False when the API server would drop consumable capacity's fields
    (the agents are then not asked to publish them).

    Raises :class:`gpudra_operator.spec.SpecError` only for a body of the wrong shape (which the
    CRD's schema prevents); a DeviceClass that fails to render lands in ``errors`` instead and never
    stops the others."""
    config = GpuDraConfig.from_body(config_body)
    classes, errors = render_device_classes(config.spec.device_classes, config.spec.driver_name)
    objects = [render_daemonset(config, agent_image, consumable_capacity=consumable_capacity),
               *([render_mps_daemonset(config, agent_image)] if config.spec.sharing.mps is not None else []),
               *(_finish_device_class(config, doc) for doc in classes)]
    return Rendered(objects=objects, errors=errors)
