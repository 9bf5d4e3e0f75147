"""The release pipeline as code (.github/workflows, docs/releasing.md): actionlint passes, every
step is `make <target>` for a target of the Makefile (so it runs the same here) or an action pinned
by commit, the release publishes the files the targets write, and `make sbom` writes a valid
CycloneDX document of gpudra and its dependencies, `make sbom-images` one of each image (its
Debian, Python and Go packages). Needs actionlint and syft (make actionlint, make syft build them;
make test passes GPUDRA_ACTIONLINT_DIR and GPUDRA_SYFT_DIR), podman and the images (make images;
make test builds them first) and PyPI for the SBOM's first resolution."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachedtool import tool_dir
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
PINNED_ACTION = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(/[A-Za-z0-9_./-]+)?@[0-9a-f]{40}$")
MAKE_STEP = re.compile(r"^make( [a-z][a-z0-9-]*)+$")
SYFT_FIX = ("make syft (builds Anchore's syft from the Go module proxy into ~/.cache/gpudra/syft/<version>; "
            "then set GPUDRA_SYFT_DIR to the directory it prints, as make test does)")
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
FIX = ("make actionlint (builds rhysd/actionlint from the Go module proxy into ~/.cache/gpudra/actionlint/<version>; "
       "then set GPUDRA_ACTIONLINT_DIR to the directory it prints, as make test does)")
Obj = dict[str, Any]


def workflows() -> dict[str, Obj]:
    found = {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}
    assert {"ci.yml", "release.yml"} <= found.keys(), sorted(found)
    return found


def steps(workflow: Obj) -> list[Obj]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def make(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def actionlint() -> Path:
    directory, where = tool_dir("GPUDRA_ACTIONLINT_DIR", "actionlint-bin.sh", "ACTIONLINT_VERSION", "actionlint")
    if not os.access(directory / "actionlint", os.X_OK):
        raise AssertionError(f"{where} has no actionlint binary: {FIX}")
    return directory / "actionlint"


def test_actionlint_passes_the_workflows_and_fails_a_broken_one(tmp_path: Path) -> None:
    files = [str(p) for p in sorted(WORKFLOWS.glob("*.yml"))]
    result = subprocess.run([str(actionlint()), "-no-color", "-shellcheck=", "-pyflakes=", *files],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert make("actionlint").returncode == 0  # the target CI and developers run
    # It does read them: an unknown expression context and a job that needs a missing one are errors.
    broken = (WORKFLOWS / "release.yml").read_text().replace("needs: ci", "needs: tests").replace(
        "github.actor", "github.actorr")
    (tmp_path / "release.yml").write_text(broken)
    result = subprocess.run([str(actionlint()), "-no-color", "-shellcheck=", "-pyflakes=", str(tmp_path / "release.yml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and '"tests"' in result.stdout and "actorr" in result.stdout, result.stdout


def test_every_step_is_a_make_target_or_a_pinned_action() -> None:
    """No inline script: each run step is one `make <target> ...` whose targets the Makefile has
    (make -n knows them), each action is pinned by a full commit SHA."""
    targets: set[str] = set()
    for name, workflow in workflows().items():
        for step in steps(workflow):
            assert ("run" in step) != ("uses" in step), f"{name}: {step}"
            if "uses" in step:
                assert PINNED_ACTION.match(step["uses"]), f"{name}: {step['uses']} is not pinned by a commit SHA"
            else:
                assert MAKE_STEP.match(step["run"].strip()), f"{name}: run: {step['run']!r} is not `make <target>...`"
                targets.update(shlex.split(step["run"])[1:])
    assert {"ci", "release-check", "chart-package", "chart-push", "sbom", "sbom-images", "images-multiarch",
            "images-push"} <= targets
    for target in sorted(targets):
        dry = make("-n", target, "CHART_REGISTRY=oci://registry.invalid/charts", timeout=120)
        assert dry.returncode == 0, f"make -n {target}: {dry.stderr}"


def test_the_release_runs_after_ci_and_publishes_what_the_targets_write() -> None:
    release = workflows()["release.yml"]
    triggers = {str(k): v for k, v in release.items()}["True"]  # YAML 1.1 reads the key `on` as true
    assert triggers == {"push": {"tags": ["v*"]}}
    assert release["permissions"] == {"contents": "read"}  # write only where publishing needs it
    ci_steps = [s.get("run") for s in steps({"jobs": {"ci": release["jobs"]["ci"]}})]
    assert "make ci" in ci_steps and ci_steps.index("make release-check") < ci_steps.index("make ci")
    publish = release["jobs"]["publish"]
    assert publish["needs"] == "ci" and publish["permissions"] == {"contents": "write", "packages": "write"}
    runs = [s["run"] for s in publish["steps"] if "run" in s]
    assert runs == ["make release-check", "make debian-packages", "make images-multiarch", "make images-push",
                    "make chart-package chart-push", "make sbom", "make sbom-images"]
    assert release_files() == {"dist/gpudra-*.cdx.json", "build/chart/gpudra-*.tgz"}
    # The chart's glob matches what make chart-package writes (make sbom's: the SBOM test).
    packaged = make("chart-package")
    assert packaged.returncode == 0, packaged.stderr
    assert fnmatch.fnmatch(packaged.stdout.splitlines()[-1], "build/chart/gpudra-*.tgz"), packaged.stdout
    assert release["env"]["CHART_REGISTRY"].startswith("oci://")
    assert release["env"]["IMAGE_REGISTRY"] == "ghcr.io/gpudra"  # the images values.yaml names
    values = yaml.safe_load((REPO / "manifests" / "helm" / "gpudra" / "values.yaml").read_text())
    assert {values["operator"]["image"]["repository"], values["agent"]["image"]["repository"]} == \
        {"ghcr.io/gpudra/gpudra-operator", "ghcr.io/gpudra/gpudra"}


def release_files() -> set[str]:
    """The globs of the files the release workflow attaches to the GitHub release."""
    publish = workflows()["release.yml"]["jobs"]["publish"]
    (upload,) = [s for s in publish["steps"] if s.get("uses", "").startswith("softprops/action-gh-release@")]
    assert upload["with"]["fail_on_unmatched_files"] is True
    return set(upload["with"]["files"].split())


def test_release_check_refuses_a_tag_that_is_not_the_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert make("release-check", f"RELEASE_TAG=v{version}").returncode == 0
    wrong = make("release-check", "RELEASE_TAG=v99.0.0")
    assert wrong.returncode != 0 and f"the tag 'v99.0.0' is not v{version}" in wrong.stderr


def test_make_sbom_writes_a_valid_cyclonedx_document() -> None:
    result = make("sbom")  # where the release takes it from
    assert result.returncode == 0, result.stdout + result.stderr
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    printed = result.stdout.splitlines()[-1]
    assert printed == f"dist/gpudra-{project['version']}.cdx.json"
    assert any(fnmatch.fnmatch(printed, glob) for glob in release_files())
    path = REPO / printed
    text = path.read_text()
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    assert error is None, error
    bom = json.loads(text)
    assert (bom["bomFormat"], bom["specVersion"]) == ("CycloneDX", "1.6")
    root = bom["metadata"]["component"]
    assert (root["name"], root["version"]) == ("gpudra", project["version"])
    assert root["licenses"][0]["license"]["id"] == project["license"]
    components = {normal(c["name"]): c for c in bom["components"]}
    direct = requirement_names(project["dependencies"])
    assert direct <= components.keys(), direct - components.keys()
    for name, component in components.items():
        assert component["purl"] == f"pkg:pypi/{name}@{component['version']}", component["purl"]
    # Only what gpudra needs: none of the development tools, not pip.
    assert not {"pytest", "mypy", "pip", "cyclonedx-bom"} & components.keys()


def normal(name: str) -> str:
    """A Python package's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {normal(re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0]) for r in requirements}


def podman_image_id(ref: str) -> str:
    env = {**os.environ, "CONTAINERS_CONF": str(REPO / "hack" / "podman" / "containers.conf")}
    proc = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, f"podman image inspect {ref}: {proc.stderr} (make images builds it)"
    return proc.stdout.strip()


# A cold run builds the images first (hack/images.sh, as make images); make test has built them.
@pytest.mark.timeout(1500)
def test_make_sbom_images_lists_the_debian_python_and_go_packages_of_each_image() -> None:
    syft, where = tool_dir("GPUDRA_SYFT_DIR", "syft-bin.sh", "SYFT_VERSION", "syft")
    if not os.access(syft / "syft", os.X_OK):
        raise AssertionError(f"{where} has no syft binary: {SYFT_FIX}")
    if shutil.which("podman") is None:
        raise AssertionError("no podman to read the images from: hack/debian-packages.sh (as root), then make images")
    wrong = make("sbom-images", "SBOM_IMAGES=agent nonsense", f"PLATFORMS=linux/{HOST_ARCH}")
    assert wrong.returncode != 0 and "unknown image nonsense (operator or agent)" in wrong.stderr, wrong.stderr
    start = time.monotonic()
    result = make("sbom-images", "SBOM_IMAGES=agent operator", f"PLATFORMS=linux/{HOST_ARCH}",
                  env={"GPUDRA_SYFT_DIR": str(syft)}, timeout=1400)
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    print(f"make sbom-images (agent and operator, {HOST_ARCH}): {time.monotonic() - start:.1f} s")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    version = project["version"]
    agent_path, operator_path = result.stdout.splitlines()[-1].split()
    assert agent_path == f"dist/gpudra-image-{version}-{HOST_ARCH}.cdx.json"
    assert operator_path == f"dist/gpudra-operator-image-{version}-{HOST_ARCH}.cdx.json"
    assert all(any(fnmatch.fnmatch(p, glob) for glob in release_files()) for p in (agent_path, operator_path))
    # The images make test runs (the same, cached by content), else the ones hack/images.sh just found.
    images = {"gpudra": os.environ.get("GPUDRA_TEST_AGENT_IMAGE") or f"ghcr.io/gpudra/gpudra:{version}",
              "gpudra-operator": os.environ.get("GPUDRA_TEST_OPERATOR_IMAGE") or f"ghcr.io/gpudra/gpudra-operator:{version}"}

    boms: dict[str, Obj] = {}
    for name, path in (("gpudra", agent_path), ("gpudra-operator", operator_path)):
        text = (REPO / path).read_text()
        error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
        assert error is None, f"{path}: {error}"
        bom = boms[name] = json.loads(text)
        assert (bom["bomFormat"], bom["specVersion"]) == ("CycloneDX", "1.6")
        subject = bom["metadata"]["component"]
        assert (subject["type"], subject["name"]) == ("container", f"ghcr.io/gpudra/{name}"), subject
        # The image ID (its config's digest, as the registry keeps it) of the image make test runs.
        assert subject["version"] == f"sha256:{podman_image_id(images[name])}", (subject, images[name])
        assert {c["type"] for c in bom["components"]} <= {"library", "operating-system", "application"}, \
            "packages only, not every file they own"
        tools = bom["metadata"]["tools"]["components"]
        assert any(t["name"] == "syft" for t in tools), tools

    def packages(bom: Obj, kind: str) -> dict[str, PackageURL]:
        """[namespace/]name -> purl of the components of one purl type (deb, pypi, golang), each
        purl's version the component's."""
        found: dict[str, PackageURL] = {}
        for component in bom["components"]:
            if "purl" in component and (purl := PackageURL.from_string(component["purl"])).type == kind:
                assert purl.version == component["version"], component
                found[f"{purl.namespace}/{purl.name}" if purl.namespace else purl.name] = purl
        return found

    extras = project["optional-dependencies"]
    for name, component in (("gpudra", "agent"), ("gpudra-operator", "operator")):
        bom = boms[name]
        debs = packages(bom, "deb")  # Debian's, from dpkg's database: debian/<name>
        assert {"debian/libc6", "debian/base-files", "debian/ca-certificates"} <= debs.keys(), sorted(debs)
        assert debs["debian/libc6"].qualifiers["arch"] == HOST_ARCH, debs["debian/libc6"]
        pypi = {normal(n): purl for n, purl in packages(bom, "pypi").items()}
        assert pypi["gpudra"].to_string() == f"pkg:pypi/gpudra@{version}"
        # What the image installed (the component's extra), and not the other image's.
        wanted = requirement_names(extras[f"{component}-image"])
        assert wanted <= pypi.keys(), (name, wanted - pypi.keys())
        other = requirement_names(extras[f"{'operator' if component == 'agent' else 'agent'}-image"]) - wanted
        assert not other & pypi.keys(), (name, other & pypi.keys())
    assert {"kubernetes-asyncio", "grpcio", "nvidia-ml-py"} <= {normal(n) for n in packages(boms["gpudra"], "pypi")}
    # The operator image's gpudra-allocator binaries, one per supported release: their Go modules
    # from the build information embedded in them, Kubernetes' DRA allocator at each release's version
    # (several versions of one module: not packages()' one per name).
    go = {f"{p.namespace}/{p.name}@{p.version}" for c in boms["gpudra-operator"]["components"]
          if "purl" in c and (p := PackageURL.from_string(c["purl"])).type == "golang"}
    releases = sorted((REPO / "operator" / "gpudra-allocator").glob("v1.*"))
    module = re.search(r"^module (\S+)$", (releases[0] / "go.mod").read_text(), re.M)
    assert module is not None
    mains = [c for c in boms["gpudra-operator"]["components"] if c.get("purl", "").startswith(f"pkg:golang/{module[1]}")]
    assert len(mains) == len(releases), (module[1], mains)  # one binary per release, each its own main module
    for release in releases:
        (pinned,) = re.findall(r"^\tk8s\.io/dynamic-resource-allocation (v\S+)$", (release / "go.mod").read_text(), re.M)
        assert f"k8s.io/dynamic-resource-allocation@{pinned}" in go, (release.name, sorted(go))
    assert not packages(boms["gpudra"], "golang"), "the agent image carries no Go binaries"


@pytest.mark.parametrize("name", ["ci.yml", "release.yml"])
def test_the_workflows_set_up_what_make_ci_needs(name: str) -> None:
    """.ci/run builds Go tools (Go >= 1.26) and caches them under ~/.cache/gpudra."""
    uses = {s["uses"].split("@")[0]: s for s in steps(workflows()[name]) if "uses" in s}
    assert uses["actions/setup-go"]["with"]["go-version"] == "1.26"
    assert uses["actions/cache"]["with"]["path"] == "~/.cache/gpudra"
    # hack/previous-release.sh builds the pinned previous release's commit: a shallow clone lacks it.
    (checkout,) = [s for s in steps(workflows()[name]) if s.get("uses", "").startswith("actions/checkout@")][:1]
    assert checkout["with"]["fetch-depth"] == 0
