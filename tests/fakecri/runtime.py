"""The fake runtime's services and server (see the package docstring)."""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from cdispec import cdi_validate

from fakecri.gen import api_pb2 as pb
from fakecri.gen import api_pb2_grpc as rpc

DEFAULT_POD_IP = "10.88.0.2"  # no network: every pod gets this address, nothing listens there
# A pod annotated with an IP gets that one instead: 127.0.0.1 points the kubelet's probes at a
# process of the tests (the runtime runs no containers).
POD_IP_ANNOTATION = "fakecri.gpudra.io/pod-ip"


@dataclass
class CdiEdits:
    """What a runtime injects for the CDI devices of one container."""

    env: dict[str, str] = field(default_factory=dict)
    device_nodes: list[str] = field(default_factory=list)
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> host source
    hooks: list[list[str]] = field(default_factory=list)  # each hook's args (args[0]: its name)


# The OCI runtime spec's hook lists, in the order of a container's lifecycle.
OCI_HOOK_KINDS = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")


def resolve_cdi(names: Iterable[str], spec_dirs: Iterable[Path]) -> CdiEdits:
    """The edits of fully qualified CDI device names (``vendor/class=device``), as a runtime
    injects them: the official CDI library (hack/cdi-tools' ``cdi-validate --inject``) builds a
    CDI cache over ``spec_dirs`` as containerd does (a spec file that fails to load leaves only its
    own devices undefined) and injects all the names together into one empty OCI runtime spec
    (a spec's own edits apply once, each device's edits after them). Raises LookupError naming
    what does not resolve, ValueError when injection fails otherwise (e.g. a device node's host
    path that does not exist), and cdispec.CdiToolsUnavailable when cdi-validate is not built."""
    names = list(names)
    if not names:
        return CdiEdits()
    command = [str(cdi_validate()), "--inject", ",".join(names)]
    for directory in spec_dirs:
        command += ["--spec-dir", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        message = " | ".join(line.strip() for line in result.stderr.strip().splitlines())
        if "unresolvable CDI device" in message:
            raise LookupError(message)
        raise ValueError(f"CDI injection of {names} failed (exit {result.returncode}): {message}")
    oci: dict[str, Any] = json.loads(result.stdout)
    edits = CdiEdits()
    for entry in (oci.get("process") or {}).get("env") or []:
        key, _, value = entry.partition("=")
        edits.env[key] = value
    for node in (oci.get("linux") or {}).get("devices") or []:
        if node["path"] not in edits.device_nodes:
            edits.device_nodes.append(node["path"])
    for mount in oci.get("mounts") or []:
        edits.mounts[mount["destination"]] = mount.get("source", "")
    hooks = oci.get("hooks") or {}
    for kind in OCI_HOOK_KINDS:
        edits.hooks.extend(list(hook.get("args") or [hook["path"]]) for hook in hooks.get(kind) or [])
    return edits


@dataclass
class Sandbox:
    config: Any  # pb.PodSandboxConfig
    state: Any = pb.SANDBOX_READY  # a pb.PodSandboxState
    created: int = field(default_factory=time.time_ns)


@dataclass
class Container:
    config: Any  # pb.ContainerConfig
    sandbox_id: str
    cdi: CdiEdits
    log_path: str
    state: Any = pb.CONTAINER_CREATED  # a pb.ContainerState
    created: int = field(default_factory=time.time_ns)
    started: int = 0
    finished: int = 0

    @property
    def pod_name(self) -> str:
        return str(self.config.labels.get("io.kubernetes.pod.name", ""))


def _not_found(context: Any, message: str) -> NoReturn:
    context.abort(grpc.StatusCode.NOT_FOUND, message)
    raise AssertionError("unreachable: abort raises")


def _labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


class Runtime(rpc.RuntimeServiceServicer):  # type: ignore[misc]
    def __init__(self, cdi_dirs: Iterable[Path], log_root: Path) -> None:
        self.cdi_dirs = list(cdi_dirs)
        self.log_root = log_root.resolve()
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.sandboxes: dict[str, Sandbox] = {}
        self.containers: dict[str, Container] = {}
        self.created_sandboxes: list[Sandbox] = []  # every one ever run, removed ones too
        self.created: list[Container] = []  # every container ever created, removed ones too

    def Version(self, request: Any, context: Any) -> Any:
        return pb.VersionResponse(version="0.1.0", runtime_name="gpudra-fake-cri", runtime_version="0.1.0",
                                  runtime_api_version="v1")

    def Status(self, request: Any, context: Any) -> Any:
        return pb.StatusResponse(status=pb.RuntimeStatus(conditions=[
            pb.RuntimeCondition(type="RuntimeReady", status=True),
            pb.RuntimeCondition(type="NetworkReady", status=True)]))

    def RuntimeConfig(self, request: Any, context: Any) -> Any:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=pb.CGROUPFS))

    def UpdateRuntimeConfig(self, request: Any, context: Any) -> Any:
        return pb.UpdateRuntimeConfigResponse()

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self.ids):08d}"

    # -- pod sandboxes ----------------------------------------------------------------------------
    def RunPodSandbox(self, request: Any, context: Any) -> Any:
        with self.lock:
            sandbox_id = self._new_id("sandbox")
            self.sandboxes[sandbox_id] = Sandbox(request.config)
            self.created_sandboxes.append(self.sandboxes[sandbox_id])
        return pb.RunPodSandboxResponse(pod_sandbox_id=sandbox_id)

    def StopPodSandbox(self, request: Any, context: Any) -> Any:
        with self.lock:
            if sandbox := self.sandboxes.get(request.pod_sandbox_id):
                sandbox.state = pb.SANDBOX_NOTREADY
        return pb.StopPodSandboxResponse()

    def RemovePodSandbox(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.sandboxes.pop(request.pod_sandbox_id, None)
        return pb.RemovePodSandboxResponse()

    def PodSandboxStatus(self, request: Any, context: Any) -> Any:
        with self.lock:
            sandbox = self.sandboxes.get(request.pod_sandbox_id)
        if sandbox is None:
            _not_found(context, f"no pod sandbox {request.pod_sandbox_id}")
        config = sandbox.config
        return pb.PodSandboxStatusResponse(status=pb.PodSandboxStatus(
            id=request.pod_sandbox_id, metadata=config.metadata, state=sandbox.state, created_at=sandbox.created,
            network=pb.PodSandboxNetworkStatus(ip=config.annotations.get(POD_IP_ANNOTATION, DEFAULT_POD_IP)),
            labels=config.labels,
            annotations=config.annotations,
            linux=pb.LinuxPodSandboxStatus(namespaces=pb.Namespace(options=pb.NamespaceOption()))))

    def ListPodSandbox(self, request: Any, context: Any) -> Any:
        wanted = request.filter
        with self.lock:
            items = [pb.PodSandbox(id=sandbox_id, metadata=s.config.metadata, state=s.state, created_at=s.created,
                                   labels=s.config.labels, annotations=s.config.annotations)
                     for sandbox_id, s in self.sandboxes.items()
                     if (not wanted.id or wanted.id == sandbox_id)
                     and (not wanted.HasField("state") or wanted.state.state == s.state)
                     and _labels_match(wanted.label_selector, s.config.labels)]
        return pb.ListPodSandboxResponse(items=items)

    # -- containers -------------------------------------------------------------------------------
    def CreateContainer(self, request: Any, context: Any) -> Any:
        names = [device.name for device in request.config.CDI_devices]
        try:
            edits = resolve_cdi(names, self.cdi_dirs)
        except (LookupError, OSError, ValueError, RuntimeError, subprocess.SubprocessError) as error:
            context.abort(grpc.StatusCode.UNKNOWN, f"CDI devices {names}: {error}")
        # The log file, empty, where the kubelet expects it. Its path must be in every status:
        # with none, the kubelet's log cleanup globs and removes "*" in its working directory.
        # This process runs on the host: it writes only under the kubelet's pod log directory.
        log_path = Path(request.sandbox_config.log_directory, request.config.log_path).resolve()
        if not log_path.is_relative_to(self.log_root):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"log path {log_path} is outside {self.log_root}")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        with self.lock:
            container_id = self._new_id("container")
            container = Container(request.config, request.pod_sandbox_id, edits, str(log_path))
            self.containers[container_id] = container
            self.created.append(container)
        return pb.CreateContainerResponse(container_id=container_id)

    def StartContainer(self, request: Any, context: Any) -> Any:
        with self.lock:
            container = self.containers[request.container_id]
            container.state, container.started = pb.CONTAINER_RUNNING, time.time_ns()
        return pb.StartContainerResponse()

    def StopContainer(self, request: Any, context: Any) -> Any:
        with self.lock:
            container = self.containers.get(request.container_id)
            if container is not None and container.state != pb.CONTAINER_EXITED:
                container.state, container.finished = pb.CONTAINER_EXITED, time.time_ns()
        return pb.StopContainerResponse()

    def RemoveContainer(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.containers.pop(request.container_id, None)
        return pb.RemoveContainerResponse()

    def ListContainers(self, request: Any, context: Any) -> Any:
        wanted = request.filter
        with self.lock:
            items = [pb.Container(id=container_id, pod_sandbox_id=c.sandbox_id, metadata=c.config.metadata,
                                  image=c.config.image, image_ref=c.config.image.image, state=c.state,
                                  created_at=c.created, labels=c.config.labels, annotations=c.config.annotations)
                     for container_id, c in self.containers.items()
                     if (not wanted.id or wanted.id == container_id)
                     and (not wanted.pod_sandbox_id or wanted.pod_sandbox_id == c.sandbox_id)
                     and (not wanted.HasField("state") or wanted.state.state == c.state)
                     and _labels_match(wanted.label_selector, c.config.labels)]
        return pb.ListContainersResponse(containers=items)

    def ContainerStatus(self, request: Any, context: Any) -> Any:
        with self.lock:
            container = self.containers.get(request.container_id)
        if container is None:
            _not_found(context, f"no container {request.container_id}")
        config = container.config
        return pb.ContainerStatusResponse(status=pb.ContainerStatus(
            id=request.container_id, metadata=config.metadata, state=container.state,
            created_at=container.created, started_at=container.started, finished_at=container.finished,
            exit_code=0, image=config.image, image_ref=config.image.image, labels=config.labels,
            annotations=config.annotations, log_path=container.log_path,
            reason="Completed" if container.state == pb.CONTAINER_EXITED else ""))

    def ListContainerStats(self, request: Any, context: Any) -> Any:
        return pb.ListContainerStatsResponse()

    def ListPodSandboxStats(self, request: Any, context: Any) -> Any:
        return pb.ListPodSandboxStatsResponse()

    def containers_of(self, pod_name: str) -> list[Container]:
        """Every container created for the pod, in order, removed ones too."""
        with self.lock:
            return [c for c in self.created if c.pod_name == pod_name]

    def sandboxes_of(self, pod_name: str) -> list[Sandbox]:
        """Every sandbox run for the pod, in order, removed ones too."""
        with self.lock:
            return [s for s in self.created_sandboxes if s.config.metadata.name == pod_name]

    def sandbox_died(self, pod_name: str) -> None:
        """The pod's sandboxes stop and their containers exit, as when a runtime restarts: the
        kubelet runs the pod again in a new sandbox."""
        with self.lock:
            dead = {i for i, s in self.sandboxes.items() if s.config.metadata.name == pod_name}
            for sandbox_id in dead:
                self.sandboxes[sandbox_id].state = pb.SANDBOX_NOTREADY
            for container in self.containers.values():
                if container.sandbox_id in dead and container.state != pb.CONTAINER_EXITED:
                    container.state, container.finished = pb.CONTAINER_EXITED, time.time_ns()


class Images(rpc.ImageServiceServicer):  # type: ignore[misc]
    """Every pull succeeds at once; an image is its name."""

    def __init__(self) -> None:
        self.images: dict[str, Any] = {}

    def ListImages(self, request: Any, context: Any) -> Any:
        return pb.ListImagesResponse(images=list(self.images.values()))

    def ImageStatus(self, request: Any, context: Any) -> Any:
        image = self.images.get(request.image.image)
        return pb.ImageStatusResponse(image=image) if image is not None else pb.ImageStatusResponse()

    def PullImage(self, request: Any, context: Any) -> Any:
        name = request.image.image
        self.images[name] = pb.Image(id=name, repo_tags=[name], size=1, spec=request.image)
        return pb.PullImageResponse(image_ref=name)

    def RemoveImage(self, request: Any, context: Any) -> Any:
        self.images.pop(request.image.image, None)
        return pb.RemoveImageResponse()

    def ImageFsInfo(self, request: Any, context: Any) -> Any:
        usage = pb.FilesystemUsage(timestamp=time.time_ns(), fs_id=pb.FilesystemIdentifier(mountpoint="/"),
                                   used_bytes=pb.UInt64Value(value=1), inodes_used=pb.UInt64Value(value=1))
        return pb.ImageFsInfoResponse(image_filesystems=[usage], container_filesystems=[usage])


class FakeRuntime:
    """Both CRI services on one unix socket, served from a thread pool until ``stop()``."""

    def __init__(self, socket: Path, cdi_dirs: Iterable[Path], log_root: Path) -> None:
        self.socket = socket
        self.runtime = Runtime(cdi_dirs, log_root)
        self.images = Images()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fake-cri"))
        rpc.add_RuntimeServiceServicer_to_server(self.runtime, self.server)
        rpc.add_ImageServiceServicer_to_server(self.images, self.server)
        self.server.add_insecure_port(f"unix://{socket}")

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> FakeRuntime:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None).wait()

    def describe(self) -> str:
        """Pods and containers as the runtime holds them, for a failing test's message."""
        with self.runtime.lock:
            return json.dumps({
                "sandboxes": {i: s.config.metadata.name for i, s in self.runtime.sandboxes.items()},
                "containers": {i: [c.pod_name, c.config.metadata.name, c.state]
                               for i, c in self.runtime.containers.items()}})
