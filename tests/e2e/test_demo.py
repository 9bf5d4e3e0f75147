"""`make demo`'s walkthrough as a new user runs it: `gpudra-dev demo --exit` (the development
package's command, from the checkout) starts the local cluster with simulated GPU nodes, the
operator and the agents, applies the sample config and claim, runs `gpudra explain` on the claim
that cannot fit, and leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def test_the_demo_walkthrough_runs_end_to_end_and_cleans_up(tmp_path: Path) -> None:
    gpudra_dev = Path(sys.executable).with_name("gpudra-dev")
    assert gpudra_dev.exists(), f"{gpudra_dev} is missing: make venv installs the development package (hack/python)"
    assert os.environ.get("GPUDRA_KUBE_BIN"), "no control-plane binaries: run through make test (hack/kube-bin.sh)"
    state = tmp_path / "demo"
    proc = subprocess.run([str(gpudra_dev), "demo", "--exit", "--state-dir", str(state)], capture_output=True,
                          text=True, timeout=540, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[demo] the pod runs on gpu-h100-0" in out, out[-4000:]
    # explain's verdict on the 8-GPU claim, from Kubernetes' own allocator, as its last line says
    assert "no node can satisfy request gpus: it needs 8 on one node, at most 7 free on one node (gpu-h100-0)" in out
    assert "[demo] walkthrough done" in out and "[demo] stopped; every process and temporary file removed" in out
    assert not any(state.iterdir()), list(state.iterdir())  # the run's directory and pid file are gone
    shutil.rmtree(state)
