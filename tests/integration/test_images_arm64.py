"""The arm64 agent image, run with podman under qemu's user-mode emulation on an x86_64 machine
(binfmt_misc; hack/emulation.sh), and the manifest list that joins an image's two architectures
(make images-multiarch / make images-push: hack/image-manifests.sh), pushed to a real registry.

The image comes from hack/images.sh (PLATFORM=linux/arm64; cached by the hash of its inputs, so
only a changed tree rebuilds it); a cold build, with the arm64 stand-in base, takes minutes.
Without podman, runc, qemu-user-static or the arm64 cross compiler the tests fail with the command
that installs them (hack/debian-packages.sh)."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from installnode import forget_images, podman
from localregistry import LocalRegistry

from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.pki import LocalPKI

REPO = Path(__file__).resolve().parents[2]
IMAGES_SH = REPO / "hack" / "images.sh"
MANIFESTS_SH = REPO / "hack" / "image-manifests.sh"
MOCK_NVML_ARM64 = REPO / "build" / "mock-nvml-arm64" / "libnvidia-ml.so"
FIX = "hack/debian-packages.sh"
AGENT_ENV = "GPUDRA_TEST_AGENT_IMAGE"  # make test names this machine's agent image
PROFILE = "dgx-h100"
EM_AARCH64 = 183  # ELF e_machine
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
OCI_INDEX, OCI_MANIFEST = "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json"

# Cold: the arm64 stand-in base (debootstrap and apt under emulation) and the agent image.
pytestmark = pytest.mark.timeout(2400)


def registry_and_tag() -> tuple[str, str]:
    """The registry and tag make test built this machine's images with, else hack/images.sh's defaults."""
    if image := os.environ.get(AGENT_ENV):
        registry, _, tag = image.rpartition("/gpudra:")
        return registry, tag
    return "ghcr.io/gpudra", subprocess.run(["sed", "-n", 's/^version = "\\(.*\\)"/\\1/p', str(REPO / "pyproject.toml")],
                                            capture_output=True, text=True, check=True).stdout.strip()


def run_script(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=2200, env={**os.environ, **env})
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"{script.relative_to(REPO)} {' '.join(args)} exited {proc.returncode} (missing podman, runc, "
                    f"debootstrap or qemu-user-static: {FIX}, as root):\n{proc.stderr[-5000:]}", pytrace=False)
    return proc


def checked(*args: str, timeout: float = 300) -> str:
    proc = podman(*args, timeout=timeout)
    assert proc.returncode == 0, f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def inspect(image: str, field: str) -> str:
    return checked("image", "inspect", "--format", f"{{{{{field}}}}}", image).strip()


@pytest.fixture(scope="module")
def arm64_agent() -> str:
    """The arm64 agent image, tagged <tag>-arm64 on another architecture (built or found cached)."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed: run `{FIX}` (as root)", pytrace=False)
    registry, tag = registry_and_tag()
    built = run_script(IMAGES_SH, "agent", env={"PLATFORM": "linux/arm64", "IMAGE_REGISTRY": registry, "IMAGE_TAG": tag})
    (ref,) = built.stdout.strip().splitlines()[-1].split()
    return ref


def discover_on_host() -> dict[str, Any]:
    gpudra = Path(sys.executable).with_name("gpudra")
    out = subprocess.run([str(gpudra), "discover", "--nvml", f"fake:{PROFILE}", "-o", "json", "--node-name", "image-test"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_the_arm64_agent_image_is_arm64_and_its_programs_run_as_aarch64(arm64_agent: str) -> None:
    assert (inspect(arm64_agent, ".Os"), inspect(arm64_agent, ".Architecture")) == ("linux", "arm64")
    if HOST_ARCH != "arm64":
        assert arm64_agent.endswith("-arm64"), f"another architecture's image must not take this machine's tag: {arm64_agent}"
    out = checked("run", "--rm", "--network=none", "--entrypoint", "sh", arm64_agent, "-c",
                  "uname -m; python3 -c 'import platform, sysconfig; print(platform.machine(), "
                  "sysconfig.get_config_var(\"MULTIARCH\"))'")
    assert out.split() == ["aarch64", "aarch64", "aarch64-linux-gnu"], out
    # The entry point's interpreter is an arm64 ELF (not an amd64 one that happens to work).
    header = checked("run", "--rm", "--network=none", "--entrypoint", "python3", arm64_agent, "-c",
                     "import os, sys; print(open(os.path.realpath(sys.executable), 'rb').read(20).hex())")
    assert int.from_bytes(bytes.fromhex(header.strip())[18:20], "little") == EM_AARCH64, header


def summary(out: dict[str, Any]) -> list[tuple[str, str]]:
    return [(d["name"], d["attributes"]["uuid"]["string"]) for d in out["devices"]]


def test_the_arm64_agent_image_discovers_a_fake_dgx_h100(arm64_agent: str) -> None:
    in_image = json.loads(checked("run", "--rm", "--network=none", arm64_agent, "discover", "--nvml", f"fake:{PROFILE}",
                                  "-o", "json", "--node-name", "image-test"))
    expected = discover_on_host()
    assert len(expected["devices"]) == 8
    assert in_image == expected


def test_the_arm64_agent_image_discovers_gpus_through_an_arm64_mock_nvml_in_a_mounted_driver_root(
        arm64_agent: str, tmp_path: Path) -> None:
    # pynvml in the image loads the arm64 mock libnvidia-ml.so.1 (cross-compiled against bookworm's
    # glibc, as the image is bookworm-based) from the driver root, as the real driver's would be.
    made = subprocess.run(["make", "-s", "mock-nvml-arm64"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, f"make mock-nvml-arm64 (cross compiler: {FIX}):\n{made.stdout}{made.stderr}"
    header = MOCK_NVML_ARM64.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64
    root = make_driver_root(tmp_path / "root", PROFILE, library=MOCK_NVML_ARM64)
    seen = json.loads(checked("run", "--rm", "--network=none", "--volume", f"{root}:/driver-root:ro", arm64_agent,
                              "discover", "--nvml", "real", "--driver-root", "/driver-root", "-o", "json",
                              "--node-name", "image-test"))
    expected = discover_on_host()
    assert len(expected["devices"]) == 8
    assert summary(seen) == summary(expected)
    assert seen["warnings"] == []


def registry_get(registry: LocalRegistry, path: str, accept: str) -> tuple[str, bytes]:
    request = urllib.request.Request(f"https://{registry.host}/v2/{path}", headers={"Accept": accept})
    context = ssl.create_default_context(cafile=str(registry.ca))
    with urllib.request.urlopen(request, context=context, timeout=30) as answer:
        return answer.headers.get("Content-Type", ""), answer.read()


def archive_architecture(archive: Path) -> str:
    """The architecture of the one image in an OCI archive (what podman save wrote)."""
    with tarfile.open(archive) as tar:
        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return json.load(member)
        index_file = tar.extractfile("index.json")
        assert index_file is not None
        (manifest,) = json.load(index_file)["manifests"]
        return str(blob(blob(manifest["digest"])["config"]["digest"])["architecture"])


@pytest.fixture
def local_registry(tmp_path: Path) -> Iterator[LocalRegistry]:
    registry = LocalRegistry(tmp_path / "registry", LocalPKI(tmp_path / "pki")).start()
    yield registry
    registry.stop()


def test_the_manifest_list_joins_both_architectures_and_pushes_with_them_to_a_registry(
        arm64_agent: str, local_registry: LocalRegistry, tmp_path: Path) -> None:
    _, tag = registry_and_tag()
    repository = f"{local_registry.host}/gpudra/gpudra"
    listed = f"{repository}:{tag}"
    per_arch = [f"{listed}-amd64", f"{listed}-arm64"]
    env = {"IMAGE_REGISTRY": f"{local_registry.host}/gpudra", "IMAGE_TAG": tag, **local_registry.client_env()}
    try:
        pushed = run_script(MANIFESTS_SH, "--push", "agent", env=env)
        assert pushed.stdout.strip().splitlines()[-1] == listed

        # Locally: a list of the two images, each also named <tag>-<arch>.
        local = json.loads(checked("manifest", "inspect", listed))
        platforms = {(m["platform"]["os"], m["platform"]["architecture"]): m["digest"] for m in local["manifests"]}
        assert sorted(platforms) == [("linux", "amd64"), ("linux", "arm64")], local
        for ref in per_arch:
            assert platforms[("linux", inspect(ref, ".Architecture"))] == inspect(ref, ".Digest")
        assert inspect(f"{listed}-arm64", ".Id") == inspect(arm64_agent, ".Id")

        # What uses the plain name (tests, podman save for containerd) gets this machine's image.
        assert inspect(listed, ".Architecture") == HOST_ARCH
        assert inspect(listed, ".Id") == inspect(f"{listed}-{HOST_ARCH}", ".Id")
        assert checked("run", "--rm", "--network=none", "--entrypoint", "uname", listed, "-m").strip() == os.uname().machine
        checked("save", "--format", "oci-archive", "-o", str(tmp_path / "saved.tar"), listed)
        assert archive_architecture(tmp_path / "saved.tar") == HOST_ARCH

        # In the registry: an OCI index of both, each manifest's config of its architecture.
        media_type, body = registry_get(local_registry, f"gpudra/gpudra/manifests/{tag}", OCI_INDEX)
        index = json.loads(body)
        assert media_type == OCI_INDEX and index["mediaType"] == OCI_INDEX, (media_type, index)
        remote = {(m["platform"]["os"], m["platform"]["architecture"]): m for m in index["manifests"]}
        assert sorted(remote) == [("linux", "amd64"), ("linux", "arm64")], index
        for (_, arch), entry in remote.items():
            assert entry["mediaType"] == OCI_MANIFEST, entry
            _, manifest = registry_get(local_registry, f"gpudra/gpudra/manifests/{entry['digest']}", OCI_MANIFEST)
            _, config = registry_get(local_registry, f"gpudra/gpudra/blobs/{json.loads(manifest)['config']['digest']}",
                                     "application/octet-stream")
            config_json = json.loads(config)
            assert (config_json["os"], config_json["architecture"]) == ("linux", arch)
            assert config_json["config"]["Labels"]["io.gpudra.image"] == "agent"

        # Again: both builds are cache hits, the list is made afresh.
        start = time.monotonic()
        again = run_script(MANIFESTS_SH, "agent", env=env)
        seconds = time.monotonic() - start
        assert again.stderr.count("is up to date") == 2, again.stderr
        assert seconds < 30, f"a warm hack/image-manifests.sh took {seconds:.1f} s"
        assert json.loads(checked("manifest", "inspect", listed))["manifests"] == local["manifests"]
    finally:
        if podman("manifest", "exists", listed).returncode == 0:
            podman("manifest", "rm", listed)
        forget_images([*per_arch, listed])
