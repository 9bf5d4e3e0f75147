"""The release pipeline as code (.github/workflows, docs/releasing.md): actionlint passes, every
step is `make <target>` for a target of the Makefile (so it runs the same here) or an action pinned
by commit, the release publishes the files the targets write, and `make sbom` writes a valid
CycloneDX document of gpudra and its dependencies. Needs actionlint (make actionlint builds it;
make test passes GPUDRA_ACTIONLINT_DIR) and PyPI for the SBOM's first resolution."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachedtool import tool_dir
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
PINNED_ACTION = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(/[A-Za-z0-9_./-]+)?@[0-9a-f]{40}$")
MAKE_STEP = re.compile(r"^make( [a-z][a-z0-9-]*)+$")
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
    assert {"ci", "release-check", "chart-package", "chart-push", "sbom", "images-multiarch", "images-push"} <= targets
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
                    "make chart-package chart-push", "make sbom"]
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

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    components = {normal(c["name"]): c for c in bom["components"]}
    direct = {normal(re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0]) for r in project["dependencies"]}
    assert direct <= components.keys(), direct - components.keys()
    for name, component in components.items():
        assert component["purl"] == f"pkg:pypi/{name}@{component['version']}", component["purl"]
    # Only what gpudra needs: none of the development tools, not pip.
    assert not {"pytest", "mypy", "pip", "cyclonedx-bom"} & components.keys()


@pytest.mark.parametrize("name", ["ci.yml", "release.yml"])
def test_the_workflows_set_up_what_make_ci_needs(name: str) -> None:
    """.ci/run builds Go tools (Go >= 1.26) and caches them under ~/.cache/gpudra."""
    uses = {s["uses"].split("@")[0]: s for s in steps(workflows()[name]) if "uses" in s}
    assert uses["actions/setup-go"]["with"]["go-version"] == "1.26"
    assert uses["actions/cache"]["with"]["path"] == "~/.cache/gpudra"
    # hack/previous-release.sh builds the pinned previous release's commit: a shallow clone lacks it.
    (checkout,) = [s for s in steps(workflows()[name]) if s.get("uses", "").startswith("actions/checkout@")][:1]
    assert checkout["with"]["fetch-depth"] == 0
