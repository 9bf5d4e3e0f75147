"""What a node agent keeps on its node besides the CDI specs (cdispec.py validates those)."""

from __future__ import annotations

from pathlib import Path

from gpudra_driver.plugin.checkpoint import decode
from gpudra_driver.plugin.state import CHECKPOINT_FILE


def checkpoint_states(kubelet_dir: Path, driver: str) -> dict[str, str]:
    """claim UID -> state, from the agent's checkpoint under ``kubelet_dir`` (checksum verified)."""
    path = kubelet_dir / "plugins" / driver / CHECKPOINT_FILE
    return {uid: entry.state for uid, entry in decode(path.read_bytes()).claims.items()}
