"""What a node agent keeps on its node besides the CDI specs (cdispec.py validates those)."""

from __future__ import annotations

from pathlib import Path

from gpudra_driver.plugin.checkpoint import Checkpoint, decode
from gpudra_driver.plugin.state import CHECKPOINT_FILE


def checkpoint_states(kubelet_dir: Path, driver: str) -> dict[str, str]:
    """claim UID -> state, from the agent's checkpoint under ``kubelet_dir`` (checksum verified)."""
    return {uid: entry.state for uid, entry in _checkpoint(kubelet_dir, driver).claims.items()}


def checkpoint_touched(kubelet_dir: Path, driver: str) -> frozenset[str]:
    """The GPUs (UUIDs) the agent's checkpoint records as having sharing settings to put back: an
    unprepare is done with a GPU once it is no longer here."""
    return _checkpoint(kubelet_dir, driver).touched


def _checkpoint(kubelet_dir: Path, driver: str) -> Checkpoint:
    return decode((kubelet_dir / "plugins" / driver / CHECKPOINT_FILE).read_bytes())
