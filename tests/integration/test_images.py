"""The operator and agent images (images/*.Dockerfile), run with podman + runc.

`make test` builds them first (hack/images.sh, cached by the hash of their inputs) and passes their
names in $GPUDRA_TEST_OPERATOR_IMAGE / $GPUDRA_TEST_AGENT_IMAGE; run alone, this module builds them
with the same script. Without podman or runc the tests fail with the command that installs them.
podman runs with hack/podman/containers.conf (runc, cgroupfs, rlimits these VMs allow), every
container with --rm and no network; nothing is left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudra_dev.localcluster.agents import daemonset_process_env
from gpudra_dev.localcluster.fakedriverroot import make_driver_root

REPO = Path(__file__).resolve().parents[2]
IMAGES_SH = REPO / "hack" / "images.sh"
FIX = "hack/debian-packages.sh"
OPERATOR_ENV, AGENT_ENV = "GPUDRA_TEST_OPERATOR_IMAGE", "GPUDRA_TEST_AGENT_IMAGE"
STANDIN = "localhost/gpudra-python-base"
PROFILE = "dgx-h100"

# A cold build (stand-in base from debootstrap, then both images) takes a few minutes on 2 cores;
# it happens in the first test's setup.
pytestmark = pytest.mark.timeout(1200)


def podman_env() -> dict[str, str]:
    return dict(os.environ, CONTAINERS_CONF=str(REPO / "hack" / "podman" / "containers.conf"))


def podman(*args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
                    pytrace=False)
    return proc


def labels(image: str) -> dict[str, str]:
    out = podman("image", "inspect", "--format", "{{json .Config.Labels}}", image).stdout
    return json.loads(out) or {}


@pytest.fixture(scope="module")
def images() -> Iterator[dict[str, str]]:
    """{"operator": ref, "agent": ref}: from the Makefile's env, else built here (cached)."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed: run `{FIX}` (as root; installs podman, runc, "
                    "debootstrap), then `make images`", pytrace=False)
    operator, agent = os.environ.get(OPERATOR_ENV), os.environ.get(AGENT_ENV)
    if not (operator and agent):
        proc = subprocess.run([str(IMAGES_SH), "operator", "agent"], capture_output=True, text=True, timeout=1100)
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.fail(f"hack/images.sh exited {proc.returncode}:\n{proc.stderr[-5000:]}", pytrace=False)
        operator, agent = proc.stdout.strip().splitlines()[-1].split()
    refs = {"operator": operator, "agent": agent}
    for name, ref in refs.items():
        if podman("image", "exists", ref, check=False).returncode != 0:
            pytest.fail(f"the {name} image {ref} does not exist: run `make images`", pytrace=False)
    yield refs
    for ref in refs.values():  # --rm everywhere: nothing may be left behind
        left = podman("ps", "--all", "--quiet", "--filter", f"ancestor={ref}").stdout.split()
        assert left == [], f"containers left from {ref}: {left}"


def test_the_operator_image_runs_as_65532_on_a_read_only_root(images: dict[str, str]) -> None:
    ref = images["operator"]
    assert podman("image", "inspect", "--format", "{{.Config.User}}", ref).stdout.strip() == "65532:65532"
    proc = podman("run", "--rm", "--network=none", "--user", "65532", "--read-only", ref, "operator", "--help")
    assert proc.stdout.startswith("usage: gpudra operator"), proc.stdout


def test_the_agent_image_discovers_gpus_through_the_mock_nvml_in_a_mounted_driver_root(
        images: dict[str, str], tmp_path: Path) -> None:
    # The mock NVML is built on this host (bookworm's glibc), and the image is bookworm-based too.
    root = make_driver_root(tmp_path / "root", PROFILE)
    in_image = podman("run", "--rm", "--network=none", "--volume", f"{root}:/driver-root:ro", images["agent"],
                      "discover", "--nvml", "real", "--driver-root", "/driver-root", "-o", "json",
                      "--node-name", "image-test")
    gpudra = Path(sys.executable).with_name("gpudra")
    on_host = subprocess.run([str(gpudra), "discover", "--nvml", f"fake:{PROFILE}", "-o", "json",
                              "--node-name", "image-test"], capture_output=True, text=True, timeout=60, check=True)
    seen, expected = json.loads(in_image.stdout), json.loads(on_host.stdout)

    def summary(out: dict[str, Any]) -> list[tuple[str, str]]:
        return [(d["name"], d["attributes"]["uuid"]["string"]) for d in out["devices"]]

    assert len(expected["devices"]) == 8
    assert summary(seen) == summary(expected)
    assert seen["warnings"] == []


def test_the_operator_image_runs_its_platforms_allocator_and_the_agent_image_has_none(images: dict[str, str]) -> None:
    # The operator image installs the wheel of its platform, with gpudra-allocator for each
    # supported release (hack/wheels.sh, images/operator.Dockerfile); the agent image the pure one.
    releases = sorted(p.name.removeprefix("v") for p in (REPO / "operator" / "gpudra-allocator").glob("v1.*"))
    check = r"""
import subprocess
from gpudra_operator import allocatorhelper
where = allocatorhelper.directory()
for minor in allocatorhelper.available_minors():
    path = where / f"{allocatorhelper.PREFIX}{minor}"
    print(path.name, subprocess.run([str(path), "-version"], capture_output=True, text=True, check=True).stdout.strip())
"""
    out = podman("run", "--rm", "--network=none", "--user", "65532", "--read-only", "--entrypoint", "python3",
                 images["operator"], "-c", check).stdout.splitlines()
    assert [line.split()[0] for line in out] == [f"gpudra-allocator-{r}" for r in releases], out
    assert all(line.split()[1].startswith(f"{line.split()[0].removeprefix('gpudra-allocator-')}.") for line in out), out
    find = "import os; print([os.path.join(t, f) for t, _, fs in os.walk('/usr') for f in fs if 'gpudra-allocator' in f])"
    out = podman("run", "--rm", "--network=none", "--entrypoint", "python3", images["agent"], "-c", find).stdout
    assert out.strip() == "[]", f"the agent image carries {out}"


def test_each_image_carries_its_component_alone_and_no_development_tooling(images: dict[str, str]) -> None:
    # gpudra.component narrows each image to the CLI, the shared core and one component, with that
    # component's requirements only; the development package (gpudra_dev) is in no wheel at all.
    importable = r"""
import importlib.util, sys
def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
print(" ".join(m for m in sys.argv[1:] if found(m)))
"""
    expected = {
        "agent": ("gpudra gpudra_core gpudra_driver pynvml grpc uvloop",
                  "gpudra_operator gpudra_dev kopf jinja2 jsonschema aiolimiter"),
        "operator": ("gpudra gpudra_core gpudra_operator kopf jinja2 jsonschema",
                     "gpudra_driver gpudra_dev pynvml grpc grpc_health uvloop google.protobuf"),
    }
    for name, (present, absent) in expected.items():
        out = podman("run", "--rm", "--network=none", "--entrypoint", "python3", images[name], "-c", importable,
                     *present.split(), *absent.split()).stdout.split()
        assert out == present.split(), f"{name} image: importable {out}, expected exactly {present.split()}"
    # The other component's subcommands say where they are, instead of a traceback.
    for name, other in (("agent", "operator"), ("operator", "agent")):
        proc = podman("run", "--rm", "--network=none", images[name], other, check=False)
        assert proc.returncode == 2 and "is not installed here" in proc.stderr, (name, proc.stdout, proc.stderr)
    assert "usage: gpudra explain" in podman("run", "--rm", "--network=none", images["operator"], "explain",
                                             "--help").stdout


def test_the_agent_image_has_bytecode_for_the_optimization_level_the_daemonset_runs_it_at(
        images: dict[str, str]) -> None:
    # The DaemonSet sets PYTHONOPTIMIZE=2 (render.AGENT_PROCESS_ENV, which daemonset_process_env gives): every module the agent and the
    # MPS supervisor may import (all of gpudra's, and through them their dependencies and the
    # standard library) must load from an .opt-2.pyc of the (read-only) image, or each start
    # compiles it from source. Counted where the import system compiles: a missing or stale file.
    check = r"""
import importlib, importlib.machinery, pkgutil, sys
compiled = []
source_to_code = importlib.machinery.SourceFileLoader.source_to_code
def counting(self, data, path, *args, **kwargs):
    compiled.append(path)
    return source_to_code(self, data, path, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = counting
import gpudra, gpudra_core, gpudra_driver
for package in (gpudra, gpudra_core, gpudra_driver):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith(".__main__"):  # importing it runs the CLI
            importlib.import_module(module.name)
import uvloop  # the opt-in loop
loaded = [m for m in list(sys.modules.values()) if (getattr(getattr(m, "__spec__", None), "origin", None) or "").endswith(".py")]
print(sys.flags.optimize, len(loaded))
print("\n".join(compiled))
"""
    out = podman("run", "--rm", "--network=none", "--read-only",
                 *(f"--env={k}={v}" for k, v in daemonset_process_env().items()),
                 "--entrypoint", "python3", images["agent"], "-c", check).stdout.splitlines()
    optimize, loaded = map(int, out[0].split())
    assert optimize == 2 and loaded > 1000, out[0]  # kubernetes-asyncio alone is some 700 modules
    assert [line for line in out[1:] if line] == [], f"compiled from source at every start: {out[1:]}"


def test_the_images_carry_no_build_tools_wheels_or_pip(images: dict[str, str]) -> None:
    # Python's own ensurepip wheels (the official python image has them) are part of the stdlib.
    check = r"""
import importlib.util, os, shutil
bad = [m for m in ("pip", "setuptools", "wheel") if importlib.util.find_spec(m)]
bad += [t for t in ("gcc", "cc", "c++", "make", "ld") if shutil.which(t)]
bad += [p for p in ("/wheels", "/src", "/root/.cache") if os.path.exists(p)]
for top, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev")]
    bad += [os.path.join(top, f) for f in files if f.endswith(".whl") and "/ensurepip/" not in top]
    bad += [os.path.join(top, d) for d in dirs if d == "pip" and top.endswith(".cache")]
print("\n".join(bad))
"""
    for name, ref in images.items():
        out = podman("run", "--rm", "--network=none", "--entrypoint", "python3", ref, "-c", check).stdout
        assert out.split() == [], f"{name} image {ref} carries: {out}"


def test_a_second_build_is_a_cache_hit(images: dict[str, str]) -> None:
    registry, _, tag = images["operator"].rpartition("/gpudra-operator:")
    env = dict(os.environ, IMAGE_REGISTRY=registry, IMAGE_TAG=tag)

    def build() -> tuple[subprocess.CompletedProcess[str], float]:
        start = time.monotonic()
        proc = subprocess.run([str(IMAGES_SH), "operator", "agent"], capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [images["operator"], images["agent"]]
        return proc, time.monotonic() - start

    build()  # brings them up to date if a source changed since the fixture's build
    warm, seconds = build()
    assert warm.stderr.count("is up to date") == 2, warm.stderr
    assert seconds < 20, f"a warm hack/images.sh took {seconds:.1f} s"
    for ref in images.values():
        assert len(labels(ref)["io.gpudra.inputs"]) == 16


def test_the_stand_in_base_offers_python3_and_pip_like_python_slim(images: dict[str, str]) -> None:
    """Whatever base the app images were built on, the stand-in `make base-image` builds is held
    to python:*-slim's interface (built here, cached, when the app images used the official one)."""
    built = subprocess.run([str(IMAGES_SH), "base"], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    base = built.stdout.split()[-1]
    assert base.startswith(STANDIN), base
    script = ('set -e; command -v python3; command -v pip; '
              'python3 -c "import sys; print(sys.prefix)"; '
              '/usr/bin/python3 -c "import sys; print(sys.prefix)"; '
              'pip --version')
    out = podman("run", "--rm", "--network=none", "--entrypoint", "sh", base, "-c", script).stdout.split("\n")
    assert out[:4] == ["/usr/local/bin/python3", "/usr/local/bin/pip", "/usr/local", "/usr"], out
    assert "/usr/local/lib/python3" in out[4], out
