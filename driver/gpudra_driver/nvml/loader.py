"""Opening the driver root's ``libnvidia-ml.so.1`` for pynvml, by full path.

pynvml opens the library on its first ``nvmlInit`` with ``CDLL("libnvidia-ml.so.1")`` unless its
module global ``nvmlLib`` is already set; setting it first is the one hook pynvml offers. Function
pointers are cached per library (``_nvmlGetFunctionPointer_cache``), so a process that moves to
another root (``gpudra discover`` called twice in one test process) drops that cache too, which is
safe only while NVML is not initialised.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

from gpudra_driver.driverroot import DriverRoot, DriverRootError, NvmlLibrary, locate_nvml

_lock = threading.Lock()
_loaded: NvmlLibrary | None = None
KERNEL_VERSION_FILE = Path("/proc/driver/nvidia/version")


def open_nvml_library(pynvml: Any, root: DriverRoot) -> NvmlLibrary:
    """Make pynvml use the root's NVML library; returns what was opened."""
    global _loaded
    library = locate_nvml(root)
    with _lock:
        if _loaded is not None and _loaded.path == library.path and pynvml.nvmlLib is not None:
            return library
        if pynvml.nvmlLib is not None and getattr(pynvml, "_nvmlLib_refcount", 0) > 0:
            raise DriverRootError(f"NVML is in use from {_loaded.path if _loaded else 'another library'}; "
                                  f"cannot switch to {library.path}")
        try:
            handle = ctypes.CDLL(str(library.path))
        except OSError as error:
            raise DriverRootError(f"{library.path} in driver root {root.describe()} cannot be loaded: "
                                  f"{error}") from None
        pynvml.nvmlLib = handle
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if isinstance(cache, dict):
            cache.clear()
        _loaded = library
    return library


def version_mismatch_detail() -> str:
    """What to show when nvmlInit reports a library/kernel-module version mismatch."""
    library = f"library {_loaded.path} (version {_loaded.version or 'unknown'})" if _loaded else "the library"
    try:
        first = KERNEL_VERSION_FILE.read_text().splitlines()[0]
        kernel = f"kernel module: {first.strip()}"
    except (OSError, IndexError):
        kernel = f"kernel module version unknown ({KERNEL_VERSION_FILE} unreadable)"
    return f"{library}; {kernel}"
