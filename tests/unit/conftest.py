"""Fixtures for the driver's unit tests: simulated NVML from shipped or edited profiles, and the
mock libnvidia-ml.so.1 the real pynvml loads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudra_dev.localcluster.fakedriverroot import mock_nvml_library
from gpudra_driver.nvml.fake import FakeNvml, load_profile


def shipped_profile(name: str) -> dict[str, Any]:
    return yaml.safe_load((resources.files("gpudra_driver") / "profiles" / f"{name}.yaml").read_text())


@pytest.fixture
def fake() -> Callable[[str], FakeNvml]:
    """fake("dgx-h100") -> a fresh, uninitialised simulated NVML."""
    return lambda name: FakeNvml(load_profile(name))


@pytest.fixture
def profile_file(tmp_path: Path) -> Callable[..., Path]:
    """profile_file("dgx-h100", edit) -> path of a copy of a shipped profile after edit(doc)."""

    def make(base: str, edit: Callable[[dict[str, Any]], None] = lambda doc: None) -> Path:
        doc = copy.deepcopy(shipped_profile(base))
        edit(doc)
        path = tmp_path / f"{base}-edited.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    return make


@pytest.fixture(scope="session")
def mock_lib() -> Path:
    """The built mock libnvidia-ml.so.1; a failure says how to build it."""
    try:
        return mock_nvml_library()
    except RuntimeError as exc:
        pytest.fail(f"{exc}", pytrace=False)
