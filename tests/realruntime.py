"""A node with a real container runtime: containerd (built from its Go module by
hack/containerd-bin.sh, CDI enabled) running containers with Debian's runc, and the release's real
kubelet (:class:`realkubelet.RealKubelet`) on containerd's CRI socket, set up as the project's
notes on these machines (container-runtime.md) found to work:

* **one private mount namespace** shared by containerd, its shims (which containerd starts) and
  the kubelet: a holder process (``unshare --mount --propagation private``, then ``sleep``) sets it
  up, the others join it with ``nsenter``. runc must see the kubelet's mounts (its root directory's
  bind mount, projected volumes). In it: empty tmpfs over ``/var/lib`` and ``/var/log`` (the
  kubelet's own directories; containerd's root ``/var/lib/containerd``) and over ``/run``
  (containerd's state ``/run/containerd``, where its shims put their sockets whatever the
  configured state directory, and runc's state); the kubelet's sysctls shown through files
  bind-mounted over /proc/sys; optionally (``binds``) directories of the work directory shown at
  a node's well-known paths, such as the kubelet's root at ``/var/lib/kubelet``; ``/`` made rshared
  inside it (its own peer groups: nothing propagates to the host), as the kubelet expects and
  HostToContainer volumes need. So the host sees none of the node's mounts, and they all go when
  the namespace's last process exits;
* containerd's own socket (in the work directory), ``restrict_oom_score_adj`` (no
  CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj to the sandbox's -998), CDI with the
  agent's CDI directory as its only spec directory (never the host's /etc/cdi or /var/run/cdi), the
  sandbox image imported from a tar (tests/ociimage.py), ``netns_mounts_under_state_dir``;
* **hostNetwork pods only**: no CNI plugin ever runs. A one-plugin CNI config in a directory of our
  own (with an empty plugin directory) makes containerd report the network ready, so the kubelet
  reports its Node Ready; a pod without hostNetwork would fail to start, never touch the host's
  network. Images are imported (``ctr images import``), pods use ``imagePullPolicy: Never`` and
  the sandbox image is a ``localhost/`` name: nothing is ever pulled, no traffic leaves the machine;
* teardown in reverse, every step tried whatever failed before: the kubelet, then every sandbox
  stopped and removed through CRI (their shims exit), containerd, any process still in the
  namespace, the holder; then the cgroup directories runc left (``/k8s.io``, made when it was not
  there). :meth:`RealRuntimeNode.leftovers` says what is left anyway (the tests assert nothing).

Every process is started with ``setpriv --pdeathsig`` (:func:`dying_with_parent`): a test run killed
outright leaves no holder, containerd or kubelet; running containers and their shims would stay
(they are daemons), with the namespace they hold."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import ociimage
from cachedtool import tool_dir
from realkubelet import RealKubelet, isolation_problem

from gpudra_dev.localcluster.processes import dying_with_parent, stop_process

CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "crictl")
CONTAINERD_FIX = ("make containerd (builds containerd, its runc shim, ctr and crictl from the Go module proxy "
                  "into ~/.cache/gpudra/containerd/<version>; then set GPUDRA_CONTAINERD_DIR to the directory it "
                  "prints, as make test does)")
RUNC_FIX = "hack/debian-packages.sh (or: apt-get install -y runc)"
TEST_IMAGE = "localhost/gpudra-e2e/busybox:1"
PAUSE_IMAGE = "localhost/gpudra-e2e/pause:1"
K8S_NAMESPACE = "k8s.io"
CGROUP_ROOT = Path("/sys/fs/cgroup")
REPO = Path(__file__).resolve().parent.parent
# containerd's cgroup parent for pods when the kubelet gives none (cgroupsPerQOS off): runc creates
# /k8s.io/<id> in every hierarchy, and leaves /k8s.io behind, empty.
CGROUP_PARENT = "k8s.io"


def read_cri_log(path: Path) -> str:
    """The text of a container log the runtime wrote in CRI format (``<time> <stream> <P|F>
    <text>``; P lines are partial, joined to the next); "" when there is none yet."""
    if not path.exists():
        return ""
    out, partial = [], ""
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        text = parts[3] if len(parts) == 4 else ""
        if parts[2] == "P":
            partial += text
        else:
            out.append(partial + text)
            partial = ""
    return "\n".join(out)


def containerd_dir() -> Path:
    """$GPUDRA_CONTAINERD_DIR (as make test sets it), else hack/containerd-bin.sh's cache, with
    containerd, its shim, ctr and crictl; fails with the fix."""
    directory, where = tool_dir("GPUDRA_CONTAINERD_DIR", "containerd-bin.sh", "CONTAINERD_VERSION", "containerd")
    missing = [b for b in CONTAINERD_BINARIES if not os.access(directory / b, os.X_OK)]
    if missing:
        raise AssertionError(f"{where} lacks {', '.join(missing)}: {CONTAINERD_FIX}")
    return directory


def runc_binary() -> Path:
    found = shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise AssertionError(f"no runc (containerd's OCI runtime here): {RUNC_FIX}")
    return Path(found)


def runtime_problem() -> str | None:
    """Why this machine cannot run the node (besides missing binaries, which fail), or None."""
    if problem := isolation_problem():
        return problem
    if shutil.which("nsenter") is None:
        return "the real-runtime test needs util-linux's nsenter"
    return None


def _mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class RealRuntimeNode:
    """containerd + the real kubelet for Node ``node_name``, in one mount namespace (see the module
    docstring), working in ``workdir`` (short: containerd's socket lives there)."""

    def __init__(self, workdir: Path, *, kubelet_binary: Path, kubeconfig: Path, node_name: str, cdi_dir: Path,
                 taint: str, binds: Mapping[str, Path] | None = None) -> None:
        self.workdir, self.node_name, self.cdi_dir = workdir, node_name, cdi_dir
        # Directories shown at a node's well-known paths inside its namespace (path -> directory),
        # e.g. the kubelet's root at /var/lib/kubelet: what a config's default paths expect. Only
        # under the namespace's own tmpfs mounts, so making the mount points never touches the host.
        self.binds = dict(binds or {})
        for path in self.binds:
            real = os.path.realpath(path)
            assert real.startswith(("/var/lib/", "/run/")), f"bind target {path} is not under /var/lib or /run"
        self.bin_dir = containerd_dir()
        self.runc = runc_binary()
        self.socket = workdir / "containerd.sock"
        self.endpoint = f"unix://{self.socket}"
        self.kubelet = RealKubelet(kubelet_binary, workdir / "kubelet", kubeconfig=kubeconfig, node_name=node_name,
                                   runtime_endpoint=self.endpoint, taint=taint)
        self.holder: subprocess.Popen[bytes] | None = None
        self.namespace: str | None = None  # the holder's mount namespace, "mnt:[inode]"
        self.containerd: subprocess.Popen[bytes] | None = None
        self.containerd_log = workdir / "containerd.log"
        self.ids: set[str] = set()  # every sandbox and container ID seen (for the cgroup check)
        self.shim_pids: set[int] = set()
        self.remaining: list[str] = []  # sandboxes and containers containerd still had after removing them
        self.host_had_run_containerd = Path("/run/containerd").exists()
        self.cgroup_parents_before = set(self._cgroup_parents())

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> RealRuntimeNode:
        if problem := runtime_problem():
            raise AssertionError(problem)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self.kubelet.root_dir.mkdir(parents=True, exist_ok=True)
        self._start_holder()
        self._start_containerd()
        images = self.workdir / "images"
        self.import_image(ociimage.pause_image(images / "pause.tar", PAUSE_IMAGE))
        self.import_image(ociimage.busybox_image(images / "busybox.tar", TEST_IMAGE))
        self.kubelet.namespace_of = self.holder.pid if self.holder else None
        self.kubelet.start()
        return self

    def _start_holder(self) -> None:
        ready = self.workdir / "namespace-ready"
        # rshared inside the namespace (new peer groups of its own; the host's mounts were made
        # private to it): the kubelet expects it, and containerd refuses HostToContainer volumes
        # (the agent DaemonSet's driver root and /dev) from a private mount.
        binds = "".join(f"mkdir -p {shlex.quote(os.path.realpath(path))}\n"
                        f"mount --bind {shlex.quote(str(source))} {shlex.quote(os.path.realpath(path))}\n"
                        for path, source in self.binds.items())
        setup = (self.kubelet._masked_sysctls() + "mount -t tmpfs gpudra-node /run\n" + binds + "mount --make-rshared /\n"
                 f"touch {shlex.quote(str(ready))}\nexec sleep 2147483647\n")
        argv = dying_with_parent(["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec", setup])
        with (self.workdir / "namespace.log").open("ab") as log:
            self.holder = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not ready.exists():
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the node's mount namespace was not set up (exit {self.holder.poll()}): "
                                     f"{(self.workdir / 'namespace.log').read_text(errors='replace')}")
            time.sleep(0.05)
        self.namespace = _mount_namespace(self.holder.pid)
        assert self.namespace and self.namespace != _mount_namespace(os.getpid())

    def config_toml(self) -> str:
        cni_bin, cni_conf = self.workdir / "cni-bin", self.workdir / "cni-conf"
        cni_bin.mkdir(exist_ok=True)  # empty: no plugin ever runs (hostNetwork pods only)
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-hostnetwork-only.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "gpudra-hostnetwork-only", "plugins": [{"type": "loopback"}]}))
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = {json.dumps(str(self.socket))}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = {json.dumps(PAUSE_IMAGE)}
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = {json.dumps(str(self.workdir / "registry-hosts"))}

[{runtime}]
  enable_cdi = true
  cdi_spec_dirs = [{json.dumps(str(self.cdi_dir))}]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = {json.dumps(str(self.runc))}
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = [{json.dumps(str(cni_bin))}]
    conf_dir = {json.dumps(str(cni_conf))}
"""

    def _start_containerd(self) -> None:
        assert self.holder is not None
        config = self.workdir / "containerd.toml"
        config.write_text(self.config_toml())
        env = {**os.environ, "PATH": f"{self.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        argv = dying_with_parent(["nsenter", "-t", str(self.holder.pid), "-m", "--",
                                  str(self.bin_dir / "containerd"), "--config", str(config)])
        with self.containerd_log.open("ab") as log:
            self.containerd = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, cwd=self.workdir)
        deadline = time.monotonic() + 30
        while True:
            if self.containerd.poll() is not None:
                raise AssertionError(f"containerd exited ({self.containerd.returncode}):\n{self.containerd_tail()}")
            if self.socket.is_socket() and self.ctr("version", check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd did not serve on {self.socket} in 30 s:\n{self.containerd_tail()}")
            time.sleep(0.1)

    # -- clients --------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(self.bin_dir / "ctr"), "--address", str(self.socket), "-n", K8S_NAMESPACE, *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def crictl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / "crictl"), "--runtime-endpoint", self.endpoint, "--image-endpoint", self.endpoint,
                "--timeout", "20s", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "CRI_CONFIG_FILE": "/dev/null"})
        if check and result.returncode != 0:
            raise AssertionError(f"crictl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def import_image(self, tar: Path) -> None:
        self.ctr("images", "import", str(tar))

    def sandbox_ids(self) -> list[str]:
        ids = self.crictl("pods", "-q", "--no-trunc").stdout.split()
        self.ids.update(ids)
        return ids

    def container_ids(self) -> list[str]:
        ids = self.crictl("ps", "-a", "-q", "--no-trunc").stdout.split()
        self.ids.update(ids)
        return ids

    def remember(self) -> None:
        """Note the IDs of every sandbox and container now, and containerd's shims."""
        if self.containerd is not None and self.containerd.poll() is None:
            self.sandbox_ids()
            self.container_ids()
        self.shim_pids.update(self._shims())

    def _shims(self) -> list[int]:
        return [pid for pid in _pids() if "containerd-shim-runc-v2" in _cmdline(pid)
                and str(self.socket) in _cmdline(pid)]

    def _namespace_pids(self) -> list[int]:
        if self.namespace is None:
            return []
        return [pid for pid in _pids() if pid != os.getpid() and _mount_namespace(pid) == self.namespace]

    def containerd_tail(self, lines: int = 30) -> str:
        text = self.containerd_log.read_text(errors="replace") if self.containerd_log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def describe(self) -> str:
        """containerd's and crictl's view, for failure messages."""
        parts = []
        for args in (("pods",), ("ps", "-a")):
            try:
                parts.append(f"crictl {' '.join(args)}:\n{self.crictl(*args, check=False).stdout}")
            except (OSError, subprocess.SubprocessError) as error:
                parts.append(f"crictl {' '.join(args)}: {error}")
        parts.append(f"containerd log:\n{self.containerd_tail()}")
        return "\n".join(parts)

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Tear the node down; every step runs whatever failed before. Returns what went wrong."""
        problems: list[str] = []

        def step(what: str, action: object) -> None:
            try:
                action()  # type: ignore[operator]
            except Exception as error:  # noqa: BLE001 - teardown goes on
                problems.append(f"{what}: {type(error).__name__}: {error}")

        step("remembering sandboxes", self.remember)
        step("stopping the kubelet", self.kubelet.stop)
        step("removing sandboxes", self._remove_sandboxes)
        step("stopping containerd", self._stop_containerd)
        step("killing the namespace's processes", self._kill_namespace)
        step("removing cgroups", self._remove_cgroups)
        return problems

    def _remove_sandboxes(self) -> None:
        if self.containerd is None or self.containerd.poll() is not None:
            return
        for sandbox in self.sandbox_ids():
            self.crictl("stopp", sandbox, check=False)
            self.crictl("rmp", "--force", sandbox, check=False)
        # A shim exits once its sandbox's tasks are deleted.
        deadline = time.monotonic() + 15
        while self._shims() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.remaining = [f"sandbox {i}" for i in self.sandbox_ids()] + [f"container {i}" for i in self.container_ids()]

    def _stop_containerd(self) -> None:
        if self.containerd is not None:
            stop_process(self.containerd, timeout=15)

    def _kill_namespace(self) -> None:
        """SIGKILL what is left in the node's namespace (shims, their containers' init processes
        live in namespaces of their own and die with their shim's SIGKILL of them, or below), then
        the holder. Once nothing is left in it, the namespace is forgotten (its inode number may be reused)."""
        if self.namespace is None:
            return
        for pid in {*self._namespace_pids(), *(p for p in self._shims())} - {self.holder.pid if self.holder else -1}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.holder is not None:
            stop_process(self.holder, signal.SIGKILL, timeout=10)
        deadline = time.monotonic() + 10
        while self._namespace_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self._namespace_pids():
            self.namespace = None

    def _our_cgroups(self) -> list[Path]:
        """Cgroup directories (any hierarchy) named after a sandbox or container of this node."""
        if not self.ids:
            return []
        found = []
        for hierarchy in CGROUP_ROOT.iterdir():
            if not hierarchy.is_dir() or hierarchy.is_symlink():
                continue
            for dirpath, dirnames, _ in os.walk(hierarchy):
                depth = Path(dirpath).relative_to(hierarchy).parts
                if len(depth) >= 4:
                    dirnames.clear()
                    continue
                found += [Path(dirpath) / d for d in dirnames if any(i in d for i in self.ids)]
        return found

    @staticmethod
    def _cgroup_parents() -> list[Path]:
        return [path for path in CGROUP_ROOT.glob(f"*/{CGROUP_PARENT}") if path.is_dir()]

    def _new_cgroup_parents(self) -> list[Path]:
        """The /k8s.io cgroups this node's containerd created (none was there when it was made)."""
        return [path for path in self._cgroup_parents() if path not in self.cgroup_parents_before]

    def _remove_cgroups(self) -> None:
        """rmdir (only empty cgroups go) what runc left of this node's containers and sandboxes,
        deepest first, then the /k8s.io parents it made."""
        for path in [*sorted(self._our_cgroups(), key=lambda p: len(p.parts), reverse=True),
                     *self._new_cgroup_parents()]:
            try:
                path.rmdir()
            except OSError:
                pass

    def leftovers(self) -> list[str]:
        """What this node left on the host after :meth:`stop`: processes (in its namespace, shims of
        its containerd, the three started), mounts under its work directory, cgroups of its
        sandboxes and containers, containerd's default state directory."""
        left = []
        for name, process in (("holder", self.holder), ("containerd", self.containerd), ("kubelet", self.kubelet.process)):
            if process is not None and process.poll() is None:
                left.append(f"{name} still running: pid {process.pid}")
        left += [f"process in the node's mount namespace: {pid} {_cmdline(pid)}" for pid in self._namespace_pids()]
        left += [f"shim: {pid} {_cmdline(pid)}" for pid in self._shims()]
        left += [f"shim still running: {pid} {_cmdline(pid)}" for pid in self.shim_pids if _cmdline(pid)
                 and "containerd-shim" in _cmdline(pid)]
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if str(self.workdir) in line or "gpudra-node" in line:
                left.append(f"mount: {line}")
        left += [f"cgroup: {path}" for path in [*self._our_cgroups(), *self._new_cgroup_parents()]]
        left += [f"in containerd after removing everything: {what}" for what in self.remaining]
        if Path("/run/containerd").exists() and not self.host_had_run_containerd:
            left.append("/run/containerd appeared on the host (shim sockets outside the node's namespace?)")
        return left
