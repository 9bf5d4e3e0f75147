"""`pip install gpudra` as a user gets it: the wheels hack/wheels.sh builds (docs/deploy.md,
"Wheels").

Each platform wheel carries gpudra-allocator (Kubernetes' own DRA allocator and CEL) for exactly
that platform, one binary per supported release, executable, and says so in its tags: the ELF
e_machine or Mach-O cputype of every binary is the tag's architecture, the Linux binaries are
static (no program interpreter: the manylinux and musllinux tags hold whatever the libc), and the
macOS binaries need no newer macOS than the tag names. The pure wheel (the agent image's) and the
sdist carry none.

Then this machine's wheel goes into a fresh virtual environment, with no Go toolchain on PATH and
no source checkout in reach, and `kubectl-gpudra explain` answers for claims on the real control
plane; with the binaries gone (the pure wheel, what an sdist install gives), it says in one line
how to get them.

The first run cross-builds the other platforms' binaries (hack/allocator-bin.sh, a few minutes,
cached); later runs take about a minute, most of it `pip install` from the package index."""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename

from gpudra_driver.discovery import discover
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices
from gpudra_operator.deviceclasses import render_device_class
from gpudra_dev.localcluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
WHEELS_SH = REPO / "hack" / "wheels.sh"
RELEASES = sorted(p.name.removeprefix("v") for p in (REPO / "operator" / "gpudra-allocator").glob("v1.*"))
BINARIES = {f"gpudra_operator/bin/gpudra-allocator-{release}" for release in RELEASES}

# platform -> (the wheel's platform tags, the binaries' format and machine)
EM_X86_64, EM_AARCH64 = 62, 183  # ELF e_machine
CPU_TYPE_ARM64 = 0x0100000C  # Mach-O cputype: CPU_ARCH_ABI64 | CPU_TYPE_ARM
PLATFORMS = {
    "linux-amd64": ({"manylinux_2_17_x86_64", "manylinux2014_x86_64", "musllinux_1_1_x86_64"}, ("elf", EM_X86_64)),
    "linux-arm64": ({"manylinux_2_17_aarch64", "manylinux2014_aarch64", "musllinux_1_1_aarch64"}, ("elf", EM_AARCH64)),
    "darwin-arm64": ({"macosx_12_0_arm64"}, ("macho", CPU_TYPE_ARM64)),
}
HOST = {("Linux", "x86_64"): "linux-amd64", ("Linux", "aarch64"): "linux-arm64",
        ("Darwin", "arm64"): "darwin-arm64"}.get((platform.system(), platform.machine()))

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")

pytestmark = pytest.mark.timeout(900)  # a cold run cross-builds two platforms' binaries


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """{"linux-amd64": wheel, ..., "any": wheel, "sdist": tarball}, built once for the module."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([str(WHEELS_SH), "--out", str(out)], capture_output=True, text=True, timeout=850)
    if proc.returncode != 0:
        pytest.fail(f"hack/wheels.sh exited {proc.returncode}:\n{proc.stderr[-5000:]}", pytrace=False)
    assert proc.stdout.splitlines()[-1] == str(out)
    found: dict[str, Path] = {}
    for path in out.iterdir():
        if path.name.endswith(".tar.gz"):
            found["sdist"] = path
            continue
        tags = {tag.platform for tag in parse_wheel_filename(path.name)[3]}
        matches = [name for name, (expected, _) in PLATFORMS.items() if tags == expected]
        found[matches[0] if matches else "any" if tags == {"any"} else path.name] = path
    assert sorted(found) == sorted([*PLATFORMS, "any", "sdist"]), sorted(found)
    yield found


# --- what a binary is built for -------------------------------------------------------------------
def elf_machine(head: bytes) -> tuple[int, bool]:
    """(e_machine, has a PT_INTERP program header) of a 64-bit little-endian ELF file's start."""
    assert head[:4] == b"\x7fELF", head[:4]
    assert head[4] == 2 and head[5] == 1, "not a 64-bit little-endian ELF file"
    (machine,) = struct.unpack_from("<H", head, 18)
    phoff, = struct.unpack_from("<Q", head, 32)
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    interp = any(struct.unpack_from("<I", head, phoff + i * phentsize)[0] == 3 for i in range(phnum))  # PT_INTERP
    return machine, interp


def macho_machine(head: bytes) -> tuple[int, tuple[int, int]]:
    """(cputype, the minimum macOS (major, minor)) of a 64-bit Mach-O file's start."""
    magic, cputype, _, _, ncmds, _ = struct.unpack_from("<IIIIII", head, 0)
    assert magic == 0xFEEDFACF, hex(magic)
    offset, minos = 32, None
    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<II", head, offset)
        if cmd == 0x32:  # LC_BUILD_VERSION: platform, minos (xxxx.yy.zz)
            minos = struct.unpack_from("<I", head, offset + 12)[0]
        elif cmd == 0x24:  # LC_VERSION_MIN_MACOSX: version (xxxx.yy.zz)
            minos = struct.unpack_from("<I", head, offset + 8)[0]
        offset += size
    assert minos is not None, "no LC_BUILD_VERSION or LC_VERSION_MIN_MACOSX"
    return cputype, (minos >> 16, (minos >> 8) & 0xFF)


@pytest.mark.parametrize("name", sorted(PLATFORMS))
def test_a_platform_wheel_carries_that_platforms_allocator_and_says_so(dist: dict[str, Path], name: str) -> None:
    expected_tags, (fmt, machine) = PLATFORMS[name]
    wheel = dist[name]
    dist_name, _, _, tags = parse_wheel_filename(wheel.name)
    assert dist_name == "gpudra"
    assert tags == {Tag("py3", "none", p) for p in expected_tags}
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
        assert {line.removeprefix("Tag: ") for line in metadata.splitlines() if line.startswith("Tag: ")} == \
            {f"py3-none-{p}" for p in expected_tags}
        binaries = {info.filename: info for info in archive.infolist() if "/bin/" in info.filename}
        assert set(binaries) == BINARIES
        for path, info in binaries.items():
            assert (info.external_attr >> 16) & 0o111 == 0o111, f"{path} is not executable in {wheel.name}"
            with archive.open(info) as binary:
                head = binary.read(1 << 16)
            if fmt == "elf":
                assert elf_machine(head) == (machine, False), f"{path} in {wheel.name}: (e_machine, dynamic)"
            else:
                cputype, minimum = macho_machine(head)
                assert cputype == machine, f"{path} in {wheel.name}: cputype {cputype:#x}"
                (tag,) = expected_tags
                major, minor = (int(part) for part in tag.split("_")[1:3])
                assert minimum <= (major, minor), f"{path} needs macOS {minimum}, the tag says {tag}"


def test_the_pure_wheel_and_the_sdist_carry_no_binaries(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["any"]) as archive:
        names = archive.namelist()
    assert "gpudra_operator/explain_cmd.py" in names
    assert [n for n in names if "/bin/" in n] == []
    # Every product package, and never the development package (hack/python/gpudra_dev).
    packages = {n.split("/", 1)[0] for n in names if n.endswith("/__init__.py") and n.count("/") == 1}
    assert packages == {"gpudra", "gpudra_core", "gpudra_driver", "gpudra_operator"}, packages
    with tarfile.open(dist["sdist"]) as sdist:
        members = sdist.getnames()
    assert any(m.endswith("gpudra_operator/explain_cmd.py") for m in members)
    assert [m for m in members if "/bin/" in m or "gpudra-allocator" in m] == []


# --- a fresh machine: the wheel, no Go ----------------------------------------------------------------
def without_go(venv: Path) -> dict[str, str]:
    """The environment of a user's shell with the virtual environment active and no Go toolchain."""
    path = os.pathsep.join([str(venv / "bin"), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUDRA_", "GO", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=path, VIRTUAL_ENV=str(venv))  # HOME stays: pip's cache saves downloads
    assert shutil.which("go", path=path) is None, f"a Go toolchain is on {path}"
    return env


def explain(venv: Path, env: dict[str, str], kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "kubectl-gpudra"), "explain", *args, "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=venv.parent, check=False)


async def test_the_wheel_in_a_fresh_venv_without_go_explains_claims(
        dist: dict[str, Path], kube: Kube, cluster: ControlPlane, namespace: str, fake_nodes,
        tmp_path: Path) -> None:
    assert HOST is not None, (f"gpudra builds no wheel for {platform.system()} {platform.machine()} (only linux "
                              "x86_64 and aarch64, macOS arm64): run the suite on one of those")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = without_go(venv)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                              str(dist[HOST])], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-5000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import gpudra_operator; print(gpudra_operator.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path, check=True)
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's code, not the checkout's

    suffix = secrets.token_hex(3)
    driver, class_name = f"w{suffix}.gpudra.io", f"gpu-{suffix}.gpudra.io"
    node = (await fake_nodes("wheel"))["metadata"]["name"]
    slices = build_slices(driver, node, None, 1, discover(FakeNvml(load_profile("dgx-a100-40gb"))))
    device_class = render_device_class(class_name, driver, template="full-gpu")
    created: list[Obj] = []
    try:
        for obj in [*slices, device_class]:
            created.append(await kube.create(obj))
        for name, count, memory in [("big", 8, "64Gi"), ("small", 2, "40Gi")]:
            await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": name, "namespace": namespace},
                               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                                   "deviceClassName": class_name, "count": count, "selectors": [{"cel": {"expression":
                                       f'device.capacity["{driver}"].memory.compareTo(quantity("{memory}")) >= 0'}}]}}]}}})

        verdicts = {}
        for name in ("big", "small"):
            answer = explain(venv, env, cluster.kubeconfig, "claim", f"{namespace}/{name}", "--driver", driver, "-o", "json")
            assert answer.returncode == 0, answer.stderr
            verdicts[name] = json.loads(answer.stdout)["satisfiable"]
        assert verdicts == {"big": False, "small": True}
        text = explain(venv, env, cluster.kubeconfig, "claim", f"{namespace}/big", "--driver", driver)
        assert text.returncode == 0, text.stderr
        assert text.stdout.splitlines()[-1].startswith("no node can satisfy request gpu"), text.stdout

        # What an sdist install (or the pure wheel) gives: no binaries, and one line that says how.
        reinstall = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                                    "--no-deps", "--force-reinstall", str(dist["any"])],
                                   capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert reinstall.returncode == 0, reinstall.stderr[-5000:]
        missing = explain(venv, env, cluster.kubeconfig, "claim", f"{namespace}/big", "--driver", driver)
        assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr
        assert "gpudra-allocator" in missing.stderr and len(missing.stderr.splitlines()) == 1, missing.stderr
    finally:
        for obj in reversed(created):
            await kube.delete(resource_type(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"],
                              obj["metadata"].get("namespace"))
