"""Each image installs one component (gpudra.component, images/*.Dockerfile): the requirements it
reads from the wheel's ``<component>-image`` extra, and those extras against ``dependencies``,
which `pip install gpudra` installs whole. The images themselves: tests/integration/test_images.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from gpudra.component import requirements

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_image_extras_together_are_what_pip_install_gpudra_installs() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    union = {str(Requirement(r)) for name in ("agent-image", "operator-image") for r in extras[name]}
    assert union == {str(Requirement(r)) for r in project["dependencies"]}
    # The agent carries nothing only the operator needs, and the reverse.
    names = {name: {Requirement(r).name for r in extras[name]} for name in ("agent-image", "operator-image")}
    assert not names["agent-image"] & {"kopf", "jinja2", "jsonschema", "aiolimiter"}
    assert not names["operator-image"] & {"grpcio", "grpcio-health-checking", "nvidia-ml-py", "uvloop", "protobuf"}


def test_requirements_are_read_from_the_components_extra_markers_dropped() -> None:
    requires = ['kopf<2,>=1.45', 'grpcio>=1.85.1; extra == "agent-image"', "kopf<2,>=1.45; extra == 'operator-image'",
                'pyyaml>=6.0; extra == "agent-image"', 'cryptography>=43; extra == "local"']
    assert requirements("agent", requires) == ["grpcio>=1.85.1", "pyyaml>=6.0"]
    assert requirements("operator", requires) == ["kopf<2,>=1.45"]
