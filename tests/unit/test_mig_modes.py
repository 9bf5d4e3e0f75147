"""MIG modes per node (issue 34, configuration): the policy (gpudra_core.migpolicy), what discovery
publishes in each mode and which GPUs it reports not ready, the agent's mode source (its Node's
labels, the API server's support for counters) and the rescanner's MigNotReady/MigReady events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import pynvml
import pytest

from gpudra_core.agentcontract import DYNAMIC_MIG_SUPPORTED, DYNAMIC_MIG_UNSUPPORTED, MIG_NOT_READY, MIG_READY
from gpudra_core.devicemodel import Device
from gpudra_core.migpolicy import MigNodeGroup, MigPolicy, format_node_group, parse_node_group, policy_args
from gpudra_driver.discovery import scan
from gpudra_driver.nvml.fake import FakeNvml
from gpudra_driver.publishing.migmode import MigModeSource
from gpudra_driver.publishing.rescan import REPOST_INTERVAL, Rescanner

# -- the policy ------------------------------------------------------------------------------------


def test_node_groups_travel_as_flags_and_back() -> None:
    groups = (MigNodeGroup("training", "dynamic", {"gpudra.io/mig": "dynamic", "zone": "eu-1a"}),
              MigNodeGroup("inference", "whole", {"example.com/pool": "inference"}))
    policy = MigPolicy("static", groups)
    assert policy_args(policy) == ["--mig-node-group", "training:dynamic:gpudra.io/mig=dynamic,zone=eu-1a",
                                   "--mig-node-group", "inference:whole:example.com/pool=inference"]
    assert tuple(parse_node_group(format_node_group(g)) for g in groups) == groups
    assert policy_args(MigPolicy()) == []  # the default renders the same DaemonSet as before spec.mig
    assert policy_args(MigPolicy("dynamic")) == ["--mig", "dynamic"]
    assert policy.needs_node_labels and policy.may_be_dynamic
    assert not MigPolicy("dynamic", (MigNodeGroup("a", "dynamic", {"k": "v"}),)).needs_node_labels


@pytest.mark.parametrize(("text", "error"), [
    ("a:dynamic", "is not NAME:MODE"),
    ("a:dynamic:", "is not NAME:MODE"),
    ("a:auto:k=v", "the mode must be one of whole, static, dynamic"),
    ("a:dynamic:k", "is not KEY=VALUE"),
    ("a:dynamic:k=v,k=w", "repeats a key"),
    ("A:dynamic:k=v", "must be a DNS label"),
    ("a:dynamic:k=v w", "not a valid label"),
    ("a:dynamic:" + ",".join(f"k{i}=v" for i in range(9)), "1 to 8 labels"),
])
def test_bad_node_groups_are_refused_saying_why(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_node_group(text)


# -- discovery in each mode ------------------------------------------------------------------------


def test_whole_publishes_gpus_whole_and_nothing_of_a_mig_enabled_gpu(fake: Callable[[str], FakeNvml]) -> None:
    plain = scan(fake("dgx-h100"), mig="whole")  # MIG-capable, MIG mode disabled: as in every mode
    assert plain.devices == scan(fake("dgx-h100"), mig="static").devices and plain.mig_not_ready == []
    enabled = scan(fake("a100-80gb-mig"), mig="whole")  # MIG mode on, with MIG devices an admin made
    assert enabled.devices == []
    (why,) = enabled.mig_not_ready
    assert "has MIG mode enabled, so it cannot be used whole" in why and "`nvidia-smi -i 0 -mig 0`" in why
    assert enabled.warnings == [why]


def test_each_mode_reports_the_gpus_that_do_not_match_it(fake: Callable[[str], FakeNvml]) -> None:
    dynamic = scan(fake("h100-dynamic-mig"), mig="dynamic")
    assert dynamic.mig_not_ready == [] and "mig" in {d.type for d in dynamic.devices}
    static = scan(fake("h100-dynamic-mig"), mig="static")  # MIG mode on, no MIG devices: nothing to offer
    assert static.devices == [] and len(static.mig_not_ready) == 2
    assert "MIG mode enabled but no MIG devices" in static.mig_not_ready[0]
    disabled = scan(fake("dgx-h100"), mig="dynamic")
    assert len(disabled.mig_not_ready) == 8 and "`nvidia-smi -i 0 -mig 1`" in disabled.mig_not_ready[0]
    assert scan(fake("dgx-h100"), mig="static").mig_not_ready == []  # whole GPUs are what static offers
    foreign = scan(fake("a100-80gb-mig"), mig="dynamic")
    assert len(foreign.mig_not_ready) == 1 and "gpudra did not create" in foreign.mig_not_ready[0]


def test_a_gpu_keeps_the_placements_its_prepared_claims_hold_whatever_the_mode_says(
        fake: Callable[[str], FakeNvml]) -> None:
    nvml = fake("h100-dynamic-mig")
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, pynvml.c_nvmlGpuInstancePlacement_t(start=4, size=4))
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    uuid, gi_id = nvml.nvmlDeviceGetUUID(gpu), nvml.nvmlGpuInstanceGetInfo(gi).id
    nvml.nvmlShutdown()
    dynamic = [d.name for d in scan(nvml, mig="dynamic", owned={(uuid, gi_id)}).devices]
    for mode in ("static", "whole"):
        kept = scan(nvml, mig=mode, owned={(uuid, gi_id)})  # type: ignore[arg-type]
        assert [d.name for d in kept.devices if d.attr("parentIndex") == 0] == \
            [n for n in dynamic if n.startswith("gpu-0-")]  # the claim's placement stays published
        assert any(f"stays dynamic MIG, not {mode}, until its 1 prepared claim(s)" in w for w in kept.warnings)
    # someone else's instance is no claim of ours: static publishes it as the MIG device it is
    static = scan(nvml, mig="static")
    assert [d.name for d in static.devices] == ["gpu-0-mig-3g40gb-2-0"]


# -- the agent's mode source -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Api:
    """What the agent asks the API server, answered from fields the test sets."""

    def __init__(self) -> None:
        self.labels: Mapping[str, str] | None = {}
        self.kept: tuple[bool, str] | Exception = (True, "")
        self.label_reads = self.probes = 0
        self.events: list[tuple[str, str, str]] = []

    async def node_labels(self) -> Mapping[str, str] | None:
        self.label_reads += 1
        return self.labels

    async def counters_kept(self) -> tuple[bool, str]:
        self.probes += 1
        if isinstance(self.kept, Exception):
            raise self.kept
        return self.kept

    async def report(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def source(api: Api, clock: Clock, policy: MigPolicy) -> MigModeSource:
    return MigModeSource(policy, node_labels=api.node_labels, counters_kept=api.counters_kept, report=api.report,
                         node_recheck=300, recheck=900, clock=clock)


def test_the_mode_follows_the_nodes_labels_read_when_due() -> None:
    api, clock = Api(), Clock()
    mode = source(api, clock, MigPolicy("static", (MigNodeGroup("training", "dynamic", {"pool": "training"}),
                                                   MigNodeGroup("serving", "whole", {"pool": "serving"}))))
    assert asyncio.run(mode.current()) == "static" and api.label_reads == 1
    api.labels = {"pool": "training"}
    clock.now += 299
    assert asyncio.run(mode.current()) == "static" and api.label_reads == 1  # not due yet
    clock.now += 1
    assert asyncio.run(mode.current()) == "dynamic" and api.probes == 1
    api.labels = None  # the Node cannot be read: the last answer stands
    clock.now += 300
    assert asyncio.run(mode.current()) == "dynamic"
    api.labels = {"pool": "serving"}
    clock.now += 300
    assert asyncio.run(mode.current()) == "whole" and str(mode.resolved) == "whole (node group serving)"
    assert api.events == [] and api.probes == 1


def test_without_groups_of_another_mode_the_node_is_never_read() -> None:
    api, clock = Api(), Clock()
    mode = source(api, clock, MigPolicy("dynamic", (MigNodeGroup("all", "dynamic", {"k": "v"}),)))
    assert asyncio.run(mode.current()) == "dynamic" and api.label_reads == 0


def test_dynamic_falls_back_to_static_while_counters_are_dropped_and_says_so_until_they_are_kept() -> None:
    api, clock = Api(), Clock()
    api.kept = (False, "the API server drops sharedCounters")
    mode = source(api, clock, MigPolicy("dynamic"))
    assert asyncio.run(mode.current()) == "static"
    ((kind, reason, message),) = api.events
    assert (kind, reason) == ("Warning", DYNAMIC_MIG_UNSUPPORTED)
    assert message.startswith("dynamic MIG is not used: the API server drops sharedCounters. ")
    clock.now += 899
    assert asyncio.run(mode.current()) == "static" and api.probes == 1
    clock.now += 1
    assert asyncio.run(mode.current()) == "static" and api.probes == 2  # asked again, said again
    assert [e[1] for e in api.events] == [DYNAMIC_MIG_UNSUPPORTED] * 2
    api.kept = OSError("connection refused")
    clock.now += 900
    assert asyncio.run(mode.current()) == "static" and len(api.events) == 2  # no answer: nothing changes
    api.kept = (True, "")  # the control plane was upgraded
    clock.now += 900
    assert asyncio.run(mode.current()) == "dynamic"
    assert api.events[-1][:2] == ("Normal", DYNAMIC_MIG_SUPPORTED)
    clock.now += 10 * 900
    assert asyncio.run(mode.current()) == "dynamic" and api.probes == 4  # kept: never asked again


def test_the_first_answer_on_counters_is_waited_for() -> None:
    """Placements published to a server that drops counters would be plain devices the scheduler
    could hand out overlapping: no dynamic scan before the server has answered."""
    api, clock = Api(), Clock()
    answers: list[tuple[bool, str] | Exception] = [OSError("refused"), (False, "dropped")]

    async def flaky() -> tuple[bool, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    mode = MigModeSource(MigPolicy("dynamic"), node_labels=api.node_labels, counters_kept=flaky, report=api.report,
                         clock=clock)
    assert asyncio.run(mode.current()) == "static" and answers == []
    assert [e[1] for e in api.events] == [DYNAMIC_MIG_UNSUPPORTED]


# -- the rescanner's events ------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def publish(self, devices: Sequence[Device]) -> bool:
        return True

    async def report(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def test_gpus_that_do_not_match_the_mode_are_one_node_event_repeated_while_it_lasts() -> None:
    recorder, clock = Recorder(), Clock()
    modes = ["dynamic"]

    async def current() -> str:
        return modes[0]

    scanner = Rescanner("fake:dgx-h100", recorder.publish, report=recorder.report,
                        mig_source=current, clock=clock)  # type: ignore[arg-type]
    asyncio.run(scanner.scan_once())
    ((kind, reason, message),) = recorder.events
    assert (kind, reason) == ("Warning", MIG_NOT_READY)
    assert message.startswith("8 GPU(s) do not match the node's MIG mode dynamic: GPU 0 (")
    assert "DiscoveryWarning" not in {e[1] for e in recorder.events}  # said once, as MigNotReady
    asyncio.run(scanner.scan_once())
    assert len(recorder.events) == 1  # unchanged: not again at once
    clock.now += REPOST_INTERVAL
    asyncio.run(scanner.scan_once())
    assert [e[1] for e in recorder.events] == [MIG_NOT_READY] * 2  # again before the first expires
    modes[0] = "static"  # the node's group changed: whole GPUs are what static offers
    asyncio.run(scanner.scan_once())
    assert recorder.events[-1] == ("Normal", MIG_READY, "every GPU matches the node's MIG mode static")
    asyncio.run(scanner.scan_once())
    assert len(recorder.events) == 3
