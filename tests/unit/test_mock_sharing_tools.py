"""The mock driver's GPU-sharing boundary (tests/mocknvml): the compute mode through the REAL pynvml
on the mock libnvidia-ml.so.1, ``nvidia-smi -c`` and ``compute-policy``, and the mock
``nvidia-cuda-mps-control`` daemon and client, all run as separate processes on one fake driver
root, sharing its state and recording each call in its calls.log
(:mod:`gpudra_dev.localcluster.mockstate`).

Needs ``make mock-nvml mock-nvidia-smi mock-mps-control``. Every MPS test ends with no daemon left
(the ``root`` fixture kills any and fails the test that left one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pynvml
import pytest
import yaml

from gpudra_driver.nvml.fake import FakeNvml, Profile, parse_profile
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.fakedriverroot import LIB_DIR, make_driver_root, mock_nvml_library



def _profile() -> Profile:
    """a100-80gb-mig plus two GPUs without MIG: several GPUs to select, and MIG UUIDs to refuse."""
    doc = yaml.safe_load((resources.files("gpudra_driver") / "profiles" / "a100-80gb-mig.yaml").read_text())
    first = doc["gpus"][0]
    for n in (1, 2):
        doc["gpus"].append({**first, "uuid": f"GPU-{n}1521ace-0579-559b-b008-e94ddc1e940f",
                            "busId": f"00000000:{0x07 + 0x10 * n:02X}:00.0", "migMode": "disabled", "migDevices": []})
    return parse_profile("a100-80gb-mig-x3", doc)


PROF = _profile()
GPU0 = PROF.gpus[0]
MIG0 = next(iter(GPU0.migs.values()))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    try:
        lib = mock_nvml_library()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):
        if not (lib.parent / tool).is_file():
            pytest.fail(f"{lib.parent / tool} is not built: make mock-nvidia-smi mock-mps-control", pytrace=False)
    path = make_driver_root(tmp_path / "root", PROF, library=lib, device_nodes=False)
    yield path
    left = mockstate.kill_mps_daemons(path)
    assert left == [], f"the test left mock MPS daemons running: {left}"


def tool(root: Path, name: str, *args: str, stdin: str = "", env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(root / "usr/bin" / name), *args], input=stdin, capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


def smi(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return tool(root, "nvidia-smi", *args, env=env)


# -- the compute mode through NVML: real pynvml on the mock, across processes --------------------

NVML_CHILD = r'''
import ctypes, json, sys
import pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
out = {}
for op in json.loads(sys.argv[2]):
    h = pynvml.nvmlDeviceGetHandleByUUID(op[1])
    try:
        out[" ".join(map(str, op))] = (pynvml.nvmlDeviceSetComputeMode(h, op[2]) if op[0] == "set"
                                       else pynvml.nvmlDeviceGetComputeMode(h))
    except pynvml.NVMLError as e:
        out[" ".join(map(str, op))] = "!" + type(e).__name__
pynvml.nvmlShutdown()
print(json.dumps(out))
'''


def nvml(root: Path, *ops: tuple[object, ...], env: dict[str, str] | None = None) -> dict[str, object]:
    """Run ("get", uuid) / ("set", uuid, mode) in a fresh interpreter on the root's libnvidia-ml.so.1."""
    proc = subprocess.run(
        [sys.executable, "-c", NVML_CHILD, str((root / LIB_DIR / "libnvidia-ml.so.1").absolute()), json.dumps(ops)],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_compute_mode_is_shared_between_processes_and_logged(root: Path) -> None:
    gpu1 = PROF.gpus[1].uuid
    assert nvml(root, ("set", GPU0.uuid, 3)) == {f"set {GPU0.uuid} 3": None}
    # another process (and the test) sees it; the other GPU is untouched
    assert nvml(root, ("get", GPU0.uuid), ("get", gpu1)) == {f"get {GPU0.uuid}": 3, f"get {gpu1}": 0}
    assert mockstate.compute_mode(root, GPU0.uuid) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    # nvidia-smi changes the same state
    done = smi(root, "-i", GPU0.uuid, "-c", "DEFAULT")
    assert done.returncode == 0, done.stderr
    assert nvml(root, ("get", GPU0.uuid)) == {f"get {GPU0.uuid}": 0}
    assert nvml(root, ("set", GPU0.uuid, 2), ("set", GPU0.uuid, 0)) == {f"set {GPU0.uuid} 2": None,
                                                                         f"set {GPU0.uuid} 0": None}
    assert mockstate.calls(root) == [
        f"nvml SetComputeMode {GPU0.uuid} 3",
        f"nvidia-smi -c {GPU0.uuid} 0",
        f"nvml SetComputeMode {GPU0.uuid} 2",
        f"nvml SetComputeMode {GPU0.uuid} 0",
    ]


def test_compute_mode_refusals_match_the_simulator_and_change_nothing(root: Path) -> None:
    ops = [("set", GPU0.uuid, 1), ("set", GPU0.uuid, 4), ("set", GPU0.uuid, -1), ("set", MIG0.uuid, 3),
           ("get", MIG0.uuid), ("get", GPU0.uuid)]
    real = nvml(root, *ops)
    assert real == {
        f"set {GPU0.uuid} 1": "!NVMLError_InvalidArgument",  # EXCLUSIVE_THREAD: support removed
        f"set {GPU0.uuid} 4": "!NVMLError_InvalidArgument",
        f"set {GPU0.uuid} -1": "!NVMLError_InvalidArgument",
        f"set {MIG0.uuid} 3": "!NVMLError_NotSupported",  # set on the parent GPU only
        f"get {MIG0.uuid}": "!NVMLError_NotSupported",
        f"get {GPU0.uuid}": 0,
    }
    sim = FakeNvml(PROF)
    sim.nvmlInit()
    simulated: dict[str, object] = {}
    for op in ops:
        handle = sim.nvmlDeviceGetHandleByUUID(op[1])
        try:
            simulated[" ".join(map(str, op))] = (sim.nvmlDeviceSetComputeMode(handle, op[2]) if op[0] == "set"
                                                 else sim.nvmlDeviceGetComputeMode(handle))
        except pynvml.NVMLError as exc:
            simulated[" ".join(map(str, op))] = "!" + type(exc).__name__
    assert simulated == real
    assert mockstate.calls(root) == []


def test_compute_mode_without_permission(root: Path) -> None:
    # A state directory the mocks cannot create (sysfs refuses even root): what a non-root caller
    # gets from the real library and tool.
    env = {mockstate.STATE_ENV: "/sys/gpudra-mock-state"}
    assert nvml(root, ("set", GPU0.uuid, 3), env=env) == {f"set {GPU0.uuid} 3": "!NVMLError_NoPermission"}
    done = smi(root, "-i", "0", "-c", "3", env=env)
    assert done.returncode == 4
    assert "Unable to set the compute mode for GPU 00000000:07:00.0: Insufficient Permissions" in done.stderr


# -- nvidia-smi -c ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "mode", "name"), [
    ("EXCLUSIVE_PROCESS", 3, "EXCLUSIVE_PROCESS"), ("3", 3, "EXCLUSIVE_PROCESS"), ("DEFAULT", 0, "DEFAULT"),
    ("0", 0, "DEFAULT"), ("PROHIBITED", 2, "PROHIBITED"),
])
def test_nvidia_smi_sets_the_compute_mode(root: Path, value: str, mode: int, name: str) -> None:
    done = smi(root, "-i", GPU0.uuid, "-c", value)
    assert (done.returncode, done.stdout, done.stderr) == (
        0, f"Set compute mode to {name} for GPU {GPU0.bus_id}.\nAll done.\n", "")
    assert mockstate.compute_mode(root, GPU0.uuid) == mode
    assert mockstate.calls(root, "nvidia-smi") == [f"nvidia-smi -c {GPU0.uuid} {mode}"]


def test_nvidia_smi_selects_gpus_by_index_list_bus_id_or_all(root: Path) -> None:
    gpus = [g.uuid for g in PROF.gpus]
    assert smi(root, "--id=1", "--compute-mode=3").returncode == 0
    assert [mockstate.compute_mode(root, u) for u in gpus] == [0, 3] + [0] * (len(gpus) - 2)
    assert smi(root, "-i", f"0,{PROF.gpus[1].bus_id.lower()}", "-c", "2").returncode == 0
    assert [mockstate.compute_mode(root, u) for u in gpus[:2]] == [2, 2]
    everything = smi(root, "-c", "0")  # no -i: every GPU
    assert everything.returncode == 0
    assert everything.stdout.count("Set compute mode to DEFAULT") == len(gpus)
    assert mockstate.calls(root)[-len(gpus):] == [f"nvidia-smi -c {u} 0" for u in gpus]


@pytest.mark.parametrize(("args", "rc", "message"), [
    (["-i", "GPU-00000000-0000-0000-0000-00000000dead", "-c", "3"], 6, "No devices were found"),
    (["-i", "9", "-c", "3"], 6, "No devices were found"),
    (["-i", "0", "-c", "7"], 2, "Invalid combination of input arguments"),
    (["-i", "0", "-c", "EXCLUSIVE_THREAD"], 2, "Invalid combination of input arguments"),
    (["-i", "0", "-c"], 2, "Invalid combination of input arguments"),
    (["-i", MIG0.uuid, "-c", "3"], 3, f"Unable to set the compute mode for MIG device {MIG0.uuid}: Not Supported"),
])
def test_nvidia_smi_compute_mode_errors(root: Path, args: list[str], rc: int, message: str) -> None:
    done = smi(root, *args)
    assert done.returncode == rc, done
    assert message in done.stderr
    assert mockstate.compute_mode(root, GPU0.uuid) == 0
    assert mockstate.calls(root) == []


# -- nvidia-smi compute-policy --------------------------------------------------------------------


def test_nvidia_smi_sets_and_reads_back_the_timeslice(root: Path) -> None:
    assert smi(root, "compute-policy", "-i", GPU0.uuid, "--get-timeslice").stdout == f"{GPU0.uuid} 0\n"
    done = smi(root, "compute-policy", "-i", GPU0.uuid, "--set-timeslice", "2")
    assert (done.returncode, done.stdout) == (0, f"Set timeslice to MEDIUM for GPU {GPU0.bus_id}.\nAll done.\n")
    assert smi(root, "compute-policy", "-i", "0", "--get-timeslice").stdout == f"{GPU0.uuid} 2\n"
    assert mockstate.timeslice(root, GPU0.uuid) == 2
    assert smi(root, "compute-policy", "--id=1", "--set-timeslice=3").returncode == 0
    everything = smi(root, "compute-policy", "--get-timeslice")
    assert everything.stdout.splitlines() == [f"{GPU0.uuid} 2", f"{PROF.gpus[1].uuid} 3"] + [
        f"{g.uuid} 0" for g in PROF.gpus[2:]]
    assert mockstate.calls(root) == [
        f"nvidia-smi compute-policy {GPU0.uuid} --set-timeslice 2",
        f"nvidia-smi compute-policy {PROF.gpus[1].uuid} --set-timeslice 3",
    ]


@pytest.mark.parametrize(("args", "rc", "message"), [
    (["-i", "GPU-00000000-0000-0000-0000-00000000dead", "--set-timeslice", "1"], 6, "No devices were found"),
    (["-i", "0", "--set-timeslice", "4"], 2, "Invalid combination of input arguments"),
    (["-i", "0", "--set-timeslice", "LONG"], 2, "Invalid combination of input arguments"),
    (["-i", "0"], 2, "Invalid combination of input arguments"),
    (["-i", "0", "--set-timeslice", "1", "--get-timeslice"], 2, "Invalid combination of input arguments"),
    (["-i", MIG0.uuid, "--set-timeslice", "1"], 3, "Not Supported"),
])
def test_nvidia_smi_timeslice_errors(root: Path, args: list[str], rc: int, message: str) -> None:
    done = smi(root, "compute-policy", *args)
    assert done.returncode == rc, done
    assert message in done.stderr
    assert mockstate.timeslice(root, GPU0.uuid) == 0
    assert mockstate.calls(root) == []


def test_nvidia_smi_keeps_its_listing(root: Path) -> None:
    assert smi(root, "--version").stdout == f"gpudra mock nvidia-smi\nDRIVER version : {PROF.driver_version}\n"
    # no -c: the listing, of the GPUs whose /dev/nvidia<minor> exist (this root made none here,
    # and a host /dev has none of this profile's minors only by chance: assert the header alone)
    listing = smi(root, "-L")
    assert listing.stdout.startswith(f"gpudra mock nvidia-smi: driver {PROF.driver_version}, GPUs:")
    assert mockstate.calls(root) == []


# -- nvidia-cuda-mps-control ------------------------------------------------------------------------


def mps_env(tmp_path: Path, name: str = "a", devices: str | None = None) -> dict[str, str]:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / name / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / name / "log")}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def mps(root: Path, env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([str(root / mockstate.MPS_CONTROL), *args], input=stdin, capture_output=True, text=True,
                          timeout=30, env={**clean, **env})


def start(root: Path, env: dict[str, str]) -> int:
    """`nvidia-cuda-mps-control -d`; the daemon's PID from its PID file."""
    done = mps(root, env, "-d")  # returns (and its captured pipes close) while the daemon runs on
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    return int((Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "nvidia-cuda-mps-control.pid").read_text())


def test_mps_daemon_starts_detached_and_announces_itself(root: Path, tmp_path: Path) -> None:
    gpu1 = PROF.gpus[1].uuid
    env = mps_env(tmp_path, devices=f"0,{gpu1}")
    pid = start(root, env)
    pipe, log = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    # detached: not our child, in another session and process group
    assert os.getsid(pid) not in (os.getsid(0), pid) and os.getpgid(pid) != os.getpgid(0)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert sorted(p.name for p in pipe.iterdir()) == ["control", "control_lock", "nvidia-cuda-mps-control.pid"]
    control_log = (log / "control.log").read_text()
    assert f"Control {pid}] Starting control daemon using socket {pipe}/control\n" in control_log
    assert f"CUDA_VISIBLE_DEVICES=0,{gpu1}, serving {GPU0.uuid},{gpu1}" in control_log
    assert mockstate.mps_daemons(root) == [mockstate.MpsDaemon(pid, pipe, log, f"0,{gpu1}", (GPU0.uuid, gpu1))]
    assert mockstate.calls(root) == [f"mps-control {pipe} -d 0,{gpu1}"]
    assert mps(root, env, stdin="quit\n").returncode == 0
    assert mockstate.wait_exited(pid, timeout=10)


def test_mps_commands_and_their_calls(root: Path, tmp_path: Path) -> None:
    gpu1 = PROF.gpus[1].uuid
    env = mps_env(tmp_path, devices=f"{GPU0.uuid},{gpu1}")
    pid = start(root, env)
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    done = mps(root, env, stdin=(
        "get_default_active_thread_percentage\n"
        "set_default_active_thread_percentage 50\n"
        "get_default_active_thread_percentage\n"
        f"set_default_device_pinned_mem_limit {GPU0.uuid} 1024M\n"
        "set_default_device_pinned_mem_limit 1 2G\n"
        f"get_default_device_pinned_mem_limit {GPU0.uuid}\n"
        f"get_default_device_pinned_mem_limit {gpu1}\n"
        "\n"
        "get_server_list\n"
    ))
    assert (done.returncode, done.stdout, done.stderr) == (0, "100.0\n50.0\n50.0\n1024M\n2048M\n", "")
    assert mockstate.calls(root, "mps-control")[1:] == [
        f"mps-control {pipe} get_default_active_thread_percentage",
        f"mps-control {pipe} set_default_active_thread_percentage 50",
        f"mps-control {pipe} get_default_active_thread_percentage",
        f"mps-control {pipe} set_default_device_pinned_mem_limit {GPU0.uuid} 1024M",
        f"mps-control {pipe} set_default_device_pinned_mem_limit 1 2G",
        f"mps-control {pipe} get_default_device_pinned_mem_limit {GPU0.uuid}",
        f"mps-control {pipe} get_default_device_pinned_mem_limit {gpu1}",
        f"mps-control {pipe} get_server_list",
    ]
    before = mockstate.calls(root)
    # refused commands: an error reply, exit 1, the daemon still serving, nothing logged
    for command, error in [
        ("set_default_active_thread_percentage 101", "Invalid active thread percentage 101"),
        ("set_default_active_thread_percentage half", "Invalid active thread percentage half"),
        (f"set_default_device_pinned_mem_limit {PROF.gpus[2].uuid} 1G", f"Invalid device {PROF.gpus[2].uuid}"),
        ("set_default_device_pinned_mem_limit 2 1G", "Invalid device 2"),  # only two devices visible
        (f"set_default_device_pinned_mem_limit {GPU0.uuid} 1T", "Invalid memory limit 1T"),
        ("start_the_gpu", "Invalid command start_the_gpu"),
    ]:
        refused = mps(root, env, stdin=command + "\n")
        assert refused.returncode == 1 and refused.stdout.startswith(error), (command, refused)
    assert mockstate.calls(root) == before
    assert mps(root, env, stdin="quit\n").returncode == 0
    assert mockstate.wait_exited(pid, timeout=10)


def test_mps_quit_removes_the_endpoint_before_it_answers(root: Path, tmp_path: Path) -> None:
    env = mps_env(tmp_path)
    pid = start(root, env)
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert mockstate.mps_daemons(root)[0].serves == tuple(g.uuid for g in PROF.gpus)  # unset: every GPU
    done = mps(root, env, stdin="quit\n")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert list(pipe.iterdir()) == []
    assert not list((mockstate.state_dir(root) / "mps").iterdir())
    assert mockstate.wait_exited(pid, timeout=10)
    assert mockstate.mps_daemons(root) == []
    assert mockstate.calls(root) == [f"mps-control {pipe} -d all", f"mps-control {pipe} quit"]
    assert (Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log").read_text().endswith("] Exit\n")
    # the client with no daemon to answer
    gone = mps(root, env, stdin="get_server_list\n")
    assert (gone.returncode, gone.stderr) == (1, "Cannot find MPS control daemon process\n")


def test_mps_client_without_any_daemon(root: Path, tmp_path: Path) -> None:
    done = mps(root, mps_env(tmp_path, "never"), stdin="get_default_active_thread_percentage\n")
    assert (done.returncode, done.stderr) == (1, "Cannot find MPS control daemon process\n")


def test_one_daemon_per_pipe_directory_and_kill_leaves_nothing(root: Path, tmp_path: Path) -> None:
    first, second = mps_env(tmp_path, "a", devices="0"), mps_env(tmp_path, "b", devices="")
    pids = [start(root, first), start(root, second)]
    again = mps(root, first, "-d")
    assert (again.returncode, again.stderr) == (1, "An instance of this daemon is already running\n")
    serving = {d.pid: d.serves for d in mockstate.mps_daemons(root)}
    assert serving == {pids[0]: (GPU0.uuid,), pids[1]: ()}  # CUDA_VISIBLE_DEVICES="": no device
    # the test helper: every daemon of the root killed, waited for, its files gone
    assert mockstate.kill_mps_daemons(root) == sorted(pids)
    assert all(mockstate.wait_exited(pid, timeout=0) for pid in pids)
    for env in (first, second):
        assert list(Path(env["CUDA_MPS_PIPE_DIRECTORY"]).iterdir()) == []
    assert mockstate.mps_daemons(root) == []
    assert mockstate.kill_mps_daemons(root) == []
    # a pipe directory freed by a kill takes a new daemon
    pid = start(root, first)
    assert mps(root, first, stdin="quit\n").returncode == 0
    assert mockstate.wait_exited(pid, timeout=10)


def test_mps_daemon_in_the_foreground(root: Path, tmp_path: Path) -> None:
    env = mps_env(tmp_path, devices="1")
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    with subprocess.Popen([str(root / mockstate.MPS_CONTROL), "-f"], env={**clean, **env}, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        try:
            lines = []
            for line in proc.stderr:  # control.log's lines, also on stderr: wait for the startup line
                lines.append(line)
                if "Starting control daemon" in line:
                    break
            assert lines and "Starting control daemon" in lines[-1], lines
            assert mockstate.mps_daemons(root)[0].pid == proc.pid
            assert mps(root, env, stdin="set_default_active_thread_percentage 25\n").stdout == "25.0\n"
            assert mps(root, env, stdin="quit\n").returncode == 0
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert mockstate.calls(root) == [
        f"mps-control {pipe} -f 1", f"mps-control {pipe} set_default_active_thread_percentage 25",
        f"mps-control {pipe} quit",
    ]


def test_mps_binary_is_static_and_installed_with_the_inventory(root: Path) -> None:
    binary = root / mockstate.MPS_CONTROL
    data = binary.read_bytes()
    assert data[:4] == b"\x7fELF" and data.endswith(b"GPUDRAIN")
    interp = subprocess.run(["readelf", "-l", str(binary)], capture_output=True, text=True).stdout
    assert "INTERP" not in interp  # static: CDI may mount it where the host's libc is not


def test_a_mock_cuda_context_goes_through_mps_or_meets_the_compute_mode(root: Path, tmp_path: Path) -> None:
    """What a claim's MPS limits hold against: a process that uses the pipe directory gets the
    daemon's limits; one that ignores it gets a context of its own unless the GPU is
    EXCLUSIVE_PROCESS with an MPS server on it (or PROHIBITED)."""
    gpu1 = PROF.gpus[1].uuid
    bypass = mps_env(tmp_path, "nobody")  # a pipe directory no daemon answers on: CUDA goes without MPS
    Path(bypass["CUDA_MPS_PIPE_DIRECTORY"]).mkdir(parents=True)

    def context(env: dict[str, str], uuid: str = GPU0.uuid) -> tuple[int, str]:
        done = mps(root, env, "--mock-cuda-context", uuid)
        return done.returncode, done.stdout

    assert context(bypass) == (0, "direct unlimited\n")
    assert nvml(root, ("set", GPU0.uuid, 3)) == {f"set {GPU0.uuid} 3": None}
    assert context(bypass) == (0, "direct unlimited\n")  # EXCLUSIVE_PROCESS, but nobody holds the GPU
    env = mps_env(tmp_path, devices=f"{GPU0.uuid},{gpu1}")
    pid = start(root, env)
    assert mps(root, env, stdin=f"set_default_active_thread_percentage 40\n"
                                f"set_default_device_pinned_mem_limit {GPU0.uuid} 8G\n").returncode == 0
    assert context(bypass) == (2, "busy\n")  # the MPS server holds it
    assert context(env) == (0, "mps 40.0 8192M\n")
    assert context(bypass, gpu1) == (0, "direct unlimited\n")  # DEFAULT: any process opens a context
    assert nvml(root, ("set", gpu1, 2)) == {f"set {gpu1} 2": None}
    assert context(bypass, gpu1) == (2, "busy\n")  # PROHIBITED
    assert mps(root, env, stdin="quit\n").returncode == 0 and mockstate.wait_exited(pid, timeout=10)
    assert context(bypass) == (0, "direct unlimited\n")
