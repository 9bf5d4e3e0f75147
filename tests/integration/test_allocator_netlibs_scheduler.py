"""gpudra-allocator's CEL (Kubernetes' own, of the cluster's release) against the real kube-scheduler,
on the libraries a port gets wrong first: URL, IP, CIDR, regex and named formats.

Four devices carry string attributes holding IPs, CIDRs, URLs and odd strings (an IPv4-mapped
address, a zoned one, a CIDR with host bits, a relative URL, a bad pattern). Each case is one claim
(one device, an inline selector) and one pod pinned to a node of its own that publishes the four
devices, so no two claims compete. The helper's ``match`` answers per device first, and the case says
which shape of answer it was written for:

* ``one``: exactly one device matches and none fails: the scheduler must allocate that device;
* ``none``: no device matches and none fails: the pod stays unschedulable;
* ``error``: no device matches, some fail with an error: whatever order the allocator goes in, it
  meets an error or finds nothing, and the pod stays unschedulable; the scheduler's message names
  the error, word for word one of the helper's;
* ``refused``: the selector does not compile (a literal pattern that is no regexp): the API server
  refuses the claim as the helper's ``compile`` does.

A case written ``lenient/strict`` has the first shape where an http(s) URL's host may hold two
colons (1.35) and the second where it may not (1.36 and later: Kubernetes builds with Go 1.26's
defaults); the helper is the cluster's release, and `.ci/run` runs this test on each."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_dev.localcluster.waiting import wait_for
from schedpods import pinned_pod, scheduling_outcome

pytestmark = pytest.mark.cluster

DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")

DEVICES: dict[str, dict[str, str]] = {
    "v4": {"ip": "10.1.2.3", "cidr": "10.0.0.0/8", "name": "nic-a", "pattern": "[0-9]+",
           "url": "https://storage.example.com:8443/v1/objects?zone=a&zone=b", "text": "model 42 rev 7",
           "mirror": "http://cache:80:8080/"},
    "v6": {"ip": "2001:db8::68", "cidr": "2001:db8::/32", "name": "Nic_B", "pattern": "x+",
           "url": "http://[2001:db8::1]/path with space", "text": "Mixed Case", "mirror": "ftp://cache:80:8080/"},
    "odd": {"ip": "::ffff:10.1.2.3", "cidr": "10.0.0.1/8", "name": "not a label!", "pattern": "z",
            "url": "../relative-path", "text": "no digits here", "mirror": "http://cache:8080/"},
    "zone": {"ip": "fe80::1%eth0", "cidr": "not-a-cidr", "name": "x-", "pattern": "(",
             "url": "https://a:b:c/", "text": "ÀÉ at 1.5 GHz", "mirror": "not a url"},
}
A = "device.attributes[DRIVER]"
CASES: list[tuple[str, str]] = [
    ("one", f"isIP({A}.ip) && cidr('10.0.0.0/8').containsIP({A}.ip)"),
    ("one", f"isIP({A}.ip) && ip({A}.ip).family() == 6 && ip({A}.ip).isGlobalUnicast()"),
    ("one", f"isIP({A}.ip) && ip({A}.ip) == ip('2001:DB8:0::68')"),
    # host bits set (cel-go's estimate of == between two computed CIDRs is past the cost limit)
    ("one", f"isCIDR({A}.cidr) && cidr({A}.cidr).ip().family() == 4 && !cidr('10.0.0.0/32').containsIP(cidr({A}.cidr).ip())"),
    ("one", f"isCIDR({A}.cidr) && cidr({A}.cidr).containsCIDR('2001:db8:1::/48')"),
    ("one", f"isURL({A}.url) && url({A}.url).getQuery()['zone'] == ['a', 'b'] && url({A}.url).getPort() == '8443'"),
    ("one", f"isURL({A}.url) && url({A}.url).getHostname() == '2001:db8::1'"
            f" && url({A}.url).getEscapedPath() == '/path%20with%20space'"),
    ("one", f"{A}.text.find('[0-9]+') == '42'"),
    ("one", f"{A}.text.findAll(r'\\p{{Lu}}').size() == 2 && {A}.text.findAll(r'\\p{{Lu}}', 1) == ['M']"),
    ("one", f"{A}.text.find(r'[0-9]+(\\.[0-9]+)?\\s*GHz') == '1.5 GHz'"),
    ("one", f"!format.dns1123Label().validate({A}.name).hasValue()"),
    ("one", f"{A}.name.endsWith('-') && !format.named('dns1123LabelPrefix').value().validate({A}.name).hasValue()"),
    ("one", f"format.labelValue().validate({A}.name).orValue([]).size() == 0 && {A}.name.contains('_')"),
    ("none", f"isIP({A}.ip) && ip({A}.ip).isLinkLocalMulticast()"),
    ("none", f"isURL({A}.url) && url({A}.url).getScheme() == 'ftp'"),
    ("error", f"ip({A}.ip).isLoopback()"),  # the IPv4-mapped and the zoned address are errors
    ("error", f"cidr({A}.cidr).prefixLength() > 64"),
    ("error", f"url({A}.url).getScheme() == 'ftp'"),
    ("error", f"cidr('192.168.0.0/16').containsIP({A}.ip)"),  # "no such overload" on the two bad IPs
    ("error", f"{A}.text.find({A}.pattern) == 'no match'"),  # "Illegal regex" on "("
    ("refused", f"{A}.text.find('(') == ''"),
    # two colons in an http host: a URL on 1.35 only; in an ftp one, on every release
    ("one/none", f"isURL({A}.mirror) && {A}.mirror.startsWith('http://cache:80:')"),
    ("one", f"isURL({A}.mirror) && url({A}.mirror).getScheme() == 'ftp' && url({A}.mirror).getPort() == '8080'"),
    ("one/error", f"{A}.mirror.startsWith('http') && url({A}.mirror).getPort() == '8080' && {A}.mirror.contains(':80:')"),
]


def wanted(want: str, minor: int) -> str:
    """The shape a case was written for on 1.<minor> (``lenient/strict``: see the module doc)."""
    lenient, _, strict = want.partition("/")
    return strict if strict and minor >= 36 else lenient


async def helper_answers(helper: AllocatorHelper, driver: str, expression: str) -> dict[str, Any]:
    """The helper's match on each device: True, False or the error."""
    devices = [(driver, {"name": name, "attributes": {k: {"string": v} for k, v in strings.items()}})
               for name, strings in DEVICES.items()]
    _, rows = await helper.match([expression], devices)
    return {name: row[0].error if row[0].error is not None else row[0].matches for name, row in zip(DEVICES, rows)}


def shape(answers: dict[str, Any]) -> str:
    matched = [name for name, answer in answers.items() if answer is True]
    failed = [name for name, answer in answers.items() if isinstance(answer, str)]
    return "one" if len(matched) == 1 and not failed else "none" if not matched and not failed else \
        "error" if failed and not matched else "mixed"


async def decision(kube: Kube, namespace: str, name: str) -> tuple[bool, str] | None:
    """(True, the allocated device) once bound; (False, why) once unschedulable; else None."""
    decided = scheduling_outcome(await kube.get(POD, name, namespace))
    if decided is None or not decided[0]:
        return decided
    claim = await kube.get(CLAIM, name, namespace) or {}
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return (True, results[0]["device"]) if results else None


async def test_the_scheduler_allocates_where_the_helper_says_the_selector_matches(
        kube: Kube, namespace: str, fake_nodes) -> None:
    token = secrets.token_hex(3)
    driver = f"net-{token}.gpudra.io"
    klass = f"net-{token}"
    minor = await kube.server_minor()
    assert minor is not None
    helper = AllocatorHelper(minor)
    assert helper.note is None, helper.note
    cases = [(i, wanted(want, minor), expression.replace("DRIVER", f'"{driver}"'))
             for i, (want, expression) in enumerate(CASES)]
    # The answers these cases were written for (so the test keeps exercising all four shapes).
    answered: dict[int, dict[str, Any]] = {}
    for i, want, expression in cases:
        if want == "refused":
            ((compiled,), _) = await helper.compile([expression])
            assert compiled.error and "error parsing regexp" in compiled.error, (i, expression, compiled)
        else:
            answered[i] = await helper_answers(helper, driver, expression)
            assert shape(answered[i]) == want, (i, expression, minor, answered[i])
    await helper.close()

    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": klass},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    nodes: dict[int, str] = {}
    try:
        for i, want, _ in cases:
            if want == "refused":
                continue
            node = (await fake_nodes(f"net{i}"))["metadata"]["name"]
            nodes[i] = node
            await kube.create({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{token}"},
                "spec": {"driver": driver, "nodeName": node,
                         "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                         "devices": [{"name": name, "attributes": {k: {"string": v} for k, v in strings.items()}}
                                     for name, strings in DEVICES.items()]}})
        for i, want, expression in cases:
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": f"case-{i}", "namespace": namespace},
                     "spec": {"devices": {"requests": [{"name": "nic", "exactly": {
                         "deviceClassName": klass, "selectors": [{"cel": {"expression": expression}}]}}]}}}
            if want == "refused":
                with pytest.raises(ApiException) as refused:
                    await kube.create(claim)
                assert refused.value.status == 422 and "error parsing regexp" in str(refused.value.body), refused.value.body
                continue
            await kube.create(claim)
            await kube.create(pinned_pod(f"case-{i}", namespace, nodes[i], f"case-{i}"))

        disagreements = []
        for i, want, expression in cases:
            if want == "refused":
                continue
            scheduled, detail = await wait_for(lambda i=i: decision(kube, namespace, f"case-{i}"), timeout=30,
                                               interval=0.1, what=f"the scheduler's decision on case {i}")
            answers = answered[i]
            expected = next((name for name, answer in answers.items() if answer is True), None) if want == "one" else None
            # The scheduler stops at the first device that fails and names its error: one of the helper's.
            errors = [f"CEL runtime error: {answer}" for answer in answers.values() if isinstance(answer, str)]
            if (scheduled, detail if scheduled else None) != (expected is not None, expected) \
                    or (want == "error" and not any(detail.endswith(error) for error in errors)):
                disagreements.append(f"case {i} {expression!r}: the helper {answers}, the scheduler "
                                     f"{'allocated ' + detail if scheduled else 'did not schedule it: ' + detail}")
        assert not disagreements, "\n".join(disagreements)
    finally:
        async for found in kube.list(SLICE, field_selector=f"spec.driver={driver}"):
            await kube.delete(SLICE, found["metadata"]["name"])
        await kube.delete(DEVICE_CLASS, klass)
