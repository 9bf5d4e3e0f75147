"""Import kubernetes_asyncio without its generated API and model classes until someone uses them.

``import kubernetes_asyncio.<anything>`` runs the package's ``__init__``, which imports every
generated ``*Api`` class and ~900 model classes: about 0.8 s and 35 MiB of RSS in a process that
needs none of them (gpudra talks to the API server in plain dicts through ``ApiClient.call_api``).
That is more than half of the node agent's memory.

:func:`install` puts the three eager packages (``kubernetes_asyncio``, ``.client``,
``.client.models``) into ``sys.modules`` as real, not yet executed package modules, so their
submodules (``client.api_client``, ``client.exceptions``, ``config``, ``watch``, ...) import
normally and are the same module objects everyone else gets. Module attributes resolve lazily
(PEP 562): a submodule name imports that submodule; ``ApiClient``, ``Configuration`` and the
exception classes come from their own small modules; any other name (``CoreV1Api``, ``V1Pod``)
executes the package's real ``__init__`` into the same module object, after which it is exactly the
eager package. So code that does ``from kubernetes_asyncio import client; client.CoreV1Api`` still
works, and only pays when it does so.

Nothing happens when kubernetes_asyncio is already imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ROOT = "kubernetes_asyncio"


def _version() -> str:
    from importlib.metadata import version

    return version(ROOT)


# Names the eager client package re-exports from small modules of its own.
_CLIENT_LIGHT: dict[str, str | Callable[[], Any]] = {
    "ApiClient": "api_client",
    "Configuration": "configuration",
    "ApiException": "exceptions",
    "ApiValueError": "exceptions",
    "ApiTypeError": "exceptions",
    "ApiKeyError": "exceptions",
    "OpenApiException": "exceptions",
}


def install() -> bool:
    """Make kubernetes_asyncio lazy; False when it was already imported (then nothing changes)."""
    if ROOT in sys.modules:
        return False
    # The root stays unexecuted too: its __init__ imports dynamic, stream, utils and watch (pydoc
    # among them, ~0.7 MiB) that the agent never uses. Its one value of its own, ``__version__``,
    # comes from the distribution's metadata: dynamic reads it mid-import, and running the root's
    # __init__ at that moment would import dynamic circularly.
    root = _lazy_package(ROOT, None, {"__version__": _version})
    client = _lazy_package(f"{ROOT}.client", root, _CLIENT_LIGHT)
    _lazy_package(f"{ROOT}.client.models", client, {})
    return True


def is_loaded(name: str) -> bool:
    """True when the real ``__init__`` of lazy package ``name`` has run (for tests and the bench)."""
    module = sys.modules.get(name)
    return module is not None and getattr(module, "__gpudra_lazy_state__", {"loaded": True})["loaded"]


def _lazy_package(name: str, parent: ModuleType | None,
                  light: dict[str, str | Callable[[], Any]]) -> ModuleType:
    if parent is None:
        spec = importlib.util.find_spec(name)
    else:
        spec = importlib.machinery.PathFinder.find_spec(name, parent.__path__)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an installed package")
    module = importlib.util.module_from_spec(spec)
    state = {"loaded": False}

    def __getattr__(attr: str) -> Any:
        if attr in light:
            source = light[attr]
            if callable(source):
                return source()
            return getattr(importlib.import_module(f"{name}.{source}"), attr)
        if not attr.startswith("__") and \
                importlib.machinery.PathFinder.find_spec(f"{name}.{attr}", module.__path__) is not None:
            return importlib.import_module(f"{name}.{attr}")
        if state["loaded"]:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        state["loaded"] = True
        assert spec.loader is not None  # a package found on the path has one
        spec.loader.exec_module(module)  # the real __init__, into this very module object
        return getattr(module, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__gpudra_lazy_state__ = state  # type: ignore[attr-defined]
    sys.modules[name] = module
    if parent is not None:
        setattr(parent, name.rpartition(".")[2], module)
    return module
