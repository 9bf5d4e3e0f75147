"""The one thin adapter between gpudra and the Kubernetes API (kubernetes-asyncio underneath).

Objects travel as plain dicts in their wire shape, so the pure core (rendering, slice building,
GC decisions) never depends on generated model classes. Writes of desired state go through
server-side apply with one field manager per component."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from typing import Any

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from yarl import URL

Obj = dict[str, Any]
_JSON_RESPONSES = {200: "object", 201: "object", 202: "object"}
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


@dataclass(frozen=True)
class Deadlines:
    """How long any one API call may take, in seconds: every request gpudra makes has a deadline,
    so a connection that a load balancer or NAT dropped without a word fails the call and the
    caller's retry opens a new one, instead of waiting forever on bytes that never come.

    ``connect``: TCP and TLS handshakes. Milliseconds on a healthy network; 10 s rides out two
    lost SYNs (retransmitted after 1 s and 3 s) and a busy API server's TLS.
    ``request``: a whole request that is not a watch, answer read. gpudra's requests are small
    (one object, or a page of 500) and answer in well under a second; admission webhooks default
    to a 10 s timeout. Past 30 s a dead connection is likelier than a slow answer, and a retry on
    a fresh connection the better bet (the API server itself gives up at 60 s, --request-timeout).
    ``watch``: the ``timeoutSeconds`` of each watch: the API server ends it then, and the caller
    lists or watches again (client-go's reflectors pick 5 to 10 minutes).
    ``watch_silence``: how far past ``watch`` a watch may go without a byte before it counts as
    dead (the server closes it at ``watch``; the margin is for a slow close)."""

    connect: float = 10.0
    request: float = 30.0
    watch: int = 300
    watch_silence: float = 30.0

    def __post_init__(self) -> None:
        # aiohttp reads a timeout of 0 as "no timeout", and kubernetes-asyncio a watch's
        # timeoutSeconds of 0 as "the server's default": either would undo the point of a deadline.
        for f in fields(self):
            seconds = getattr(self, f.name)
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"the {f.name} deadline must be a positive, finite number of seconds, not {seconds!r}")

    @classmethod
    def from_environment(cls, value: str | None = None) -> Deadlines:
        """The defaults, with ``$GPUDRA_API_DEADLINES`` (e.g. ``connect=1,request=2,watch=5``) in
        their place: tests shorten them to exercise a black-holed API server in seconds."""
        value = os.environ.get("GPUDRA_API_DEADLINES", "") if value is None else value
        types = {f.name: (int if f.name == "watch" else float) for f in fields(cls)}
        changes: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, _, number = (part.strip() for part in item.partition("="))
            if name not in types:
                raise ValueError(f"GPUDRA_API_DEADLINES: unknown deadline {name!r} (known: {', '.join(types)})")
            try:
                changes[name] = types[name](number)
            except ValueError:
                unit = "whole seconds" if types[name] is int else "seconds"
                raise ValueError(f"GPUDRA_API_DEADLINES: {name}={number!r} is not a number of {unit}") from None
        try:
            return replace(cls(), **changes)
        except ValueError as error:  # __post_init__'s refusal, which names the deadline
            raise ValueError(f"GPUDRA_API_DEADLINES: {error}") from None

    def for_request(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.request, sock_connect=self.connect)

    def for_watch(self, timeout_seconds: int) -> aiohttp.ClientTimeout:
        """No total: a watch streams for up to ``timeout_seconds``; silence past it is a dead connection."""
        return aiohttp.ClientTimeout(sock_connect=self.connect, sock_read=timeout_seconds + self.watch_silence)


# TCP keepalive on every connection to the API server: an idle pooled connection (or a quiet
# watch) that a middlebox dropped is found dead by the kernel after KEEPALIVE_IDLE +
# KEEPALIVE_INTERVAL * KEEPALIVE_PROBES = 60 s, rather than on the next request's deadline; it
# also keeps a NAT or load balancer from dropping an idle one (their idle timeouts are minutes).
KEEPALIVE_IDLE = 30  # seconds of silence before the first probe
KEEPALIVE_INTERVAL = 10  # seconds between unanswered probes
KEEPALIVE_PROBES = 3  # unanswered probes before the connection is reset


def keepalive_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """aiohttp's ``socket_factory``: the socket aiohttp would make, with TCP keepalive on."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):  # Linux names; macOS has TCP_KEEPALIVE for the idle time
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock


@dataclass(frozen=True)
class ResourceType:
    api_version: str  # "v1" or "group/version"
    kind: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced:
            if namespace is None and name is not None:
                raise ValueError(f"{self.kind} {name}: a namespace is required")
            if namespace is not None:
                base += f"/namespaces/{namespace}"
        path = f"{base}/{self.plural}"
        if name is not None:
            path += f"/{name}"
            if subresource:
                path += f"/{subresource}"
        return path


def _types(*rows: tuple[str, str, str, bool]) -> dict[tuple[str, str], ResourceType]:
    return {(v, k): ResourceType(v, k, p, n) for v, k, p, n in rows}


# Every kind gpudra reads or writes. Unknown kinds fail loudly rather than guessing a plural.
RESOURCE_TYPES = _types(
    ("v1", "Namespace", "namespaces", False),
    ("v1", "Node", "nodes", False),
    ("v1", "Pod", "pods", True),
    ("v1", "ServiceAccount", "serviceaccounts", True),
    ("v1", "Event", "events", True),
    ("v1", "ConfigMap", "configmaps", True),
    ("v1", "Service", "services", True),
    ("apps/v1", "DaemonSet", "daemonsets", True),
    ("apps/v1", "Deployment", "deployments", True),
    ("batch/v1", "Job", "jobs", True),
    ("coordination.k8s.io/v1", "Lease", "leases", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "Role", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", False),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy", "validatingadmissionpolicies", False),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding",
     "validatingadmissionpolicybindings", False),
    ("resource.k8s.io/v1", "DeviceClass", "deviceclasses", False),
    ("resource.k8s.io/v1", "ResourceSlice", "resourceslices", False),
    ("resource.k8s.io/v1", "ResourceClaim", "resourceclaims", True),
    ("resource.k8s.io/v1", "ResourceClaimTemplate", "resourceclaimtemplates", True),
    ("gpudra.io/v1alpha1", "GpuDraConfig", "gpudraconfigs", False),
)


def resource_type(api_version: str, kind: str) -> ResourceType:
    try:
        return RESOURCE_TYPES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"gpudra does not know the resource {api_version} {kind}") from None


def type_of(obj: Mapping[str, Any]) -> ResourceType:
    return resource_type(obj["apiVersion"], obj["kind"])


# What a call to the API server raises when it got no answer: a deadline passed (asyncio's
# TimeoutError, which aiohttp's timeouts are), the connection failed or dropped (OSError,
# aiohttp's ClientError). Callers retry these as they would an error the server answered
# (ApiException), usually soon; API_ERRORS is both.
NETWORK_ERRORS: tuple[type[Exception], ...] = (OSError, asyncio.TimeoutError, aiohttp.ClientError)
API_ERRORS: tuple[type[Exception], ...] = (ApiException, *NETWORK_ERRORS)


def rfc3339(when: datetime | float, *, microseconds: bool = False) -> str:
    """``when`` (a datetime, naive ones read as UTC, or seconds since the epoch) as the API server
    writes times: UTC with a ``Z``. Whole seconds, truncated, by default (metav1.Time: what the
    server stores, so a value written again compares equal); ``microseconds`` for metav1.MicroTime
    (a Lease's renewTime and acquireTime), always six digits, as client-go writes them."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when if microseconds else int(when), timezone.utc)
    elif when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if microseconds else "%Y-%m-%dT%H:%M:%SZ")


def is_status(error: BaseException, *codes: int) -> bool:
    return isinstance(error, ApiException) and error.status in codes


def error_message(error: BaseException) -> str:
    """The API server's own message (what a user would see from kubectl), else the exception text."""
    if isinstance(error, ApiException) and error.body:
        try:
            return str(json.loads(error.body).get("message") or error.body)
        except (ValueError, AttributeError):
            return str(error.body)
    return str(error)


async def connect(kubeconfig: str | None = None) -> client.ApiClient:
    """An API client from a kubeconfig file, else the in-cluster ServiceAccount."""
    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return decode_without_cyclic_gc(read_environment_once(client.ApiClient()))
        except config.ConfigException:
            pass
    return decode_without_cyclic_gc(read_environment_once(await config.new_client_from_config(config_file=kubeconfig)))


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a synchronous block (nothing may await inside:
    the switch is the whole process's), back on after it unless it was off already."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def decode_without_cyclic_gc(api: client.ApiClient) -> client.ApiClient:
    """Decode response bodies with the cyclic garbage collector paused.

    A decoded page is a tree of thousands of dicts and lists, all alive until the page is read,
    and none of them in a reference cycle; yet every 700 of them allocated start a collection
    that must traverse them, and every tenth of those the older ones as well. For a 500-slice
    page that was two thirds of its decoding time, and half the client CPU of a GC pass's
    listing at 2,000 nodes (bench/gc.py). Paused, the page costs one young collection once it is
    built. The library's own decoding runs unchanged inside (no await in it)."""
    library_deserialize: Callable[[Any, Any], Any] = api.deserialize

    def deserialize(response: Any, response_type: Any) -> Any:
        with cyclic_gc_paused():
            return library_deserialize(response, response_type)

    api.deserialize = deserialize  # type: ignore[method-assign]
    return api


def read_environment_once(api: client.ApiClient) -> client.ApiClient:
    """Take the API server's proxy from the environment now, not on every request.

    kubernetes-asyncio's aiohttp session trusts the environment, and aiohttp then reads it for
    each request in two thread-pool hops: ~/.netrc, then the proxy variables. That was half the
    CPU of a claim GET in the agent. The proxy for the API server (HTTPS_PROXY unless NO_PROXY
    exempts it, as client-go does; a kubeconfig's proxy-url wins) is resolved here once. netrc is
    dropped: every request carries its own credentials, and aiohttp refuses netrc credentials
    next to an Authorization header anyway."""
    rest = api.rest_client
    if not rest.proxy and api.configuration.host:
        try:
            proxy, auth = get_env_proxy_for_url(URL(api.configuration.host))
        except LookupError:  # no proxy, or NO_PROXY covers the API server
            pass
        else:
            rest.proxy = str(proxy)
            if auth is not None:
                rest.proxy_headers = {**(rest.proxy_headers or {}), "Proxy-Authorization": auth.encode()}
    rest.pool_manager._trust_env = False  # aiohttp has no public setter; tests check .trust_env
    # kubernetes-asyncio builds its connector without socket options; aiohttp (>= 3.12) asks
    # the connector's socket factory for each new connection's socket.
    connector = rest.pool_manager.connector
    if not isinstance(connector, aiohttp.TCPConnector):  # a check, not an assert: the agent runs at -OO
        raise TypeError(f"kubernetes-asyncio's connector is {connector!r}, not an aiohttp.TCPConnector")
    connector._socket_factory = keepalive_socket
    return api


def drop_idle_connections(api: client.ApiClient) -> None:
    """Close every pooled connection not in use. Called when a deadline has passed: whatever
    silently dropped that connection (a load balancer restarted, a NAT forgot its table) dropped
    the idle ones with it, and aiohttp hands them out oldest first, so a retry would wait out one
    deadline per dead connection before it got a fresh one. client-go's HTTP/2 transport does the
    same with its health check (ReadIdleTimeout, PingTimeout): the connection goes, not just the
    request. aiohttp has no public call for it; its pool is ``_conns``."""
    connector = api.rest_client.pool_manager.connector
    if connector is None:
        return
    for idle in connector._conns.values():
        for protocol, _ in idle:
            protocol.close()
    connector._conns.clear()


class Kube:
    """Dict-in, dict-out API calls. One instance per component; it carries the field manager."""

    def __init__(self, api: client.ApiClient, field_manager: str, deadlines: Deadlines | None = None) -> None:
        self.api = api
        self.field_manager = field_manager
        self.deadlines = deadlines or Deadlines.from_environment()

    async def request(self, method: str, path: str, *, body: Any = None,
                      query: Mapping[str, Any] | None = None, content_type: str | None = None,
                      accept: str = "application/json") -> Obj:
        """One request, failing with :class:`asyncio.TimeoutError` past its deadline."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            return await self.api.call_api(
                path, method, query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
                header_params=headers, body=body, auth_settings=["BearerToken"],
                response_types_map=_JSON_RESPONSES, _return_http_data_only=True, _preload_content=True,
                _request_timeout=self.deadlines.for_request(),
            )
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors too
            drop_idle_connections(self.api)
            raise

    async def server_minor(self) -> int | None:
        """The API server's Kubernetes minor version (/version, which every authenticated user may
        read; ``"37+"`` on some distributions reads 37); None when it does not say."""
        minor = str((await self.request("GET", "/version")).get("minor", ""))
        digits = "".join(ch for ch in minor if ch.isdigit())
        return int(digits) if digits else None

    async def get(self, rtype: ResourceType, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return await self.request("GET", rtype.path(namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def list(self, rtype: ResourceType, namespace: str | None = None, *,
                   label_selector: str | None = None, field_selector: str | None = None,
                   page_size: int = 500, metadata_only: bool = False) -> AsyncIterator[Obj]:
        """Every matching object, fetched page by page (``limit``/``continue``).

        ``metadata_only`` asks the API server for PartialObjectMetadata (apiVersion, kind and
        metadata of each object; no spec, no status): the cheap way to learn names, UIDs and labels."""
        token: str | None = None
        accept = METADATA_ONLY if metadata_only else "application/json"
        while True:
            query = {"labelSelector": label_selector, "fieldSelector": field_selector,
                     "limit": page_size, "continue": token}
            page = await self.request("GET", rtype.path(namespace), query=query, accept=accept)
            for item in page.get("items") or []:
                yield item
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    async def create(self, obj: Obj, *, dry_run: bool = False) -> Obj:
        rtype = type_of(obj)
        namespace = obj["metadata"].get("namespace")
        return await self.request("POST", rtype.path(namespace), body=obj,
                                  query={"dryRun": "All" if dry_run else None,
                                         "fieldManager": self.field_manager})

    async def apply(self, obj: Obj, *, force: bool = True, dry_run: bool = False,
                    subresource: str | None = None) -> Obj:
        """Server-side apply of ``obj`` (the full desired state this component owns)."""
        rtype = type_of(obj)
        meta = obj["metadata"]
        return await self.request(
            "PATCH", rtype.path(meta.get("namespace"), meta["name"], subresource),
            body=obj, content_type="application/apply-patch+yaml",
            query={"fieldManager": self.field_manager, "force": "true" if force else None,
                   "dryRun": "All" if dry_run else None},
        )

    async def patch(self, rtype: ResourceType, name: str, patch: Obj, *, namespace: str | None = None,
                    subresource: str | None = None, kind: str = "merge") -> Obj:
        return await self.request(
            "PATCH", rtype.path(namespace, name, subresource), body=patch,
            content_type=f"application/{kind}-patch+json", query={"fieldManager": self.field_manager},
        )

    async def delete(self, rtype: ResourceType, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     grace_period_seconds: int | None = None,
                     propagation: str | None = None) -> bool:
        """Delete; False when it was already gone. Preconditions make a stale decision a 409."""
        options: Obj = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            options["preconditions"] = preconditions
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        if propagation:
            options["propagationPolicy"] = propagation
        try:
            await self.request("DELETE", rtype.path(namespace, name), body=options)
            return True
        except ApiException as error:
            if error.status == 404:
                return False
            raise

    async def watch(self, rtype: ResourceType, namespace: str | None = None, *,
                    label_selector: str | None = None, field_selector: str | None = None,
                    resource_version: str | None = None,
                    timeout_seconds: int | None = None) -> AsyncIterator[tuple[str, Obj]]:
        """Stream (event type, object) pairs from one watch request until the server closes it
        (after ``timeout_seconds``, by default the deadlines' ``watch``), or until it has been
        silent for longer than that (:class:`asyncio.TimeoutError`: a dead connection).

        Callers own the list-then-watch loop and handle ``ERROR`` events (410 Gone: relist); the
        informer-like one is gpudra_core.listwatch.ListThenWatch."""
        timeout_seconds = self.deadlines.watch if timeout_seconds is None else timeout_seconds
        query = {"watch": "true", "labelSelector": label_selector, "fieldSelector": field_selector,
                 "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": timeout_seconds}
        try:
            response = await self.api.call_api(
                rtype.path(namespace), "GET", query_params=[(k, v) for k, v in query.items() if v is not None],
                header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                _preload_content=False, _request_timeout=self.deadlines.for_watch(timeout_seconds),
            )
        except TimeoutError:
            drop_idle_connections(self.api)
            raise
        # One event per line, but a line can exceed aiohttp's readline limit (a slice of 128 MIG
        # devices is ~140 KiB), so split the byte stream ourselves.
        buffer = b""
        try:
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        event = json.loads(line)
                        yield event["type"], event["object"]
        except TimeoutError:
            drop_idle_connections(self.api)
            raise
        finally:
            response.release()


EVENT_NAMESPACE = "default"  # where a cluster-scoped object's (and a Node's) Events go, as the kubelet's do


def core_event(involved: Obj, type_: str, reason: str, message: str, *, component: str,
               host: str | None = None) -> Obj:
    """A core/v1 Event about ``involved`` (its object reference), in the ``default`` namespace where
    ``kubectl describe`` finds a cluster-scoped object's Events, posted once (count 1)."""
    now = rfc3339(datetime.now(timezone.utc))
    source = {"component": component, **({"host": host} if host else {})}
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": EVENT_NAMESPACE},
            "involvedObject": involved, "type": type_, "reason": reason, "message": message[:1024],
            "source": source, "reportingComponent": component,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}


async def dry_run_create(kube: Kube, obj: Obj) -> tuple[Obj | None, str]:
    """``obj`` as the API server would store it (a server-side dry run: nothing is stored), or
    (None, why) when the server refuses it. Errors other than a refusal (the API server
    unreachable) are raised: the caller retries. What a feature probe asks: does the server keep
    these fields, or drop them because a feature gate is off?"""
    try:
        return await kube.create(obj, dry_run=True), ""
    except ApiException as error:
        if not is_status(error, 400, 403, 404, 422):
            raise
        return None, error_message(error)
