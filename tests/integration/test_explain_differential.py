"""`gpudra explain` against the real kube-scheduler: random cases (tests/explaincases.py: inventories
from the GPU profiles, shared GPUs, MIG-like partitionable GPUs with counter slices, taints; classes
from the templates; claims with random selectors, counts, All, firstAvailable, matchAttribute and
distinctAttribute constraints, capacity requests, tolerations, admin access; holder claims that
take devices, shares or partitions first) applied to the real control plane. The holders' pods are
scheduled first; then for every case and node, a claim (sometimes from a ResourceClaimTemplate,
sometimes with a second claim, sometimes none where the pod asks for extended resources alone) and
a pod pinned to that node, and for some cases one pod per node that uses a holder's claim already
allocated on the first node; explain reads each pod from the
live cluster (through the command's own reads) while a scheduling gate holds it, then the gate is
lifted and the scheduler decides. Explain's verdict must be the
scheduler's for every pod: scheduled or not, so the node set of every claim agrees too, CEL error
cases included. Devices with binding conditions: the test plays the controller that sets them
(status.devices), so a pod whose allocation the scheduler made is bound after its PreBind wait
(5 s polls): "scheduled" is bound, and explain's "satisfiable" is "the allocator places it", which
binding conditions do not change. DeviceTaintRules (1.37) are created first, so the scheduler
knows them before it places a holder.

Extended resources backed by DRA (KEP-5004, 1.36 and 1.37): some pods' containers (init containers,
sidecars) ask for a resource the case's class maps, with the case's claims or with none; explain
replays the claim the scheduler builds for them (its verdict's ``extended``). Besides the verdict,
for every such pod the scheduler placed, the claim it created (the pod's
status.extendedResourceClaimStatus) must have the requests explain built for the pod (name, class,
count, allocation mode) and the pod's status the request mappings explain gave; and explain's
requests for a pod the scheduler did not place must be those of the claim the scheduler created
for a pod of the same case on another node (the same containers make the same claim where no
device plugin serves the resource, as on these nodes).

Per release (Kubernetes 1.35 keeps consumable capacity, partitionable devices, device taints and
binding conditions behind gates that are off: its API server drops those fields, and the cases then
test what is left; 1.36 and 1.37 keep them): the stored objects must carry exactly the features
whose gates are on, and where they are on, the run must exercise each of them both ways. What
blocked an unschedulable pod is found by asking Kubernetes' allocator (gpudra-allocator) again on
the same state with one thing taken away (the taints, the counters, the other claims); none of that
decides agreement, only the scheduler does.

CI runs GPUDRA_EXPLAIN_CASES (default 80) cases from GPUDRA_EXPLAIN_SEED (default 2026) on 1.35,
and 60 on 1.36 and on 1.37 (.ci/run), 20-30 s each; `make explain-diff` runs 300."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from explaincases import (ADMIN_ACCESS_LABEL, Case, claim_features, class_features, enabled_features, generate,
                          rule_selects, slice_features)
from schedpods import claim_names, extended_claim_name, pinned_pod, pinned_pod_with, scheduling_outcome

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.explain import explain_snapshot
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_operator.explain.gather import TAINT_RULE, read_snapshot
from gpudra_operator.explain.verdict import ExtendedReport
from gpudra_dev.localcluster.objects import create_fake_node, delete_node
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
NAMESPACE = resource_type("v1", "Namespace")
GATE = "gpudra.io/explain-first"
SEED = int(os.environ.get("GPUDRA_EXPLAIN_SEED", "2026"))
CASES = int(os.environ.get("GPUDRA_EXPLAIN_CASES", "80"))
EFFECTFUL = ("NoSchedule", "NoExecute")


def pod_name(case: Case, node_index: int) -> str:
    return f"c{case.index}-n{node_index}"


def _decided(pod: Obj) -> bool | None:
    outcome = scheduling_outcome(pod)
    return None if outcome is None else outcome[0]


def claim_object(name: str, namespace: str, spec: Obj) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def decisions_for(kube: Kube, namespace: str, names: Mapping[str, Any]) -> Callable[[], Awaitable[dict[str, bool] | None]]:
    """A probe: every named pod's scheduling outcome, once the scheduler has decided on all."""
    async def probe() -> dict[str, bool] | None:
        live = {p["metadata"]["name"]: _decided(p) async for p in kube.list(POD, namespace)}
        return {name: bool(live[name]) for name in names} if all(live.get(n) is not None for n in names) else None
    return probe


async def bounded(limit: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(job: Any) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(job) for job in jobs))


async def set_binding_conditions(kube: Kube, namespace: str, stop: asyncio.Event) -> int:
    """The controller a device with binding conditions waits for: once the scheduler has allocated
    such a device (it then waits in PreBind), set its conditions True in the claim's
    status.devices. Returns how many claims it did that for."""
    done: set[str] = set()
    patched = 0
    while not stop.is_set():
        async for claim in kube.list(CLAIM, namespace):
            uid = claim["metadata"]["uid"]
            allocation = (claim.get("status") or {}).get("allocation")
            if uid in done or not allocation:
                continue
            done.add(uid)
            waiting = [r for r in allocation["devices"].get("results") or [] if r.get("bindingConditions")]
            if not waiting:
                continue
            entries: dict[tuple[str, ...], Obj] = {}
            for result in waiting:
                entry = {"driver": result["driver"], "pool": result["pool"], "device": result["device"],
                         "conditions": [{"type": c, "status": "True", "reason": "SetByTest", "message": "",
                                         "lastTransitionTime": "2026-01-01T00:00:00Z"}
                                        for c in result["bindingConditions"]]}
                if result.get("shareID"):
                    entry["shareID"] = result["shareID"]
                entries[(entry["driver"], entry["pool"], entry["device"], entry.get("shareID", ""))] = entry
            await kube.patch(CLAIM, claim["metadata"]["name"], {"status": {"devices": list(entries.values())}},
                             namespace=namespace, subresource="status")
            patched += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
    return patched


def reuses(pod: str) -> bool:
    """Whether the pod is one that uses a holder's claim (allocated already)."""
    return pod.startswith("u")


def case_pods(cases: list[Case], namespace: str, held: Mapping[str, bool]) -> tuple[
        dict[str, tuple[Case, str]], dict[str, dict[str, Obj]], list[Obj], list[Obj]]:
    """The pods to explain, (case, node) by name: each case's on each of its nodes (its claim, or
    its template's, and its second claim), and where the case says so, one per node that uses the
    first holder claim the scheduler allocated on the case's first node; each pod's claims as
    :func:`pinned_pod_with` takes them (none where the pod asks for extended resources alone); the
    claims and the templates to create."""
    pods: dict[str, tuple[Case, str]] = {}
    sources: dict[str, dict[str, Obj]] = {}
    claims: list[Obj] = []
    templates: list[Obj] = []
    for case in cases:
        if case.from_template and case.claim_used:
            templates.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                              "metadata": {"name": f"t{case.index}", "namespace": namespace},
                              "spec": {"spec": case.claim_spec}})
        for i, node in enumerate(case.nodes):
            name = pod_name(case, i)
            pods[name] = (case, node)
            sources[name] = {}
            if not case.claim_used:  # extended resources alone: the scheduler makes the pod's only claim
                continue
            if case.from_template:
                sources[name] = {"gpus": {"resourceClaimTemplateName": f"t{case.index}"}}
            else:
                claims.append(claim_object(name, namespace, case.claim_spec))
                sources[name] = {"gpus": {"resourceClaimName": name}}
            if case.second_claim_spec:
                claims.append(claim_object(f"{name}-b", namespace, case.second_claim_spec))
                sources[name]["more"] = {"resourceClaimName": f"{name}-b"}
        first_holder = f"h{case.index}-0-n0"
        if case.reuse and held.get(first_holder):
            for i, node in enumerate(case.nodes):
                pods[f"u{case.index}-n{i}"] = (case, node)
                sources[f"u{case.index}-n{i}"] = {"gpus": {"resourceClaimName": first_holder}}
    return pods, sources, claims, templates


def case_pod(name: str, namespace: str, case: Case, node: str, sources: Mapping[str, Obj]) -> Obj:
    """The pod, gated: its claims, and its case's containers where it asks for extended resources
    (not a pod that uses a holder's claim)."""
    if reuses(name) or case.extended_resource is None:
        return pinned_pod_with(name, namespace, node, sources, gate=GATE)
    return pinned_pod_with(name, namespace, node, sources, gate=GATE, containers=case.containers,
                           init_containers=case.init_containers)


def extended_pod(name: str, case: Case) -> bool:
    """Whether the pod asks for extended resources (the scheduler builds a claim for it)."""
    return case.extended_resource is not None and not reuses(name)


def claims_of(kube: Kube, namespace: str, pods: Mapping[str, Any]) -> Callable[[], Awaitable[dict[str, list[str]] | None]]:
    """A probe: the names of every pod's claims, once every template's claim exists (the claim the
    scheduler builds for extended resources is not among them: it exists once the pod is placed)."""
    async def probe() -> dict[str, list[str]] | None:
        found = {p["metadata"]["name"]: claim_names(p) async for p in kube.list(POD, namespace)}
        ready = {name: found.get(name) for name in pods}
        return {name: names for name, names in ready.items() if names is not None} \
            if all(names is not None for names in ready.values()) else None
    return probe


@dataclass
class State:
    """What the scheduler saw when it decided on the case pods, read back from the cluster."""

    classes: list[Obj]
    slices: dict[str, list[Obj]]  # by driver
    claims: dict[str, Obj]  # by name
    nodes: dict[str, Obj]  # by name, metadata only
    rules: dict[str, list[Obj]]  # DeviceTaintRules by the driver they select


def _strip(slices: list[Obj], what: str) -> list[Obj]:
    """The slices without their taints or their counter consumption."""
    stripped = copy.deepcopy(slices)
    for s in stripped:
        for device in s["spec"].get("devices") or []:
            device.pop("taints" if what == "taints" else "consumesCounters", None)
    return stripped


async def allocatable(helper: AllocatorHelper, state: State, case: Case, node: str, claims: list[str],
                      without: str | None = None, extra: Sequence[Obj] = ()) -> tuple[bool, str | None]:
    """Whether Kubernetes' allocator (the cluster's release) allocates a pod's ``claims`` (and the
    ``extra`` claim objects: the one explain built for its extended resources) on ``node`` on the
    state the scheduler saw, or with the taints (the devices' and the DeviceTaintRules'), the rules
    alone, the counters or the other claims (``without``) taken away; and the allocator's error, if
    any."""
    slices = state.slices[case.driver]
    if without in ("taints", "counters"):
        slices = _strip(slices, without)
    rules = [] if without in ("taints", "rules") else state.rules.get(case.driver, [])
    others = [] if without == "claims" else [c for name, c in state.claims.items() if name not in claims
                                              and any(r.get("driver") == case.driver for r in _results(c))]
    pending = [{k: v for k, v in state.claims[claim].items() if k != "status"} for claim in claims] + list(extra)
    names = {c["metadata"]["name"] for c in case.classes}
    classes = [c for c in state.classes if c["metadata"]["name"] in names]
    (outcome,) = await helper.allocate(classes=classes, slices=slices, allocated_claims=others,
                                       claims=pending, nodes=[state.nodes[node]], device_taint_rules=rules)
    return outcome.results is not None and not outcome.error, outcome.error


def _results(claim: Obj | None) -> list[Obj]:
    allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
    return allocation.get("devices", {}).get("results") or []


def _devices(slices: list[Obj]) -> dict[tuple[str, str], Obj]:
    return {(s["spec"]["pool"]["name"], d["name"]): d for s in slices for d in s["spec"].get("devices") or []}


def scheduled_facts(case: Case, state: State, claims: list[str]) -> set[str]:
    """What a scheduled pod's allocation shows: a device shared with another claim, a taint
    tolerated, admin access to a device another claim holds, binding conditions, counters shared
    with another claim's partition of the same GPU."""
    devices = _devices(state.slices[case.driver])
    mine = [result for claim in claims for result in _results(state.claims[claim])]
    held: dict[tuple[str, str], int] = Counter()
    counter_sets: set[tuple[str, str]] = set()
    for name, other in state.claims.items():
        if name in claims:
            continue
        for result in _results(other):
            if result.get("driver") != case.driver or result.get("adminAccess"):
                continue
            held[(result["pool"], result["device"])] += 1
            for use in (devices.get((result["pool"], result["device"])) or {}).get("consumesCounters") or []:
                counter_sets.add((result["pool"], use["counterSet"]))
    facts = set()
    for result in mine:
        key = (result["pool"], result["device"])
        device = devices.get(key) or {}
        if result.get("shareID") and held[key]:
            facts.add("shared a device")
        if any(t.get("effect") in EFFECTFUL for t in device.get("taints") or []):
            facts.add("tolerated a taint")
        if any(rule["spec"]["taint"].get("effect") in EFFECTFUL and rule_selects(rule, case.driver, *key)
               for rule in state.rules.get(case.driver, [])):
            facts.add("tolerated a rule's taint")
        if result.get("adminAccess") and held[key]:
            facts.add("admin access to a device in use")
        if result.get("bindingConditions"):
            facts.add("binding conditions")
        if any((result["pool"], use["counterSet"]) in counter_sets for use in device.get("consumesCounters") or []):
            facts.add("shared counters")
    return facts


async def unschedulable_facts(helper: AllocatorHelper, case: Case, state: State, node: str,
                              claims: list[str], extra: Sequence[Obj] = ()) -> set[str]:
    """What kept an unschedulable pod off its node: the allocator's error, or the one thing whose
    removal lets the allocator place it (other claims' devices or shares, the taints, the counters).
    ``extra``: the claim explain built for the pod's extended resources (the scheduler creates its
    own only for a pod it places)."""
    fits, error = await allocatable(helper, state, case, node, claims, extra=extra)
    if error:
        return {"allocator error"}
    if fits:
        return {"the allocator places it"}  # disagrees with the scheduler: reported with the mismatch
    facts = set()
    for without, fact in (("claims", "in use"), ("taints", "untolerated taints"), ("rules", "untolerated rule taints"),
                          ("counters", "counters exhausted")):
        if without == "rules" and not state.rules.get(case.driver):
            continue
        if (await allocatable(helper, state, case, node, claims, without, extra))[0]:
            facts.add(fact)
    return facts


async def read_state(kube: Kube, namespace: str, cases: list[Case]) -> State:
    drivers = {case.driver for case in cases}
    names = {c["metadata"]["name"] for case in cases for c in case.classes}
    slices: dict[str, list[Obj]] = {driver: [] for driver in drivers}
    async for s in kube.list(SLICE):
        if s["spec"]["driver"] in drivers:
            slices[s["spec"]["driver"]].append(s)
    rules: dict[str, list[Obj]] = {}
    if any(case.taint_rules for case in cases):
        async for rule in kube.list(TAINT_RULE):
            driver = ((rule.get("spec") or {}).get("deviceSelector") or {}).get("driver")
            if driver in drivers:
                rules.setdefault(str(driver), []).append(rule)
    return State(classes=[c async for c in kube.list(DEVICE_CLASS) if c["metadata"]["name"] in names],
                 slices=slices,
                 claims={c["metadata"]["name"]: c async for c in kube.list(CLAIM, namespace)},
                 nodes={n["metadata"]["name"]: n async for n in kube.list(NODE, metadata_only=True)},
                 rules=rules)


def stored_features(case: Case, state: State, claims: list[str]) -> set[str]:
    found = slice_features(state.slices[case.driver]) | ({"taint-rules"} if state.rules.get(case.driver) else set())
    for claim in claims:
        found |= claim_features(state.claims[claim]["spec"])
    for device_class in state.classes:
        if device_class["metadata"]["name"] == case.device_class["metadata"]["name"]:
            found |= class_features(device_class)
    return found


def generated_features(case: Case) -> set[str]:
    """What the case's objects carry as generated (its pods' claims only where they use them)."""
    claims = (claim_features(case.claim_spec) | claim_features(case.second_claim_spec or {})
              if case.claim_used else set())
    return (slice_features(case.slices) | claims | class_features(case.device_class)
            | ({"taint-rules"} if case.taint_rules else set()))


@dataclass
class Explained:
    """Explain's verdict on a pod, as the test compares it."""

    satisfiable: bool
    conclusion: str
    extended: ExtendedReport | None  # the claim explain built for the pod's extended resources


def extended_claim_stub(name: str, namespace: str, report: ExtendedReport | None) -> list[Obj]:
    """The claim explain built for a pod's extended resources, as a claim object to allocate."""
    if report is None or not report.requests:
        return []
    return [claim_object(f"{name}-extended-by-explain", namespace, {"devices": {"requests": report.requests}})]


def request_key(request: Mapping[str, Any]) -> tuple[str, str, int, str]:
    """What the test compares of an extended-resource claim's request."""
    exactly = request.get("exactly") or {}
    return (str(request.get("name")), str(exactly.get("deviceClassName")), int(exactly.get("count") or 1),
            str(exactly.get("allocationMode") or "ExactCount"))


def mapping_key(mapping: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(mapping.get("containerName")), str(mapping.get("resourceName")), str(mapping.get("requestName")))


def extended_disagreement(name: str, case: Case, node: str, pod: Obj | None, explained: Explained,
                          scheduled: bool, state: State, sibling: tuple[str, Obj] | None) -> str | None:
    """Where the claim explain built for an extended-resource pod is not the scheduler's: for a pod
    the scheduler placed, the claim it created (requests) and the pod's request mappings; for one
    it did not, the claim it created for ``sibling`` (a pod of the same case it placed)."""
    report = explained.extended
    problems: list[str] = []
    created = extended_claim_name(pod)
    if report is None:
        problems.append("explain built no claim for the pod's extended resources")
    if scheduled:
        claim = state.claims.get(created) if created else None
        if claim is None:
            status = ((pod or {}).get("status") or {}).get("extendedResourceClaimStatus")
            problems.append(f"the scheduler placed the pod, but its extended-resource claim {created!r} is not "
                            f"there (status {json.dumps(status)})")
        elif report is not None:
            theirs = [request_key(r) for r in claim["spec"]["devices"].get("requests") or []]
            ours = [request_key(r) for r in report.requests]
            if sorted(theirs) != sorted(ours):
                problems.append(f"requests: the scheduler's claim {created} has {theirs}, explain built {ours}")
            status = ((pod or {}).get("status") or {}).get("extendedResourceClaimStatus") or {}
            their_mappings = {mapping_key(m) for m in status.get("requestMappings") or []}
            our_mappings = {mapping_key(m) for m in report.mappings}
            if their_mappings != our_mappings:
                problems.append(f"request mappings: the pod's status has {sorted(their_mappings)}, "
                                f"explain gave {sorted(our_mappings)}")
    elif report is not None and sibling is not None:
        other, claim = sibling
        theirs = [request_key(r) for r in claim["spec"]["devices"].get("requests") or []]
        ours = [request_key(r) for r in report.requests]
        if sorted(theirs) != sorted(ours):
            problems.append(f"requests: the scheduler's claim {claim['metadata']['name']} for {other} "
                            f"(same containers, another node) has {theirs}, explain built {ours} for this pod")
    if not problems:
        return None
    return "\n".join([f"{name} on {node} (case {case.index}, {case.description}): the extended-resource claim",
                      *(f"  {p}" for p in problems),
                      f"  explain's report: {_report_json(report)}"])


def _report_json(report: ExtendedReport | None) -> str:
    if report is None:
        return "none"
    return json.dumps({"claim": report.claim, "requests": report.requests, "mappings": report.mappings,
                       **{k: getattr(report, k) for k in ("resources", "classes", "device_plugin_nodes", "unfit")
                          if hasattr(report, k)}}, sort_keys=True)


async def test_explain_agrees_with_the_scheduler_on_random_cases(kube: Kube, namespace: str) -> None:
    minor = await kube.server_minor()
    assert minor is not None
    run_id = secrets.token_hex(3)
    cases = generate(SEED, CASES, run_id, minor=minor)
    nodes = [name for case in cases for name in case.nodes]
    pods: dict[str, tuple[Case, str]] = {}
    clock = asyncio.get_running_loop().time
    started = clock()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = clock() - started - sum(phases.values())

    stop = asyncio.Event()
    controller = asyncio.create_task(set_binding_conditions(kube, namespace, stop), name="binding conditions")
    try:
        await kube.patch(NAMESPACE, namespace, {"metadata": {"labels": {ADMIN_ACCESS_LABEL: "true"}}})
        # The rules first: the scheduler must know them before it can place a holder.
        await bounded(8, [kube.request("POST", TAINT_RULE.path(), body=rule)
                          for case in cases for rule in case.taint_rules])
        await bounded(8, [create_fake_node(kube, name) for name in nodes])
        await bounded(8, [kube.create(s) for case in cases for s in case.slices]
                      + [kube.create(c) for case in cases for c in case.classes])
        holders = {f"h{case.index}-{j}-n{i}": (case, node, spec) for case in cases
                   for j, spec in enumerate(case.holder_specs) for i, node in enumerate(case.nodes)}
        await bounded(8, [kube.create(claim_object(name, namespace, spec)) for name, (_, _, spec) in holders.items()])
        await bounded(8, [kube.create(pinned_pod(name, namespace, node, name))
                          for name, (_, node, _) in holders.items()])
        phase("objects")
        held = await wait_for(decisions_for(kube, namespace, holders), timeout=120, interval=0.5,
                              what=f"the scheduler's decision on {len(holders)} holder pods")
        phase("holders")
        pods, sources, claims, templates = case_pods(cases, namespace, held)
        await bounded(8, [kube.create(template) for template in templates])
        await bounded(8, [kube.create(claim) for claim in claims])
        await bounded(8, [kube.create(case_pod(name, namespace, case, node, sources[name]))
                          for name, (case, node) in pods.items()])
        # A template's claim is created by kube-controller-manager's resourceclaim controller.
        pod_claims = await wait_for(claims_of(kube, namespace, pods), timeout=60, interval=0.5,
                                    what="the ResourceClaims of the pods' templates")

        async with AllocatorHelper(minor) as helper:
            # Explain each pod as `gpudra explain pod` would, while its gate holds it.
            verdicts = dict(zip(pods, await bounded(4, [
                _explain(kube, helper, namespace, name, case.driver) for name, (case, _) in pods.items()])))
            before = await read_state(kube, namespace, cases)
            phase("explain")
            await bounded(8, [kube.patch(POD, name, {"spec": {"schedulingGates": None}}, namespace=namespace)
                              for name in pods])

            decisions = await wait_for(decisions_for(kube, namespace, pods), timeout=180, interval=0.5,
                                       what=f"the scheduler's decision on {len(pods)} pods")
            # An unschedulable pod the scheduler would have placed once its informers caught up
            # would show up bound now: read once more after every decision is in.
            live = {p["metadata"]["name"]: p async for p in kube.list(POD, namespace)}
            final = {name: _decided(pod) for name, pod in live.items()}
            after = await read_state(kube, namespace, cases)
            # The claims the scheduler created for the extended resources of the pods it placed.
            created = {name: extended_claim_name(live.get(name)) for name, (case, _) in pods.items()
                       if extended_pod(name, case)}
            phase("scheduler")

            # The API server keeps exactly the features whose gates are on in this release.
            dropped = []
            for name, (case, _) in pods.items():
                if reuses(name):
                    continue
                expected = enabled_features(generated_features(case), minor)
                stored = stored_features(case, after, pod_claims[name])
                if stored != expected:
                    dropped.append(f"{name}: generated {sorted(case.features)}, stored {sorted(stored)}, "
                                   f"expected {sorted(expected)} on 1.{minor}")

            facts: dict[str, set[str]] = {}
            for name, (case, node) in pods.items():
                if reuses(name):
                    facts[name] = {"claim allocated already"}
                elif decisions[name]:
                    mine = pod_claims[name] + [c for c in [created.get(name)] if c and c in after.claims]
                    facts[name] = scheduled_facts(case, after, mine)
                else:
                    stub = (extended_claim_stub(name, namespace, verdicts[name].extended)
                            if extended_pod(name, case) else [])
                    facts[name] = await unschedulable_facts(helper, case, after, node, pod_claims[name], stub)

            mismatches = []
            for name, (case, node) in pods.items():
                if verdicts[name].satisfiable != decisions[name] or final[name] != decisions[name]:
                    mismatches.append(await _mismatch(kube, helper, namespace, name, case, node, pod_claims[name],
                                                      before, after, verdicts[name], decisions[name], final[name],
                                                      live.get(name)))
            # The claim explain built for extended resources is the one the scheduler created.
            compared = 0
            for name, (case, node) in pods.items():
                if not extended_pod(name, case):
                    continue
                sibling = next(((other, after.claims[claim]) for other, claim in created.items()
                                if claim and claim in after.claims and other != name
                                and pods[other][0] is case and decisions[other]), None)
                problem = extended_disagreement(name, case, node, live.get(name), verdicts[name], decisions[name],
                                                after, sibling)
                compared += int(decisions[name] or sibling is not None)
                if problem:
                    mismatches.append(problem)
        stop.set()
        bound_by_test = await controller
        phase("analysis")

        print(_summary(minor, cases, pods, decisions, facts, held, bound_by_test, phases, compared))
        assert not dropped, "stored objects do not carry what this release keeps:\n" + "\n".join(dropped)
        assert not mismatches, f"explain disagrees with the scheduler on {len(mismatches)} of {len(pods)} pods " \
            "(verdicts, extended-resource claims):\n" + "\n\n".join(mismatches)
        # The generator must exercise both outcomes, the error path and each feature this release
        # has on, or the test proves little.
        missing = [need for need in _needs(minor) if not _met(need, pods, decisions, facts)]
        assert not missing, f"the cases did not exercise: {missing} (more cases or another seed)"
    finally:
        stop.set()
        if not controller.done():
            controller.cancel()
        await asyncio.gather(controller, return_exceptions=True)
        for case in cases:
            async for found in kube.list(SLICE, field_selector=f"spec.driver={case.driver}"):
                await kube.delete(SLICE, found["metadata"]["name"])
            for device_class in case.classes:
                await kube.delete(DEVICE_CLASS, device_class["metadata"]["name"])
            for rule in case.taint_rules:
                await kube.delete(TAINT_RULE, rule["metadata"]["name"])
        await bounded(8, [delete_node(kube, name) for name in nodes])


# (description, case kinds or features the pod's case must have ("" for any), outcome, fact needed)
Need = tuple[str, str, bool, str | None]


def _needs(minor: int) -> list[Need]:
    needs: list[Need] = [
        ("scheduled", "", True, None), ("unschedulable", "", False, None),
        ("an allocator (CEL) error", "", False, "allocator error"), ("devices in use", "", False, "in use"),
        ("admin access scheduled", "admin", True, None),
        ("a claim from a template scheduled", "template", True, None),
        ("two claims scheduled", "two claims", True, None), ("two claims unschedulable", "two claims", False, None),
        ("a holder's allocated claim on its node", "reuse", True, None),
        ("a holder's allocated claim on another node", "reuse", False, None),
    ]
    if minor >= 36:
        needs += [
            ("consumable: scheduled", "consumable", True, None),
            ("consumable: a device shared with a holder", "consumable", True, "shared a device"),
            ("consumable: unschedulable", "consumable", False, None),
            ("consumable: shares or capacity in use", "consumable", False, "in use"),
            ("counters: scheduled", "counters", True, None),
            ("counters: a GPU's counters shared with a holder's partition", "counters", True, "shared counters"),
            ("counters: exhausted", "counters", False, "counters exhausted"),
            ("taints: a taint tolerated", "taints", True, "tolerated a taint"),
            ("taints: untolerated", "taints", False, "untolerated taints"),
            ("distinctAttribute: scheduled", "distinctAttribute", True, None),
            ("distinctAttribute: unschedulable", "distinctAttribute", False, None),
            ("binding conditions: bound after PreBind", "binding", True, "binding conditions"),
            ("extended resources: scheduled", "extended", True, None),
            ("extended resources: unschedulable", "extended", False, None),
            ("extended resources: an init container's, scheduled", "extended init", True, None),
        ]
    if minor >= 37:
        needs += [
            ("DeviceTaintRules: a rule's taint tolerated", "taint-rules", True, "tolerated a rule's taint"),
            ("DeviceTaintRules: untolerated", "taint-rules", False, "untolerated rule taints"),
        ]
    return needs


def _met(need: Need, pods: Mapping[str, tuple[Case, str]], decisions: Mapping[str, bool],
         facts: Mapping[str, set[str]]) -> bool:
    _, feature, outcome, fact = need
    return any((not feature or feature in case.features) and decisions[name] == outcome
               and (fact is None or fact in facts[name]) and reuses(name) == (feature == "reuse")
               for name, (case, _) in pods.items())


def _summary(minor: int, cases: list[Case], pods: Mapping[str, tuple[Case, str]], decisions: Mapping[str, bool],
             facts: Mapping[str, set[str]], held: Mapping[str, bool], bound_by_test: int,
             phases: Mapping[str, float], compared: int = 0) -> str:
    scheduled = sum(decisions.values())
    extended = [name for name, (case, _) in pods.items() if extended_pod(name, case)]
    placed = sum(decisions[name] for name in extended)
    lines = [f"\n[explain-diff] Kubernetes 1.{minor}, seed {SEED}: {len(cases)} cases, {len(pods)} pods, "
             f"{scheduled} scheduled, {len(pods) - scheduled} not ({sum(held.values())} of {len(held)} holders "
             f"scheduled first; binding conditions set on {bound_by_test} claims); {sum(phases.values()):.1f}s: "
             + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases.items())]
    if extended:
        lines.append(f"  extended-resource pods: {len(extended)}, {placed} scheduled, {len(extended) - placed} not; "
                     f"explain's claim compared with the scheduler's for {compared}")
    by_feature: dict[str, Counter[str]] = {}
    for name, (case, _) in pods.items():
        on = enabled_features(case.features, minor)
        labels = ({"uses holder's claim"} if reuses(name) else
                  {f if f in on else f"{f} (off)" for f in case.features - {"reuse"}} | {f"kind {case.kind}"})
        for feature in sorted(labels):
            counts = by_feature.setdefault(feature, Counter())
            counts["scheduled" if decisions[name] else "not"] += 1
            counts.update(facts[name])
    for feature, counts in sorted(by_feature.items()):
        lines.append(f"  {feature:20} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


async def _mismatch(kube: Kube, helper: AllocatorHelper, namespace: str, name: str, case: Case, node: str,
                    claims: list[str], before: State, after: State, verdict: Explained, decision: bool,
                    final: bool | None, pod: Obj | None = None) -> str:
    """Everything needed to debug one disagreement."""
    live = pod or await kube.get(POD, name, namespace)
    message = next((c.get("message") for c in (live or {}).get("status", {}).get("conditions") or []
                    if c.get("type") == "PodScheduled"), "")
    pending = [claim for claim in claims if not _results(before.claims.get(claim))]
    stub = extended_claim_stub(name, namespace, verdict.extended) if extended_pod(name, case) else []
    fits, error = (await allocatable(helper, before, case, node, pending, extra=stub) if pending or stub
                   else (True, None))
    names = {c["metadata"]["name"] for c in case.classes}
    node_slices = [s for s in after.slices[case.driver] if s["spec"]["pool"]["name"] == node]
    others = {n: _results(c) for n, c in before.claims.items()
              if n not in claims and any(r.get("driver") == case.driver for r in _results(c))}
    return "\n".join([
        f"{name} on {node} (case {case.index}, {case.description}; features {sorted(case.features)}):",
        f"  explain says {verdict.satisfiable}: {verdict.conclusion}",
        f"  the scheduler says {decision} (then {final}): {message}",
        f"  Kubernetes' allocator on the state explain read: {'fits' if fits else 'does not fit'}"
        + (f", error {error}" if error else "") + ("" if pending or stub else " (no claim pending)")
        + (" (with explain's extended-resource claim)" if stub else ""),
        *(f"  claim {claim} (stored): spec {json.dumps(before.claims[claim]['spec'], sort_keys=True)}, "
          f"allocation then {json.dumps(_results(before.claims.get(claim)), sort_keys=True)}, "
          f"now {json.dumps(_results(after.claims.get(claim)), sort_keys=True)}" for claim in claims),
        f"  other claims' results on this driver: {json.dumps(others, sort_keys=True)}",
        f"  classes: {json.dumps([c['spec'] for c in before.classes if c['metadata']['name'] in names], sort_keys=True)}",
        f"  the node's slices (stored): {json.dumps([s['spec'] for s in node_slices], sort_keys=True)}",
        f"  DeviceTaintRules: {json.dumps([r['spec'] for r in before.rules.get(case.driver, [])], sort_keys=True)}",
        *(_extended_lines(case, live, verdict, after) if extended_pod(name, case) else []),
    ])


def _extended_lines(case: Case, pod: Obj | None, verdict: Explained, after: State) -> list[str]:
    spec = (pod or {}).get("spec") or {}
    created = extended_claim_name(pod)
    claim = after.claims.get(created) if created else None
    init = [(c["name"], c.get("restartPolicy"), c.get("resources")) for c in spec.get("initContainers") or []]
    return [
        f"  extended resource {case.extended_resource}: init containers {json.dumps(init)}, "
        f"containers {json.dumps([(c['name'], c.get('resources')) for c in spec.get('containers') or []])}",
        f"  explain's extended-resource claim: {_report_json(verdict.extended)}",
        f"  the pod's extendedResourceClaimStatus: "
        f"{json.dumps(((pod or {}).get('status') or {}).get('extendedResourceClaimStatus'), sort_keys=True)}",
        f"  the scheduler's claim {created}: "
        + (f"spec {json.dumps(claim['spec'], sort_keys=True)}, allocation {json.dumps(_results(claim), sort_keys=True)}"
           if claim else "none"),
    ]


async def _explain(kube: Kube, helper: AllocatorHelper, namespace: str, name: str, driver: str) -> Explained:
    snapshot = await read_snapshot(kube, "pod", namespace, name, driver)
    verdict = await explain_snapshot(snapshot, driver, helper)
    return Explained(verdict.satisfiable, verdict.conclusion, verdict.extended)
