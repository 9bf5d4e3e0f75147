"""Device metadata files (KEP-5304) read by the official decoder of each Kubernetes release that has
one: hack/metadata-check/v1.<minor>'s metadata-check, k8s.io/dynamic-resource-allocation's
``devicemetadata.DecodeMetadataFromStream`` of that release (what a container's reader runs), with
the release's validation where it has one (1.37: v1beta1 and v1alpha1; 1.36 has none).

Never skips: an unbuilt checker fails with the command that builds it (``make metadata-check``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from cdispec import cache_root

SOURCES = Path(__file__).resolve().parent.parent / "hack" / "metadata-check"
RELEASES = tuple(sorted(p.name for p in SOURCES.glob("v1.*")))  # ("v1.36", "v1.37")
_KEYED_ON = ("go.mod", "go.sum", "main.go")  # what hack/metadata-check-bin.sh keys its cache on


def checker(release: str) -> Path:
    """``$GPUDRA_METADATA_CHECK_DIR_v1_<minor>``'s metadata-check, else the cached build of the
    current sources (``<cache>/metadata-check-<release>/<sha256 of them>[:16]``)."""
    given = os.environ.get(f"GPUDRA_METADATA_CHECK_DIR_{release.replace('.', '_')}")
    if given and (Path(given) / "metadata-check").is_file():
        return Path(given) / "metadata-check"
    digest = hashlib.sha256(b"".join((SOURCES / release / n).read_bytes() for n in _KEYED_ON)).hexdigest()
    binary = cache_root() / f"metadata-check-{release}" / digest[:16] / "metadata-check"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"metadata-check {release} (the official device metadata decoder, hack/metadata-check/"
                           f"{release}) is not built: no {binary}. Build it (Go, the Go module proxy or a warm "
                           f"module cache):\n  cd {SOURCES.parent.parent} && make metadata-check")
    return binary


def decode(path: Path, release: str) -> dict[str, Any]:
    """What ``release``'s decoder reads from the file: ``{"apiVersion", "validation", "metadata"}``
    (``validation``: the release's validation errors, "" when valid). AssertionError when it cannot
    decode the file."""
    result = subprocess.run([str(checker(release)), str(path)], capture_output=True, text=True, timeout=60,
                            check=False)
    if result.returncode != 0:
        raise AssertionError(f"the {release} device metadata decoder rejects {path}: {result.stderr.strip()}")
    decoded: dict[str, Any] = json.loads(result.stdout)
    return decoded


def decode_valid(path: Path) -> dict[str, dict[str, Any]]:
    """Each release's reading of the file, asserting that each decodes it and finds it valid."""
    readings = {release: decode(path, release) for release in RELEASES}
    for release, reading in readings.items():
        assert reading["validation"] == "", f"{release} finds {path} invalid: {reading['validation']}"
    return readings
