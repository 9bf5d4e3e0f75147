"""Dynamic MIG after a GPU reset, against the real API server and the real agent process: the mock
``nvidia-smi -r`` destroys every MIG instance of GPU 0 under a prepared claim (MIG mode kept), as a
reset or a reload of the NVIDIA kernel module does. The kubelet's repeated prepare, and an agent
restarted after the reset, make the claim's instance again at its placement and rewrite its CDI spec
with the new MIG UUID; the agent says so in a MigInstanceLost Warning Event on the Node. Unprepare
after a reset succeeds and destroys nothing else, neither someone else's instance made since at the
claim's own placement nor one elsewhere.

Partitionable devices are off in Kubernetes 1.35 (no placement is published there: the claim is
refused, no instance made); CI runs this file with the whole suite on 1.35.4 and on 1.36.3 and
1.37.2 (.ci/run)."""

from __future__ import annotations

import ctypes
import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

from test_dynamic_mig import PER_GPU, PROFILE, instances_on_gpu0, published
from test_kubelet_plugin import plugin_agents  # noqa: F401 - a fixture

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.nvml.fake import FakeNvml, load_profile, mig_uuid
from gpudra_dev.localcluster.waiting import wait_for

EVENT = resource_type("v1", "Event")
GPU0 = load_profile(PROFILE.split(":", 1)[1]).gpus[0].uuid
ARGS = ("--mig", "dynamic", "--rescan-interval", "600")  # the check at start only: the prepares below do theirs


def reset_gpu0(root: Path) -> None:
    """``nvidia-smi -r -i 0`` of the agent's driver root: every instance of GPU 0 gone."""
    done = subprocess.run([str(root / "usr/bin/nvidia-smi"), "-r", "-i", "0"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done


def spec_uuid(plugin: Any, uid: str) -> str:
    spec = json.loads(plugin.spec_path(uid).read_text())
    (env,) = [e for e in spec["containerEdits"]["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    return env.split("=", 1)[1]


def make_foreign(state: Path, profile_id: int, start: int, size: int, ci_index: int) -> None:
    """An instance someone else makes (nvidia-smi mig -cgi ... -C) through the same NVML state."""
    n = FakeNvml(load_profile(PROFILE.split(":", 1)[1]), state)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByUUID(GPU0)
    gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(n.c_nvmlGpuInstancePlacement_t(start, size)))
    n.nvmlGpuInstanceCreateComputeInstance(gi, n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_index, 0).id)
    n.nvmlShutdown()


async def lost_events(kube: Kube, node: str, count: int) -> list[Obj]:
    async def probe() -> list[Obj] | None:
        found = [e async for e in kube.list(EVENT, "default", field_selector=f"involvedObject.name={node}")
                 if e.get("reason") == "MigInstanceLost"]
        return found if len(found) >= count else None

    return await wait_for(probe, timeout=30, what=f"{count} MigInstanceLost Node event(s) on {node}")


async def test_a_reset_gpus_instance_is_made_again_and_unprepare_destroys_nothing_else(
        kube: Kube, namespace: str, fake_nodes: Any, plugin_agents: Any) -> None:  # noqa: F811 - the fixture
    from test_consumable_capacity import minor_version
    from test_kubelet_plugin import allocated_claim, ref

    from gpudra_dev.kubelet_client import DraClient

    driver = f"mr{secrets.token_hex(3)}.gpudra.io"
    node = (await fake_nodes("migreset"))["metadata"]["name"]
    first = plugin_agents(node, driver, nvml=PROFILE, extra_args=ARGS)
    root = first.workdir / "driver-root"
    state = root / "run" / "gpudra-mock"
    if await minor_version(kube) < 36:  # static MIG instead: no placement to prepare, nothing made
        await published(kube, driver, node, 0)
        claim = await allocated_claim(kube, namespace, "c", driver, node, ["gpu-0-mig-3g40gb-at4"])
        async with DraClient((await first.registered()).endpoint) as kubelet:
            out = (await first.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]]
        assert "is not a device of node" in out.error and instances_on_gpu0(state) == []
        return
    await published(kube, driver, node, 2 * PER_GPU)
    claim = await allocated_claim(kube, namespace, "c", driver, node, ["gpu-0-mig-3g40gb-at4"])
    uid = claim["metadata"]["uid"]
    async with DraClient((await first.registered()).endpoint) as kubelet:
        prepared = (await first.prepare(kubelet, [ref(claim)])).claims[uid]
        assert prepared.error == "" and instances_on_gpu0(state) == [(2, 0)]
        assert spec_uuid(first, uid) == mig_uuid(GPU0, 2, 0)

        # (a) a reset under the running agent, then the kubelet prepares the claim again (after a
        # kubelet restart): the instance is back at slices 4-7, the spec names its new UUID
        reset_gpu0(root)
        assert instances_on_gpu0(state) == []
        again = (await first.prepare(kubelet, [ref(claim)])).claims[uid]
        assert again.error == "" and list(again.devices) == list(prepared.devices)  # the same CDI IDs
        assert instances_on_gpu0(state) == [(2, 0)] and spec_uuid(first, uid) == mig_uuid(GPU0, 2, 0, 1)
        assert first.checkpoint() == {uid: "PrepareCompleted"}
    first.agent.stop()

    # a reset while no agent runs: the restarted agent makes the instance again at its start
    reset_gpu0(root)
    restarted = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=ARGS)
    registered = await restarted.registered()
    assert instances_on_gpu0(state) == [(2, 0)] and spec_uuid(restarted, uid) == mig_uuid(GPU0, 2, 0, 2)
    (event, *_) = await lost_events(kube, node, 1)
    assert event["type"] == "Warning" and f"ResourceClaim {namespace}/c: the MIG instance of gpu-0-mig-3g40gb-at4 " \
        f"(3g.40gb at memory slice 4 of GPU {GPU0}) is gone" in event["message"], event["message"]
    async with DraClient(registered.endpoint) as kubelet:
        assert (await restarted.prepare(kubelet, [ref(claim)])).claims[uid].error == ""
        assert instances_on_gpu0(state) == [(2, 0)]
    restarted.agent.stop()

    # (b) a reset, then someone else's instances: one at the claim's own placement (the same profile,
    # so the same GPU instance ID), one elsewhere; the agent leaves both alone and says why, and the
    # claim's unprepare destroys neither
    reset_gpu0(root)
    make_foreign(state, 9, 4, 4, 2)
    make_foreign(state, 14, 0, 2, 1)
    assert instances_on_gpu0(state) == [(2, 0), (3, 0)]
    last = plugin_agents(node, driver, nvml=PROFILE, workdir=first.workdir, extra_args=ARGS)
    registered = await last.registered()
    events = await lost_events(kube, node, 2)
    assert any("an instance someone else made holds its placement" in e["message"] for e in events), events
    async with DraClient(registered.endpoint) as kubelet:
        out = await kubelet.unprepare([ref(claim)])
        assert {u: r.error for u, r in out.claims.items()} == {uid: ""}
    assert instances_on_gpu0(state) == [(2, 0), (3, 0)]
    assert last.checkpoint() == {} and not last.spec_path(uid).exists()
