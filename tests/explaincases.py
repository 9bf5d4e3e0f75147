"""Random, seedable cases for the differential test of `gpudra explain` against the real scheduler
(tests/integration/test_explain_differential.py): inventories from the shipped GPU profiles,
DeviceClasses from the operator's templates, claims with random selectors over the published
attributes and capacities (some of which fail on some devices: a missing attribute is a CEL
error), counts, ``allocationMode: All``, ``firstAvailable`` and ``matchAttribute`` constraints.

With ``minor`` (the cluster's Kubernetes 1.<minor>), the DRA features that came after those are
generated too: three random case kinds in turn (classic, consumable, partitioned) with overlays on
any kind, and every fourth case a directed scenario (:data:`SCENARIOS`, random in its details)
that makes each feature come out both ways whatever the seed:

* consumable capacity (KEP-5075): whole GPUs shared as the agent publishes them
  (:func:`gpudra_core.consumable.share_devices`: ``allowMultipleAllocations`` and a memory
  ``requestPolicy`` in its validRange form, optionally a ``shares`` capacity), or with the memory
  policy rewritten to ``validValues``, to a default alone, or to none; claims and holder claims
  that ask for ``capacity.requests`` (memory, shares), holders that take shares beforehand;
* partitionable devices (KEP-4815): per node a pool of one or two counter slices
  (``sharedCounters`` only: a slice carries counters or devices, never both) and one or all device
  slices, MIG-like: each GPU's whole device consumes all of its counter set, its 1g/2g/3g/4g
  placements consume compute, memory and the memory slices they cover; sometimes a node-wide
  ``links`` set the whole GPUs share too; ``resourceSliceCount`` counts every slice; holders take
  partitions or whole GPUs, so the counters left decide;
* device taints (KEP-5055): NoSchedule, NoExecute and None on some devices (any kind), requests
  with tolerations (Exists or Equal, with or without a key or effect, matching or not);
* DeviceTaintRules (KEP-5055, 1.37+ only: resource.k8s.io/v1 serves them from 1.37, where
  DRADeviceTaintRules is on): taints on the case's devices by driver, pool or device name;
* admin access (KEP-5018) on some requests (the test labels its namespace for it);
* ``distinctAttribute`` constraints (1.36+ only: 1.35's API server drops the field with
  DRAConsumableCapacity off and then refuses the constraint that is left empty);
* binding conditions (KEP-5007) on some devices, with ``bindsToNode`` sometimes: the test plays
  the controller that sets the conditions, so a pod the allocator places gets bound;
* and in how pods use claims: a second claim in some pods (both allocated together), a claim from
  a ResourceClaimTemplate, pods on every node that use a holder's claim already allocated;
* extended resources backed by DRA (KEP-5004, 1.36+ only: 1.35's API server drops
  ``extendedResourceName`` with DRAExtendedResource off): the case's class maps
  ``<driver>/gpu`` (its ``extendedResourceName``) or the pod asks for its implicit name
  ``deviceclass.resource.kubernetes.io/<class>``, and the pod's containers ask for it in
  ``resources`` (requests = limits): one container, two, a non-sidecar init container asking more
  or less than the regular ones (the scheduler reuses their requests and tops up), a sidecar
  (``restartPolicy: Always``, long-lived), sometimes with other resources (cpu, memory) whose names
  shift the request names; the pod has no claim of its own, or its claim too. The scheduler builds
  the claim for them (``container-<i>-request-<j>``), allocates it with the pod's claims and
  creates it when it binds the pod. The "extended" scenario makes that claim fit an 8-GPU node and
  not a 1-GPU one; on the random cases it is an overlay drawn from a stream of its own (the other
  draws stay as they were).

Every case is a valid object on every supported release: where a feature's gate is off (1.35:
consumable capacity, partitionable devices, taints, binding conditions), the API server drops its
fields, and explain must agree with that release's scheduler on what is left. Per release
(:data:`ON_BY_DEFAULT_FROM`): 1.35 runs the classic features, admin access and firstAvailable as
such, the others as dropped fields (a counter slice stays as an empty slice of its pool); 1.36 all
but DeviceTaintRules; 1.37 all. Not generated: extended-resource requests on 1.35 (its API server
drops the class's ``extendedResourceName``, and its scheduler leaves extended resources to device
plugins), nodes whose ``allocatable`` lists the extended resource (a device plugin's, which
NodeResourcesFit decides, not DRA), DeviceTaintRules before 1.37 (1.35 and 1.36 serve them only in
alpha/beta versions, with DRADeviceTaintRules off), list-type attributes (alpha), per-device node
selection.

Pure: :func:`generate` returns plain API objects; the test applies them."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from gpudra_core.consumable import ConsumableCapacity, share_devices
from gpudra_core.devicemodel import DeviceTaint
from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_core.quantity import format_quantity, parse_quantity
from gpudra_driver.publishing.slices import build_slices, slice_name
from gpudra_driver.deviceapi import taint_to_api
from gpudra_operator.deviceclasses import render_device_class

Obj = dict[str, Any]

PROFILES = ("dgx-a100-40gb", "dgx-h100", "l4x2", "a100-80gb-mig", "h200")
WHOLE_GPU_PROFILES = ("dgx-a100-40gb", "dgx-h100", "l4x2", "h200")
CLASS_TEMPLATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("all", {}), ("full-gpu", {}), ("mig", {}), ("mig", {"profile": "1g.10gb"}),
    ("min-memory", {"memory": "24Gi"}), ("min-memory", {"memory": "40Gi"}), ("min-memory", {"memory": "80Gi"}),
    ("min-compute-capability", {"version": "8.9"}), ("architecture", {"architecture": "Hopper"}),
)
# The newer kinds pick wider classes, fewer selectors and smaller counts, so that holders and the
# feature itself, not a narrow class, decide most of their pods.
SHARED_CLASS_TEMPLATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("all", {}), ("all", {}), ("full-gpu", {}), ("full-gpu", {}), ("min-memory", {"memory": "24Gi"}),
    ("min-memory", {"memory": "40Gi"}), ("min-compute-capability", {"version": "8.9"}),
    ("architecture", {"architecture": "Hopper"}),
)
PARTITION_CLASS_TEMPLATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("all", {}), ("all", {}), ("mig", {}), ("mig", {}), ("full-gpu", {}), ("min-memory", {"memory": "40Gi"}),
    ("mig", {"profile": ""}), ("mig", {"profile": ""}), ("mig", {"profile": ""}),  # one the case's GPUs have
)
FEATURE_COUNTS = (1, 1, 1, 1, 1, 2, 2, 3, 4)
FEATURE_SELECTOR_COUNTS = (0, 0, 0, 0, 0, 1, 1, 2)
KINDS = ("classic", "consumable", "partitioned")
# The first Kubernetes minor whose API server keeps (and whose scheduler runs) each feature's
# fields with its default feature gates; features not named: every supported release.
ON_BY_DEFAULT_FROM = {"consumable": 36, "capacity-requests": 36, "distinctAttribute": 36,  # DRAConsumableCapacity
                      "counters": 36,  # DRAPartitionableDevices
                      "taints": 36, "tolerations": 36,  # DRADeviceTaints
                      "binding": 36,  # DRADeviceBindingConditions (with DRAResourceClaimDeviceStatus)
                      "taint-rules": 37,  # DRADeviceTaintRules, and DeviceTaintRule in resource.k8s.io/v1
                      "extended": 36, "extendedResourceName": 36,  # DRAExtendedResource
                      "extended init": 36, "extended sidecar": 36, "extended 2 containers": 36, "extended + claim": 36}
# Extended resources (KEP-5004): the share of random cases (1.36+) whose pods ask for them too,
# the seed offset of the stream those draws come from, and the implicit name of a class's resource.
EXTENDED_SHARE = 0.15
EXTENDED_STREAM = 5004
IMPLICIT_EXTENDED_PREFIX = "deviceclass.resource.kubernetes.io/"
GiB = 2**30
MiB = 2**20
TIME_ADDED = "2026-01-01T00:00:00Z"
BINDING_CONDITION = "attached"
BINDING_FAILURE = "failed"
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
# (compute slices, memory slices, first memory slice of each placement) of one GPU's MIG-like
# partitions: 7 compute slices and 8 memory slices in all, as an A100 or H100.
PARTITIONS = ((1, 1, tuple(range(7))), (2, 2, (0, 2, 4)), (3, 4, (0, 4)), (4, 4, (0,)))
MEMORY_SLICES = 8
COMPUTE_SLICES = 7


def _selectors(domain: str) -> list[str]:
    """Selectors over what the agent publishes; the ones naming numaNode or profile fail on
    devices without that attribute (l4x2 and h200 publish no numaNode, whole GPUs no profile)."""
    a, c = f'device.attributes["{domain}"]', f'device.capacity["{domain}"]'
    return [
        f'{c}.memory.compareTo(quantity("40Gi")) >= 0',
        f'{c}.memory.isLessThan(quantity("30Gi"))',
        f'{c}.memory.isGreaterThan(quantity("80G"))',
        f'{a}.index <= 3',
        f'{a}.index == 1',
        f'{a}.productName.startsWith("NVIDIA H")',
        f'{a}.cudaComputeCapability.isGreaterThan(semver("8.5.0"))',
        f'{a}.cudaComputeCapability.compareTo(semver("8.0.0")) == 0',
        f'{a}.type == "mig"',
        f'{a}.numaNode == 0',  # error on l4x2 and h200
        f'{a}.numaNode == 0 || {a}.type == "gpu"',  # error absorbed where type is gpu
        f'has({a}.numaNode) && {a}.numaNode < 4',
        f'{a}.profile == "3g.40gb"',  # error on whole GPUs
        f'"numaNode" in {a} && {a}.numaNode == 1',
        f'cel.bind(g, {a}, g.index % 2 == 0 && g.type == "gpu")',
        f'{a}.architecture in ["Ampere", "Ada Lovelace"]',
        f'device.driver == "{domain}" && {c}.memory.asApproximateFloat() > 2e10',
        # two-variable comprehensions and ordering across numeric types (cel-go extensions)
        f'{a}.exists(k, v, k == "profile" && v == "3g.40gb")',
        f'{c}.transformList(k, v, v.isGreaterThan(quantity("20Gi"))).exists(b, b)',
        f'{a}.transformMap(k, v, k == "index", v).all(k, v, v < 1.5)',
        f'{a}.transformMapEntry(k, v, {{"x": v}}).size() == 1',  # error: key "x" twice
    ]


def _feature_selectors(domain: str) -> list[str]:
    """Selectors over the partitions: profiles and parents (an error on whole GPUs, which have no
    parentIndex; absorbed where the left side decides first)."""
    a = f'device.attributes["{domain}"]'
    return [
        f'{a}.profile == "1g.5gb" || {a}.profile == "1g.10gb"',
        f'{a}.type == "gpu" || {a}.profile.startsWith("3g")',
        f'{a}.parentIndex == 1',  # error on whole GPUs
        f'!has({a}.profile) || {a}.profile.startsWith("2g")',
    ]


@dataclass
class Case:
    index: int
    driver: str
    nodes: dict[str, str]  # node name -> profile
    slices: list[Obj]
    device_class: Obj  # the class the claim's requests name
    claim_spec: Obj  # spec of the claim (one copy per node in the test)
    holder_specs: list[Obj] = field(default_factory=list)  # claims allocated on each node beforehand
    description: str = ""
    kind: str = "classic"
    features: frozenset[str] = frozenset()  # what the objects carry (see generate)
    extra_classes: list[Obj] = field(default_factory=list)  # classes only holders name
    taint_rules: list[Obj] = field(default_factory=list)  # DeviceTaintRules for the case's devices
    second_claim_spec: Obj | None = None  # a second claim the pod uses (allocated with the first)
    from_template: bool = False  # the pod's claim comes from a ResourceClaimTemplate of claim_spec
    reuse: bool = False  # more pods, one per node, that use the first holder's claim of the first node
    # Extended resources backed by DRA: the resource the pod's containers ask for (device_class maps
    # it), its init containers and containers (name, resources with requests = limits, restartPolicy
    # for a sidecar; the test adds the image, and the claims to the first container), and whether
    # the pod uses its claims too (claim_spec, second_claim_spec, the template). containers None:
    # the pod's one container uses the claims alone.
    extended_resource: str | None = None
    init_containers: list[Obj] = field(default_factory=list)
    containers: list[Obj] | None = None
    claim_used: bool = True

    @property
    def classes(self) -> list[Obj]:
        return [self.device_class, *self.extra_classes]


def _request(rng: random.Random, name: str, class_name: str, selectors: list[str], *,
             counts: tuple[int, ...] = (1, 1, 1, 1, 2, 2, 4, 8), selector_counts: tuple[int, ...] = (0, 0, 0, 1, 1, 2),
             all_share: float = 0.12) -> Obj:
    body: Obj = {"deviceClassName": class_name}
    chosen = rng.sample(selectors, k=rng.choice(selector_counts))
    if chosen:
        body["selectors"] = [{"cel": {"expression": e}} for e in chosen]
    if rng.random() < all_share:
        body["allocationMode"] = "All"
    else:
        body["count"] = rng.choice(counts)
    return body


def generate(seed: int, count: int, run_id: str, *, minor: int | None = None) -> list[Case]:
    """``count`` cases from ``seed``; names carry ``run_id`` so runs on one cluster never meet.
    ``minor``: the cluster's Kubernetes 1.<minor>, which decides the fields a case may carry; None:
    the classic cases alone (no field any release treats differently), as before the features."""
    if minor is None:
        return _classic_cases(seed, count, run_id)
    rng = random.Random(seed)
    inventories = {p: discover(FakeNvml(load_profile(p))) for p in PROFILES}
    scenarios = [name for name, since in SCENARIOS.items() if since <= minor]
    # The extended-resource overlays draw from a stream of their own: the other draws stay as they were.
    extended = random.Random(seed + EXTENDED_STREAM) if minor >= ON_BY_DEFAULT_FROM["extended"] else None
    cases = []
    for index in range(count):
        if index % SCENARIO_EVERY == SCENARIO_EVERY - 1:
            cases.append(_scenario_case(rng, index, scenarios[index // SCENARIO_EVERY % len(scenarios)], run_id,
                                        inventories))
        else:
            case = _feature_case(rng, index, KINDS[index % len(KINDS)], run_id, minor, inventories)
            if extended is not None and extended.random() < EXTENDED_SHARE:
                _add_extended(extended, case)
            cases.append(case)
    return cases


def _classic_cases(seed: int, count: int, run_id: str) -> list[Case]:
    rng = random.Random(seed)
    inventories = {p: discover(FakeNvml(load_profile(p))) for p in PROFILES}
    cases = []
    for index in range(count):
        driver = f"c{index}-{run_id}.gpudra.io"
        nodes = {f"x{run_id}-{index}-{n}": rng.choice(PROFILES) for n in range(rng.choice((1, 2, 2, 3)))}
        slices = [s for node, profile in nodes.items() for s in build_slices(driver, node, None, 1, inventories[profile])]
        template, params = rng.choice(CLASS_TEMPLATES)
        class_name = f"{template}-{index}-{run_id}.gpudra.io"
        device_class = render_device_class(class_name, driver, template=template, params=params)
        selectors = _selectors(driver)
        requests: list[Obj] = []
        for r in range(rng.choice((1, 1, 1, 2))):
            if rng.random() < 0.2:
                requests.append({"name": f"r{r}", "firstAvailable": [
                    {"name": f"s{s}", **_request(rng, f"s{s}", class_name, selectors)} for s in range(2)]})
            else:
                requests.append({"name": f"r{r}", "exactly": _request(rng, f"r{r}", class_name, selectors)})
        spec: Obj = {"devices": {"requests": requests}}
        if len(requests) > 1 and rng.random() < 0.5:
            attribute = rng.choice(("numaNode", "productName", "type"))
            spec["devices"]["constraints"] = [{"requests": [r["name"] for r in requests],
                                               "matchAttribute": f"{driver}/{attribute}"}]
        # Some devices already held by another claim: explain must count them as in use.
        holders: list[Obj] = []
        if rng.random() < 0.4:
            holders.append({"devices": {"requests": [{"name": "held", "exactly": {
                "deviceClassName": class_name, "count": rng.choice((1, 1, 2, 4))}}]}})
        cases.append(Case(index, driver, nodes, slices, device_class, spec, holders,
                          description=f"{template}{params or ''} on {list(nodes.values())}"
                                      + (f", {holders[0]['devices']['requests'][0]['exactly']['count']} held on each"
                                         if holders else ""),
                          features=frozenset(slice_features(slices) | claim_features(spec))))
    return cases


# -- the newer features ----------------------------------------------------------------------------

# Directed cases, one in SCENARIO_EVERY (round robin, those the release's API serves): random in
# their details, built so that each feature is seen both ways whatever the seed (the test asserts
# that it was). The first minor each needs to be generated at all.
SCENARIO_EVERY = 4
SCENARIOS = {
    "shares": 35,  # a holder's share of every GPU; the claim's share fits the large GPU, not the small
    "counters shared": 35,  # a holder's 3g partition; the claim's 3g fits the GPU's other half
    "counters exhausted": 35,  # a holder's 1g partition; the whole GPU no longer fits
    "taint tolerated": 35,  # every device tainted; the claim tolerates the taint
    "taint untolerated": 35,  # every device tainted; the claim tolerates another value or nothing
    "distinct": 36,  # two devices with distinct uuids: on an 8-GPU node, not on a 1-GPU one
    "binding": 35,  # devices with binding conditions
    "admin": 35,  # admin access to a device a holder has
    "error": 35,  # a selector that fails on the node's devices (no numaNode): the scheduler's error
    "two claims": 35,  # a GPU in each of two claims (one from a template): on an 8-GPU node, not a 1-GPU one
    "rule tolerated": 37,  # a DeviceTaintRule on all the driver's devices; the claim tolerates it
    "rule untolerated": 37,
    "extended": 36,  # extended resources: the claim the scheduler builds fits an 8-GPU node, not a 1-GPU one
}


def _scenario_case(rng: random.Random, index: int, scenario: str, run_id: str, inventories: dict[str, Any]) -> Case:
    driver = f"c{index}-{run_id}.gpudra.io"
    a = f'device.attributes["{driver}"]'
    key = rng.choice(_taint_keys(driver))
    effect: Literal["NoSchedule", "NoExecute"] = rng.choice(("NoSchedule", "NoExecute"))
    holder: Obj | None = None
    request: Obj = {"count": 1}
    constraints: list[Obj] = []
    rules: list[Obj] = []
    if scenario in ("counters shared", "counters exhausted"):
        profile = rng.choice(("dgx-a100-40gb", "dgx-h100", "h200"))
        nodes = {f"x{run_id}-{index}-0": profile}
        slices, _ = _partitioned_pool(rng, driver, next(iter(nodes)), inventories[profile][:1])
        held = "3g" if scenario == "counters shared" else rng.choice(("1g", "2g"))
        partition = f'{a}.type == "mig" && {a}.profile.startsWith("{{}}")'
        holder = {"count": 1, "selectors": [{"cel": {"expression": partition.format(held)}}]}
        template = "mig" if scenario == "counters shared" else "full-gpu"
        if scenario == "counters shared":
            request["selectors"] = [{"cel": {"expression": partition.format("3g")}}]
    else:
        eight = rng.choice(("dgx-a100-40gb", "dgx-h100"))
        profiles = {"shares": ("h200", "l4x2"), "distinct": (eight, "h200"), "two claims": (eight, "h200"),
                    "error": (rng.choice(("l4x2", "h200")),),
                    "extended": (eight, "h200")}.get(scenario, (rng.choice(WHOLE_GPU_PROFILES),))
        nodes = {f"x{run_id}-{index}-{n}": p for n, p in enumerate(profiles)}
        sharing = ConsumableCapacity(GiB) if scenario in ("shares", "distinct") else None
        slices = [s for node, p in nodes.items()
                  for s in build_slices(driver, node, None, 1, share_devices(inventories[p], sharing)[0])]
        template = "full-gpu"
        devices = [d for s in slices for d in s["spec"].get("devices") or []]
        if scenario == "shares":  # 10Gi of every GPU held: 20Gi more fits 141Gi, not 22Gi
            holder = {"allocationMode": "All", "capacity": {"requests": {"memory": "10Gi"}}}
            request["capacity"] = {"requests": {"memory": "20Gi"}}
        elif scenario == "distinct":
            request = {"count": 2, "capacity": {"requests": {"memory": rng.choice(("1Gi", "5Gi"))}}}
            constraints.append({"requests": ["r0"], "distinctAttribute": f"{driver}/uuid"})
        elif scenario in ("taint tolerated", "taint untolerated"):
            for device in devices:
                device["taints"] = [taint_to_api(DeviceTaint(key, "degraded", effect, TIME_ADDED))]
        elif scenario == "binding":
            for device in devices:
                device["bindingConditions"], device["bindingFailureConditions"] = [BINDING_CONDITION], [BINDING_FAILURE]
                if rng.random() < 0.5:
                    device["bindsToNode"] = True
        elif scenario == "admin":
            holder = {"allocationMode": "All"}
            request["adminAccess"] = True
        elif scenario == "error":
            request["selectors"] = [{"cel": {"expression": f'{a}.numaNode == 0'}}]
        elif scenario == "extended" and rng.random() < 0.4:  # at most 4 of the 8 GPUs: 3 are left for the pod
            holder = {"count": rng.choice((1, 2, 4))}
        elif scenario in ("rule tolerated", "rule untolerated"):
            rules = [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
                      "metadata": {"name": f"c{index}-0-{run_id}"},
                      "spec": {"deviceSelector": {"driver": driver},
                               "taint": taint_to_api(DeviceTaint(key, "", effect, TIME_ADDED))}}]
        if scenario in ("taint tolerated", "rule tolerated"):
            request["tolerations"] = [rng.choice(({"key": key, "operator": "Exists"}, {"operator": "Exists"},
                                                  {"key": key, "operator": "Exists", "effect": effect}))]
            if scenario == "taint tolerated" and rng.random() < 0.5:
                request["tolerations"] = [{"key": key, "operator": "Equal", "value": "degraded"}]
        elif scenario in ("taint untolerated", "rule untolerated") and rng.random() < 0.5:
            request["tolerations"] = [rng.choice(({"key": key, "operator": "Equal", "value": "other"},
                                                  {"key": key, "operator": "Exists", "effect": "None"}))]
    class_name = f"{template}-{index}-{run_id}.gpudra.io"
    device_class = render_device_class(class_name, driver, template=template, params={})
    spec: Obj = {"devices": {"requests": [{"name": "r0", "exactly": {"deviceClassName": class_name, **request}}]}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    holders, extra = [], []
    if holder is not None:
        holder_class = f"all-h{index}-{run_id}.gpudra.io"
        extra.append(render_device_class(holder_class, driver, template="all", params={}))
        holders.append({"devices": {"requests": [{"name": "held",
                                                  "exactly": {"deviceClassName": holder_class, **holder}}]}})
    second = copy.deepcopy(spec) if scenario == "two claims" else None
    features = slice_features(slices) | claim_features(spec) | ({"taint-rules"} if rules else set())
    features |= {"two claims", "template"} if second else set()
    case = Case(index, driver, nodes, slices, device_class, spec, holders, kind="scenario",
                description=f"scenario {scenario}: {template} on {list(nodes.values())}"
                            + (f", {holder['count']} held on each" if scenario == "extended" and holder else ""),
                features=frozenset(features), extra_classes=extra, taint_rules=rules,
                second_claim_spec=second, from_template=second is not None)
    if scenario == "extended":  # 2 GPUs in all (3 with the claim): an 8-GPU node has them, a 1-GPU one not
        _add_extended(rng, case, amount=2, claim_share=0.3)
    return case


def _add_extended(rng: random.Random, case: Case, *, amount: int | None = None, claim_share: float = 0.5) -> None:
    """The case's pods ask for ``amount`` devices of its class as an extended resource (a random 1
    or 2 when None): by the class's extendedResourceName ``<driver>/gpu``, or its implicit name;
    in one of the container layouts of :func:`_extended_containers`; with the case's claims too
    (always where it has a second claim or a template), else with no claim at all."""
    device_class = copy.deepcopy(case.device_class)
    class_name = device_class["metadata"]["name"]
    if rng.random() < 0.7:
        resource = f"{case.driver}/gpu"
        device_class["spec"]["extendedResourceName"] = resource
    else:
        resource = IMPLICIT_EXTENDED_PREFIX + class_name
    amount = amount or rng.choice((1, 1, 2))
    init, containers, labels = _extended_containers(rng, resource, amount)
    claim_used = bool(case.second_claim_spec) or case.from_template or rng.random() < claim_share
    case.device_class = device_class
    case.extended_resource = resource
    case.init_containers, case.containers, case.claim_used = init, containers, claim_used
    features = set(case.features) | {"extended", *labels, *class_features(device_class)}
    if claim_used:
        features.add("extended + claim")
    else:  # what the claim alone would have carried is not in the pod
        features -= claim_features(case.claim_spec)
    case.features = frozenset(features)
    case.description += (f"; extended {resource} x{amount}: "
                         + ", ".join(f"{'sidecar' if c.get('restartPolicy') else 'init'} {c['name']} "
                                     f"{c['resources']['limits'].get(resource, 0)}" for c in init)
                         + ("; " if init else "")
                         + ", ".join(f"{c['name']} {c['resources']['limits'].get(resource, 0)}" for c in containers)
                         + ("" if claim_used else ", no claim"))


def _extended_containers(rng: random.Random, resource: str, amount: int) -> tuple[list[Obj], list[Obj], set[str]]:
    """Init containers and containers whose requests of ``resource`` add up to ``amount`` devices
    in the claim the scheduler builds: one container; two; a non-sidecar init container asking
    fewer (it reuses the regular containers' requests) or all of them (the scheduler tops up
    theirs), sometimes a second one; a sidecar that is long-lived like the regular containers,
    sometimes after a non-sidecar init container that reuses the sidecar's request. Sometimes a
    container asks for cpu or memory too (the request's name counts the resource's place among
    the container's sorted resource names), or asks for nothing extended."""
    def container(name: str, count: int, sidecar: bool = False) -> Obj:
        limits: Obj = {resource: str(count)} if count else {}
        requests: Obj = dict(limits)
        if rng.random() < 0.3:
            other = rng.choice(("cpu", "memory"))
            requests[other] = "100m" if other == "cpu" else "64Mi"
        body: Obj = {"name": name, "resources": {"requests": requests, "limits": limits}}
        if sidecar:
            body["restartPolicy"] = "Always"
        return body

    layouts = ["one", "init fewer"] + (["two", "init all", "sidecar"] if amount > 1 else [])
    layout = rng.choice(layouts)
    labels: set[str] = set()
    init: list[Obj] = []
    if layout == "one":
        containers = [container("main", amount)]
        if rng.random() < 0.3:
            containers.append(container("idle", 0))
    elif layout == "two":
        first = rng.randint(1, amount - 1)
        containers = [container("main", first), container("second", amount - first)]
        labels.add("extended 2 containers")
    elif layout == "init fewer":
        init = [container("setup", rng.randint(1, amount))]
        containers = [container("main", amount)]
        labels.add("extended init")
    elif layout == "init all":
        regular = rng.randint(1, amount - 1)
        init = [container("setup", amount)]
        if rng.random() < 0.4:
            init.append(container("warmup", rng.randint(1, amount)))
        containers = [container("main", regular)]
        labels.add("extended init")
    else:
        sidecar = rng.randint(1, amount - 1)
        init = [container("proxy", sidecar, sidecar=True)]
        if rng.random() < 0.4:  # before the sidecar: reuses its request and the regular container's
            init.insert(0, container("setup", rng.randint(1, amount)))
            labels.add("extended init")
        containers = [container("main", amount - sidecar)]
        labels.add("extended sidecar")
    return init, containers, labels


def _feature_case(rng: random.Random, index: int, kind: str, run_id: str, minor: int,
                  inventories: dict[str, Any]) -> Case:
    driver = f"c{index}-{run_id}.gpudra.io"
    node_count = rng.choice((1, 2, 2, 3))
    notes: list[str] = []
    if kind == "partitioned":
        nodes = {f"x{run_id}-{index}-{n}": rng.choice(("dgx-a100-40gb", "dgx-h100", "h200")) for n in range(node_count)}
        slices = []
        for node, profile in nodes.items():
            gpus = rng.choice((1, 2, 2))
            pool, note = _partitioned_pool(rng, driver, node, inventories[profile][:gpus])
            slices += pool
            notes.append(f"{gpus}x {profile} {note}")
        template, params = rng.choice(PARTITION_CLASS_TEMPLATES)
        if params.get("profile") == "":
            params = {"profile": rng.choice(sorted({d["attributes"]["profile"]["string"]
                                                    for s in slices for d in s["spec"].get("devices") or []
                                                    if "profile" in d["attributes"]}))}
    else:
        nodes = {f"x{run_id}-{index}-{n}": rng.choice(PROFILES if kind == "classic" else WHOLE_GPU_PROFILES)
                 for n in range(node_count)}
        sharing = None
        if kind == "consumable":
            sharing = ConsumableCapacity(rng.choice((GiB, 2 * GiB, 4 * GiB, 10 * GiB)),
                                         rng.choice((0, 0, 2, 3, 7)))
        form = rng.choice(("range", "range", "values", "default", "none"))
        slices = []
        for node, profile in nodes.items():
            devices, _ = share_devices(inventories[profile], sharing)
            built = build_slices(driver, node, None, 1, devices)
            if sharing is not None and form != "range":
                for s in built:
                    for device in s["spec"].get("devices") or []:
                        _rewrite_policy(rng, device, form, sharing.memory_step)
            slices += built
        if sharing is not None:
            notes.append(f"shared, memory step {format_quantity(sharing.memory_step, binary=True)}"
                         + (f", {sharing.shares} shares" if sharing.shares else "") + f", policy {form}")
        template, params = rng.choice(CLASS_TEMPLATES if kind == "classic" else SHARED_CLASS_TEMPLATES)
    if rng.random() < 0.45:
        tainted = _taint_devices(rng, driver, slices, rng.choice((0.2, 0.5, 0.9)))
        if tainted:
            notes.append(f"{tainted} tainted devices")
    if rng.random() < 0.15 and _add_binding_conditions(rng, slices):
        notes.append("binding conditions")
    taint_rules = _taint_rules(rng, index, run_id, driver, slices) if minor >= 37 and rng.random() < 0.4 else []
    if taint_rules:
        notes.append(f"{len(taint_rules)} DeviceTaintRules")

    class_name = f"{template}-{index}-{run_id}.gpudra.io"
    device_class = render_device_class(class_name, driver, template=template, params=params)
    holder_class_name = f"all-h{index}-{run_id}.gpudra.io"
    holder_class = render_device_class(holder_class_name, driver, template="all", params={})
    selectors = _selectors(driver) + (_feature_selectors(driver) if kind == "partitioned" else [])
    shares = any("shares" in (d.get("capacity") or {}) for s in slices for d in s["spec"].get("devices") or [])
    taint_keys = _taint_keys(driver)
    has_taints = "taints" in slice_features(slices) or bool(taint_rules)

    def body(name: str, top_level: bool) -> Obj:
        request = (_request(rng, name, class_name, selectors) if kind == "classic" else
                   _request(rng, name, class_name, selectors, counts=FEATURE_COUNTS,
                            selector_counts=FEATURE_SELECTOR_COUNTS, all_share=0.08))
        if (kind == "consumable" and rng.random() < 0.7) or rng.random() < 0.08:
            request["capacity"] = {"requests": _capacity_request(rng, shares)}
        if (has_taints and rng.random() < 0.7) or rng.random() < 0.05:
            request["tolerations"] = _tolerations(rng, taint_keys)
        if top_level and rng.random() < 0.2:
            request["adminAccess"] = True
        return request

    requests: list[Obj] = []
    for r in range(rng.choice((1, 1, 1, 2))):
        if rng.random() < 0.2:
            requests.append({"name": f"r{r}", "firstAvailable": [{"name": f"s{s}", **body(f"s{s}", False)}
                                                                for s in range(2)]})
        else:
            requests.append({"name": f"r{r}", "exactly": body(f"r{r}", True)})
    spec: Obj = {"devices": {"requests": requests}}
    constraints = []
    if len(requests) > 1 and rng.random() < 0.4:
        attribute = rng.choice(("numaNode", "productName", "type", "parentIndex"))
        constraints.append({"requests": [r["name"] for r in requests], "matchAttribute": f"{driver}/{attribute}"})
    several = len(requests) > 1 or any((r.get("exactly") or {}).get("count", 1) > 1
                                       or (r.get("exactly") or {}).get("allocationMode") == "All" for r in requests)
    if minor >= 36 and several and rng.random() < (0.6 if kind == "consumable" else 0.3):
        attribute = rng.choice(("uuid", "index", "parentIndex", "productName") if kind == "partitioned" else
                               ("uuid", "uuid", "index", "productName"))
        constraint: Obj = {"distinctAttribute": f"{driver}/{attribute}"}
        if rng.random() < 0.7:
            constraint["requests"] = [r["name"] for r in requests]
        constraints.append(constraint)
    if constraints:
        spec["devices"]["constraints"] = constraints

    holders = _holders(rng, kind, driver, holder_class_name, shares, taint_keys)
    second = {"devices": {"requests": [{"name": "r0", "exactly": body("r0", True)}]}} if rng.random() < 0.12 else None
    from_template = rng.random() < 0.15
    reuse = bool(holders) and rng.random() < 0.25
    features = slice_features(slices) | claim_features(spec) | (claim_features(second) if second else set())
    features |= {f for f, on in (("two claims", second), ("template", from_template), ("reuse", reuse)) if on}
    if any("admin" in claim_features(h) for h in holders):
        features.add("admin-holder")
    if taint_rules:
        features.add("taint-rules")
    description = (f"{kind}: {template}{params or ''} on {list(nodes.values())}"
                   + (f" ({'; '.join(notes)})" if notes else "")
                   + (f", {len(holders)} holder claims on each node" if holders else ""))
    return Case(index, driver, nodes, slices, device_class, spec, holders, description=description, kind=kind,
                features=frozenset(features), extra_classes=[holder_class] if holders else [],
                taint_rules=taint_rules, second_claim_spec=second, from_template=from_template, reuse=reuse)


def enabled_features(features: frozenset[str] | set[str], minor: int) -> set[str]:
    """Those of ``features`` whose fields Kubernetes 1.<minor> keeps with its default gates."""
    return {f for f in features if ON_BY_DEFAULT_FROM.get(f, 0) <= minor}


def class_features(device_class: Obj) -> set[str]:
    """The features a DeviceClass uses, by name: extendedResourceName."""
    return {"extendedResourceName"} if (device_class.get("spec") or {}).get("extendedResourceName") else set()


def slice_features(slices: list[Obj]) -> set[str]:
    """The features the slices' devices use, by name: consumable, counters, taints, binding."""
    found = set()
    for s in slices:
        if s["spec"].get("sharedCounters"):
            found.add("counters")
        for device in s["spec"].get("devices") or []:
            if device.get("allowMultipleAllocations"):
                found.add("consumable")
            if device.get("consumesCounters"):
                found.add("counters")
            if device.get("taints"):
                found.add("taints")
            if device.get("bindingConditions"):
                found.add("binding")
    return found


def claim_features(spec: Obj) -> set[str]:
    """The features a claim spec uses, by name: capacity-requests, tolerations, admin,
    firstAvailable, all, matchAttribute, distinctAttribute."""
    found = set()
    devices = spec.get("devices") or {}
    for request in devices.get("requests") or []:
        if request.get("firstAvailable"):
            found.add("firstAvailable")
        for body in request.get("firstAvailable") or [request.get("exactly") or {}]:
            if body.get("capacity"):
                found.add("capacity-requests")
            if body.get("tolerations"):
                found.add("tolerations")
            if body.get("adminAccess"):
                found.add("admin")
            if body.get("allocationMode") == "All":
                found.add("all")
    for constraint in devices.get("constraints") or []:
        found.add("matchAttribute" if "matchAttribute" in constraint else "distinctAttribute")
    return found


def _capacity_request(rng: random.Random, shares: bool) -> Obj:
    amounts: Obj = {}
    if not shares or rng.random() < 0.8:
        amounts["memory"] = rng.choice(("1500Mi", "1Gi", "5Gi", "5Gi", "10Gi", "10Gi", "20Gi", "33Gi", "40Gi", "70Gi",
                                        "100Gi"))
    if shares and (not amounts or rng.random() < 0.4):
        amounts["shares"] = rng.choice(("1", "1", "2", "3", "8"))
    return amounts


def _rewrite_policy(rng: random.Random, device: Obj, form: str, step: int) -> None:
    """The shared device's memory policy in another of the forms the API takes: ``values``
    (validValues, ascending, the default among them), ``default`` (a default alone), ``none``
    (no policy: allowMultipleAllocations alone)."""
    memory = (device.get("capacity") or {}).get("memory")
    if not device.get("allowMultipleAllocations") or not memory or "requestPolicy" not in memory:
        return
    if form == "none":
        for capacity in device["capacity"].values():
            capacity.pop("requestPolicy", None)
        return
    total = int(parse_quantity(memory["value"]))
    whole = total - total % step
    values = sorted({max(step, whole // n - (whole // n) % step) for n in (8, 4, 2, 1)})
    if form == "values":
        memory["requestPolicy"] = {"default": format_quantity(rng.choice(values), binary=True),
                                   "validValues": [format_quantity(v, binary=True) for v in values]}
    else:
        memory["requestPolicy"] = {"default": format_quantity(rng.choice(values), binary=True)}


def _taint_keys(driver: str) -> tuple[str, ...]:
    return (f"{driver}/health", f"{driver}/maintenance", "example.com/xid")


def _taint_devices(rng: random.Random, driver: str, slices: list[Obj], share: float) -> int:
    """Taints on some devices, in the form the agent publishes them; the number tainted."""
    keys = _taint_keys(driver)
    tainted = 0
    for s in slices:
        for device in s["spec"].get("devices") or []:
            if rng.random() < share:
                taints = {}
                for _ in range(rng.choice((1, 1, 2))):
                    key = rng.choice(keys)
                    taints[key] = DeviceTaint(key, rng.choice(("", "degraded", "xid-79")),
                                              rng.choice(("NoSchedule", "NoSchedule", "NoExecute", "None")), TIME_ADDED)
                device["taints"] = [taint_to_api(t) for t in taints.values()]
                tainted += 1
    return tainted


def _taint_rules(rng: random.Random, index: int, run_id: str, driver: str, slices: list[Obj]) -> list[Obj]:
    """DeviceTaintRules that taint the case's devices: all of them, a pool's, or one device; each
    names the case's driver, so no rule reaches another case's (or another test's) devices."""
    pools: dict[str, list[str]] = {}
    for s in slices:
        pools.setdefault(s["spec"]["pool"]["name"], []).extend(d["name"] for d in s["spec"].get("devices") or [])
    rules = []
    for r in range(rng.choice((1, 1, 2))):
        pool = rng.choice(sorted(pools))
        selector = {"driver": driver}
        if rng.random() < 0.8:
            selector["pool"] = pool
            if rng.random() < 0.6:  # one of the first devices: the ones the allocator tries first
                selector["device"] = rng.choice(sorted(pools[pool])[:2])
        key = rng.choice(_taint_keys(driver))
        taint = taint_to_api(DeviceTaint(key, rng.choice(("", "degraded", "xid-79")),
                                         rng.choice(("NoSchedule", "NoSchedule", "NoExecute", "NoExecute", "None")),
                                         TIME_ADDED))
        rules.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
                      "metadata": {"name": f"c{index}-{r}-{run_id}"},
                      "spec": {"deviceSelector": selector, "taint": taint}})
    return rules


def rule_selects(rule: Obj, driver: str, pool: str, device: str) -> bool:
    """Whether a DeviceTaintRule's deviceSelector takes this device (every field it sets matches)."""
    selector = (rule.get("spec") or {}).get("deviceSelector") or {}
    return all(selector.get(k) in (None, v) for k, v in (("driver", driver), ("pool", pool), ("device", device)))


def _tolerations(rng: random.Random, keys: tuple[str, ...]) -> list[Obj]:
    """Tolerations of the generated taints: every taint, a key's, a key with one value, each with
    or without an effect; some match nothing. No tolerationSeconds: the NoExecute taint eviction
    controller would delete the test's pods."""
    tolerations = []
    for _ in range(rng.choice((1, 1, 2))):
        roll = rng.random()
        if roll < 0.25:
            toleration: Obj = {"operator": "Exists"}
        elif roll < 0.55:
            toleration = {"key": rng.choice(keys), "operator": "Exists"}
        else:
            toleration = {"key": rng.choice(keys), "operator": "Equal",
                          "value": rng.choice(("", "degraded", "xid-79", "other"))}
        effect = rng.choice(("", "", "NoSchedule", "NoExecute", "None"))
        if effect:
            toleration["effect"] = effect
        tolerations.append(toleration)
    return tolerations


def _add_binding_conditions(rng: random.Random, slices: list[Obj]) -> bool:
    """Binding conditions (and their failure condition, which the API requires with them) on some
    devices, bindsToNode on some of those."""
    added = False
    for s in slices:
        for device in s["spec"].get("devices") or []:
            if rng.random() < 0.5:
                device["bindingConditions"] = [BINDING_CONDITION]
                device["bindingFailureConditions"] = [BINDING_FAILURE]
                if rng.random() < 0.5:
                    device["bindsToNode"] = True
                added = True
    return added


def _holders(rng: random.Random, kind: str, driver: str, class_name: str, shares: bool,
             taint_keys: tuple[str, ...]) -> list[Obj]:
    """Claims allocated on each node before the case's claim: shares of shared GPUs, partitions or
    whole GPUs of partitioned ones, devices of others; some tolerate every taint, a few have admin
    access (which holds nothing)."""
    a = f'device.attributes["{driver}"]'
    if rng.random() < (0.4 if kind == "classic" else 0.75):
        count = 1 if kind == "classic" else rng.choice((1, 1, 2, 3))
    else:
        return []
    holders = []
    for _ in range(count):
        body: Obj = {"deviceClassName": class_name}
        if kind != "classic" and rng.random() < 0.2:
            body["allocationMode"] = "All"  # a share of every GPU, or every partition of a profile
        else:
            body["count"] = rng.choice((1, 1, 2, 4) if kind == "classic" else (1, 1, 2))
        if kind == "partitioned":
            wanted = rng.choice(('"gpu"', '"1g"', '"2g"', '"3g"', '"4g"'))
            expression = (f'{a}.type == "gpu"' if wanted == '"gpu"' else
                          f'{a}.type == "mig" && {a}.profile.startsWith({wanted})')
            body["selectors"] = [{"cel": {"expression": expression}}]
        if kind == "consumable" and rng.random() < 0.8:
            body["capacity"] = {"requests": _capacity_request(rng, shares)}
        if rng.random() < 0.5:
            body["tolerations"] = [{"operator": "Exists"}]
        elif rng.random() < 0.3:
            body["tolerations"] = _tolerations(rng, taint_keys)
        if rng.random() < 0.06:
            body["adminAccess"] = True
        holders.append({"devices": {"requests": [{"name": "held", "exactly": body}]}})
    return holders


def _partitioned_pool(rng: random.Random, driver: str, node: str, gpus: list[Any]) -> tuple[list[Obj], str]:
    """A node's pool of MIG-like partitionable GPUs, from the profile's whole ``gpus``: counter
    slices first, then device slices; and a note on its layout."""
    sets: list[Obj] = []
    devices_per_gpu: list[list[Obj]] = []
    links = len(gpus) > 1 and rng.random() < 0.5
    index = 0
    for gpu_device in build_slices(driver, node, None, 1, gpus)[0]["spec"]["devices"]:
        memory = int(parse_quantity(gpu_device["capacity"]["memory"]["value"]))
        per_slice = memory // MEMORY_SLICES // MiB * MiB
        gpu_name = gpu_device["name"]
        counter_set = f"{gpu_name}-counters"
        counters = {"compute": COMPUTE_SLICES, "memory": per_slice * MEMORY_SLICES,
                    **{f"memory-slice-{m}": 1 for m in range(MEMORY_SLICES)}}
        sets.append({"name": counter_set, "counters": {k: {"value": _counter(k, v)} for k, v in counters.items()}})
        whole = {**gpu_device, "attributes": {**gpu_device["attributes"], "index": {"int": index}}}
        whole["consumesCounters"] = [{"counterSet": counter_set,
                                      "counters": {k: {"value": _counter(k, v)} for k, v in counters.items()}}]
        if links:
            whole["consumesCounters"].append({"counterSet": "links", "counters": {"links": {"value": "1"}}})
        index += 1
        devices = [whole]
        gpu_index = gpu_device["attributes"]["index"]["int"]
        for compute, memory_slices, starts in PARTITIONS:
            gigabytes = round(per_slice * memory_slices / GiB)
            profile = f"{compute}g.{gigabytes}gb"
            for start in starts:
                attributes = {k: v for k, v in gpu_device["attributes"].items() if k not in ("minor", "uuid")}
                attributes.update({"type": {"string": "mig"}, "profile": {"string": profile},
                                   "parentIndex": {"int": gpu_index}, "index": {"int": index},
                                   "uuid": {"string": f"MIG-{node[-6:]}-{gpu_index}-{compute}g-{start}"}})
                consumed = {"compute": compute, "memory": per_slice * memory_slices,
                            **{f"memory-slice-{m}": 1 for m in range(start, start + memory_slices)}}
                devices.append({
                    "name": f"{gpu_name}-mig-{compute}g-{start}",
                    "attributes": attributes,
                    "capacity": {"memory": {"value": format_quantity(per_slice * memory_slices, binary=True)},
                                 "multiprocessors": {"value": str(compute * 14)}},
                    "consumesCounters": [{"counterSet": counter_set,
                                          "counters": {k: {"value": _counter(k, v)} for k, v in consumed.items()}}],
                })
                index += 1
        devices_per_gpu.append(devices)
    counter_sets = [sets]
    if links:
        link_set = {"name": "links", "counters": {"links": {"value": str(len(gpus) - 1)}}}
        if rng.random() < 0.5:
            counter_sets.append([link_set])  # a second counter slice
        else:
            sets.append(link_set)
    device_groups = devices_per_gpu if rng.random() < 0.7 else [[d for group in devices_per_gpu for d in group]]
    total = len(counter_sets) + len(device_groups)
    slices = []
    contents = [{"sharedCounters": c} for c in counter_sets] + [{"devices": g} for g in device_groups]
    for i, content in enumerate(contents):
        slices.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                       "metadata": {"name": slice_name(node, driver, i)},
                       "spec": {"driver": driver, "nodeName": node,
                                "pool": {"name": node, "generation": 1, "resourceSliceCount": total}, **content}})
    note = (f"partitioned in {total} slices" + (f", {len(gpus) - 1} links" if links else ""))
    return slices, note


def _counter(name: str, value: int) -> str:
    return format_quantity(value, binary=name == "memory")
