"""The I/O of `gpudra explain`: read what the verdict needs, through the project's one API client.

Required reads (a failure is the command's error): the pod or claim, the pod's claims, the
DeviceClasses they name, and the driver's ResourceSlices. Optional reads (a namespace user may
not have them; the verdict then says what it could not see): Nodes (labels, for node selection),
ResourceClaims of every namespace (the devices other namespaces hold), the claim's Namespace (the
admin-access label), and the DeviceTaintRules (taints the scheduler adds to the devices they
select) in the API version the cluster's scheduler reads them in: v1 from 1.37, v1beta2 in 1.36,
v1alpha3 in 1.35, where served (an administrator turned the gate and the API on).

A pod that asks for extended resources (KEP-5004: a DeviceClass may map them to DRA devices) needs
more: every DeviceClass (required: any may map one), whole Nodes rather than their metadata (their
allocatable says where a device plugin serves the resource), and the claim the scheduler created for
the pod once it did (``status.extendedResourceClaimStatus``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, Obj, ResourceType, error_message, resource_type
from gpudra_operator.explain.extended import EXTENDED_CLAIM_ANNOTATION

POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
NAMESPACE = resource_type("v1", "Namespace")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
# Not in kubeapi's table of the kinds gpudra writes: only explain reads it, in the version the
# release's kube-scheduler watches (its resourceslice tracker): v1 from 1.37, v1beta2 in 1.36 and
# v1alpha3 in 1.35 (alpha and beta with the feature gate off by default: the API then answers 404).
TAINT_RULE_VERSIONS = {35: "v1alpha3", 36: "v1beta2"}


def taint_rule_type(minor: int) -> ResourceType:
    version = TAINT_RULE_VERSIONS.get(minor, "v1")
    return ResourceType(f"resource.k8s.io/{version}", "DeviceTaintRule", "devicetaintrules", False)


TAINT_RULE = taint_rule_type(37)  # the GA version


class ExplainInputError(Exception):
    """Input explain cannot work from: the message says what and why."""


@dataclass
class Snapshot:
    target: str
    pod: Obj | None
    claims: list[Obj]
    classes: dict[str, Obj]
    slices: list[Obj]
    nodes: list[Obj] | None
    other_claims: list[Obj]
    namespace: Obj | None
    notes: list[str] = field(default_factory=list)
    server_minor: int | None = None  # Kubernetes 1.<minor> of the API server, when it said
    taint_rules: list[Obj] = field(default_factory=list)  # DeviceTaintRules, where readable
    # The extended resources the pod asks for (KEP-5004): then ``classes`` holds every DeviceClass
    # (any may map one), ``nodes`` the whole Nodes (their allocatable says where device plugins
    # serve them), and ``extended_claims`` the namespace's claims the scheduler created for pods.
    extended: list[str] = field(default_factory=list)
    extended_claims: list[Obj] = field(default_factory=list)


def _denied(error: ApiException, what: str) -> ExplainInputError:
    if error.status in (401, 403):
        return ExplainInputError(f"not allowed to read {what}: {error_message(error)}")
    return ExplainInputError(f"reading {what} failed: {error_message(error)}")


async def _required_get(kube: Kube, rtype: ResourceType, name: str, namespace: str | None, what: str) -> Obj | None:
    try:
        return await kube.get(rtype, name, namespace)
    except ApiException as error:
        raise _denied(error, what) from None


def extended_resources(pod: Obj) -> list[str]:
    """The extended resources the pod's containers ask for: a domain-prefixed name outside
    kubernetes.io's, or a DeviceClass's implicit one (deviceclass.resource.kubernetes.io/<class>)."""
    names: set[str] = set()
    spec = pod.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        resources = container.get("resources") or {}
        for key in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}:
            domain = key.split("/", 1)[0] if "/" in key else ""
            if domain == "deviceclass.resource.kubernetes.io" or (
                    domain and domain != "kubernetes.io" and not domain.endswith(".kubernetes.io")):
                names.add(key)
    return sorted(names)


def _pod_claim_names(pod: Obj) -> tuple[list[str], list[str]]:
    """The names of the pod's ResourceClaims (the one the scheduler created for its extended
    resources last), and notes for those not created yet."""
    statuses = {s.get("name"): s.get("resourceClaimName")
                for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    names: list[str] = []
    notes: list[str] = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if entry.get("resourceClaimName"):
            names.append(entry["resourceClaimName"])
        elif statuses.get(entry.get("name")):
            names.append(str(statuses[entry["name"]]))
        else:
            notes.append(f"pod claim {entry.get('name')}: the ResourceClaim from template "
                         f"{entry.get('resourceClaimTemplateName')} does not exist yet")
    extended = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if extended:
        names.append(str(extended))
    return names, notes


async def read_snapshot(kube: Kube, kind: str, namespace: str, name: str, driver: str) -> Snapshot:
    notes: list[str] = []
    pod: Obj | None = None
    if kind == "pod":
        pod = await _required_get(kube, POD, name, namespace, f"pod {namespace}/{name}")
        if pod is None:
            raise ExplainInputError(f"pod {namespace}/{name} not found")
        claim_names, notes = _pod_claim_names(pod)
        extended = extended_resources(pod)
        if not claim_names and not notes and not extended:
            raise ExplainInputError(f"pod {namespace}/{name} has no resourceClaims and asks for no extended "
                                    "resources: nothing to explain")
    else:
        claim_names, extended = [name], []
    claims: list[Obj] = []
    for claim_name in claim_names:
        claim = await _required_get(kube, CLAIM, claim_name, namespace, f"ResourceClaim {namespace}/{claim_name}")
        if claim is None:
            if kind == "claim":
                raise ExplainInputError(f"ResourceClaim {namespace}/{claim_name} not found")
            notes.append(f"ResourceClaim {namespace}/{claim_name} not found")
            continue
        claims.append(claim)
    if not claims and not extended:
        raise ExplainInputError(f"pod {namespace}/{name}: none of its ResourceClaims exists yet")

    classes: dict[str, Obj] = {}
    if extended:
        # Any class may map one of them, by its extendedResourceName or its implicit name.
        try:
            classes = {c["metadata"]["name"]: c async for c in kube.list(DEVICE_CLASS)}
        except ApiException as error:
            raise _denied(error, "DeviceClasses (which of them map the pod's extended resources)") from None
    for claim in claims:
        for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
            for body in request.get("firstAvailable") or [request.get("exactly") or {}]:
                class_name = body.get("deviceClassName")
                if class_name and class_name not in classes:
                    found = await _required_get(kube, DEVICE_CLASS, class_name, None, f"DeviceClass {class_name}")
                    if found is not None:
                        classes[class_name] = found
    try:
        slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver}")]
    except ApiException as error:
        raise _denied(error, "ResourceSlices") from None

    nodes: list[Obj] | None
    try:
        # Whole Nodes for extended resources: their allocatable says where device plugins serve them.
        nodes = [n async for n in kube.list(NODE, metadata_only=not extended)]
    except ApiException as error:
        if error.status not in (401, 403):
            raise _denied(error, "Nodes") from None
        nodes = None
        notes.append("Nodes are not readable: the pod's node selection is not checked, nodes come from the slices"
                     + ("; extended resources count as DRA's on every node (a device plugin may serve them on some)"
                        if extended else ""))
    try:
        other_claims = [c async for c in kube.list(CLAIM)]
    except ApiException as error:
        if error.status not in (401, 403):
            raise _denied(error, "ResourceClaims") from None
        other_claims = [c async for c in kube.list(CLAIM, namespace)]
        notes.append("ResourceClaims of other namespaces are not readable: devices they hold count as free")
    try:
        namespace_obj = await kube.get(NAMESPACE, namespace)
    except ApiException:
        namespace_obj = None
    minor = await server_minor(kube)
    taint_rules = await _taint_rules(kube, minor, notes)
    extended_claims = [c for c in other_claims if (c.get("metadata") or {}).get("namespace") == namespace
                       and ((c.get("metadata") or {}).get("annotations") or {}).get(EXTENDED_CLAIM_ANNOTATION) == "true"]
    return Snapshot(target=f"{kind} {namespace}/{name}", pod=pod, claims=claims, classes=classes, slices=slices,
                    nodes=nodes, other_claims=other_claims, namespace=namespace_obj, notes=notes,
                    server_minor=minor, taint_rules=taint_rules, extended=extended, extended_claims=extended_claims)


async def _taint_rules(kube: Kube, minor: int | None, notes: list[str]) -> list[Obj]:
    """The DeviceTaintRules in the version the release's scheduler reads; none where the API does
    not serve it (404), with a note where the user may not list them."""
    if minor is None or minor < min(TAINT_RULE_VERSIONS, default=35):
        return []
    try:
        return [r async for r in kube.list(taint_rule_type(minor))]
    except ApiException as error:
        if error.status == 404:
            return []
        if error.status not in (401, 403):
            raise _denied(error, "DeviceTaintRules") from None
    notes.append("DeviceTaintRules are not readable: the taints they add to devices are left out, though the "
                 "scheduler heeds them")
    return []


async def server_minor(kube: Kube) -> int | None:
    """The API server's minor version; the scheduler of the same release is assumed."""
    try:
        return await kube.server_minor()
    except ApiException:
        return None
