"""Where the tests find a tool a hack/*-bin.sh script builds: the directory make test names in an
environment variable, else the script's cache of its pinned version (the cache root and version
the script itself uses: hack/lib/cached-tool.sh)."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cached_dir(script: str, version_var: str, cache_name: str) -> Path:
    """$GPUDRA_CACHE (else $XDG_CACHE_HOME/gpudra, else ~/.cache/gpudra)/<cache_name>/<version>, the
    version being $<version_var> or the one pinned in hack/<script>."""
    pinned = re.search(rf'{version_var}="\$\{{{version_var}:-([^}}]+)\}}"', (REPO / "hack" / script).read_text())
    version = os.environ.get(version_var) or (pinned.group(1) if pinned else "")
    cache = os.environ.get("GPUDRA_CACHE") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpudra")
    return Path(cache) / cache_name / version


def tool_dir(env_var: str, script: str, version_var: str, cache_name: str) -> tuple[Path, str]:
    """(the directory, where it came from, for an error message)."""
    value = os.environ.get(env_var)
    if value:
        return Path(value), f"${env_var}={value}"
    directory = cached_dir(script, version_var, cache_name)
    return directory, f"${env_var} is unset and the cache {directory}"
