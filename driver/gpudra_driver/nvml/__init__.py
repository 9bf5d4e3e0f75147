"""Choosing an NVML: the real one (pynvml from nvidia-ml-py) or a simulated one built from a profile.

Both are module-like objects with pynvml's function names, constants and exception classes, so
discovery is written once against that surface. Importing this package is cheap: pynvml and the
simulator are imported only when :func:`load_nvml` asks for them.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpudra_driver.driverroot import DriverRoot

ENV_VAR = "GPUDRA_NVML"
MOCK_STATE_ENV = "GPUDRA_MOCK_STATE_DIR"  # the simulator's injected health, as the mock library reads it
MOCK_STATE_SUBDIR = "run/gpudra-mock"  # under the driver root otherwise
DEFAULT_SPEC = "real"
FAKE_PREFIX = "fake:"


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine; the message says what to check."""


def load_nvml(spec: str | None = None, driver_root: DriverRoot | None = None) -> Any:
    """``"real"`` (default) -> the pynvml module; ``"fake:<profile>"`` -> a simulated NVML where
    ``<profile>`` is a shipped profile name (see :func:`profile_names`) or a path to a YAML file.
    ``spec=None`` reads ``$GPUDRA_NVML``. Raises :class:`NvmlUnavailable` when pynvml is missing and
    ``ValueError`` for a bad spec or profile.

    With real NVML, ``libnvidia-ml.so.1`` is found in ``driver_root`` (default: ``/``) and opened
    by its full path before pynvml's ``nvmlInit`` would look it up by soname: the agent's image has
    no NVIDIA library, and putting the root's lib dir on ``LD_LIBRARY_PATH`` would load the host's
    glibc into the agent as well. :class:`NvmlUnavailable` names the root and every path searched.

    The simulator reads injected health (XID events, a lost GPU) from ``$GPUDRA_MOCK_STATE_DIR``,
    else ``<driver_root>/run/gpudra-mock``, as the mock library does (none without a root)."""
    spec = resolve_spec(spec)
    if spec == "real":
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            raise NvmlUnavailable(
                f"cannot import pynvml ({exc}); install the nvidia-ml-py package"
            ) from exc
        from gpudra_driver.driverroot import DriverRoot, DriverRootError
        from gpudra_driver.nvml.loader import open_nvml_library

        try:
            open_nvml_library(pynvml, driver_root or DriverRoot.at("/"))
        except DriverRootError as exc:
            raise NvmlUnavailable(str(exc)) from exc
        return pynvml
    if spec.startswith(FAKE_PREFIX):
        from gpudra_driver.nvml.fake import FakeNvml, load_profile

        state = os.environ.get(MOCK_STATE_ENV)
        state_dir = Path(state) if state else driver_root.local / MOCK_STATE_SUBDIR if driver_root else None
        return FakeNvml(load_profile(spec[len(FAKE_PREFIX):]), state_dir)
    raise ValueError(f"unknown NVML spec {spec!r}: use 'real' or 'fake:<profile>' ({', '.join(profile_names())})")


def resolve_spec(spec: str | None) -> str:
    """The spec in effect: the argument, else ``$GPUDRA_NVML``, else ``"real"``."""
    return spec or os.environ.get(ENV_VAR) or DEFAULT_SPEC


def profile_names() -> list[str]:
    """Names of the shipped simulated-NVML profiles."""
    folder = resources.files("gpudra_driver") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))
