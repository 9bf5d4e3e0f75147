"""The short chaos run (`make chaos` runs the long one): a control plane of its own, three GPU nodes
with their agents and MPS supervisors (one a real node: the release's kubelet on containerd + runc,
the pods' containers getting their GPUs by CDI; two with kubelet stand-ins), two operator replicas,
pods with plain, shared, MPS and consumable claims coming and going, while kube-apiserver and etcd
restart in place, agents and operator replicas are SIGKILLed and kubelets restart, each at least
once (the real node's agent and kubelet among them). Any invariant broken fails the test with the
seed that reproduces its schedule (docs/chaos.md)."""

from __future__ import annotations

import pytest

from gpudra_dev.chaos.run import ChaosRun, Settings
from gpudra_dev.chaos.schedule import FAULT_KINDS, counts_by_kind

SEED = 20261206
pytestmark = pytest.mark.timeout(600)


async def test_a_short_chaos_run_breaks_no_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    report = await ChaosRun(Settings(seed=SEED, duration=90, mean_gap=30, settle_timeout=150)).run()
    text = report.render()
    with capsys.disabled():
        print("\n" + text)
    assert report.violations == [], f"chaos seed {SEED} (CHAOS_SEED={SEED} CHAOS_DURATION=90 make chaos):\n{text}"
    done = counts_by_kind([r.fault for r in report.faults if r.done is not None])
    assert all(done[kind] >= 1 for kind in FAULT_KINDS), text
    assert all(n >= 1 for n in report.units.values()), text  # every kind of claim was exercised
    assert report.pods_run >= 10 and report.pods_deleted >= 5, text
    stats = report.kubelets.values()
    assert sum(s.prepared for s in stats) >= 10 and sum(s.unprepared for s in stats) >= 10, text
    assert report.ready_after_chaos is not None, text
    ((name, real),) = report.real_nodes.items()
    on_real = [r.fault for r in report.faults if r.done is not None and r.fault.target == name]
    assert {f.kind for f in on_real} >= {"agent", "kubelet"}, text  # the real kubelet restarted, its agent killed
    assert real.kubelet_restarts >= 1 and real.pods_run >= 3, text  # containers ran, their GPUs checked
    assert len(real.claims_prepared) >= 3 and real.claims_unprepared == real.claims_prepared, text
