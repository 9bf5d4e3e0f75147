"""A watch recorded for a bench: every event with its arrival time (``time.perf_counter``), and
:meth:`WatchLog.first` to await the first event after a mark that matches (no sleeps). Shared by
``agent_publish`` (a node's slices) and ``pod_start`` (a namespace's pods)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gpudra_core.kubeapi import Kube, Obj, ResourceType

TIMEOUT_S = 60


class WatchLog:
    def __init__(self, kube: Kube, resource: ResourceType, namespace: str | None = None,
                 field_selector: str | None = None, timeout: float = TIMEOUT_S) -> None:
        """``timeout``: how long :meth:`first` waits, in seconds."""
        self.kube, self.resource, self.namespace, self.field_selector = kube, resource, namespace, field_selector
        self.timeout = timeout
        self.events: list[tuple[float, str, Obj]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        query = {"fieldSelector": self.field_selector} if self.field_selector else None
        page = await self.kube.request("GET", self.resource.path(self.namespace), query=query)
        self._task = asyncio.create_task(self._run(page["metadata"]["resourceVersion"]))

    async def _run(self, version: str) -> None:
        while True:  # the server ends a watch after its timeout; go on from the last version seen
            async for kind, obj in self.kube.watch(self.resource, self.namespace, field_selector=self.field_selector,
                                                   resource_version=version):
                if kind == "ERROR":
                    raise RuntimeError(f"{self.resource.kind} watch failed: {obj}")
                version = obj["metadata"]["resourceVersion"]
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.events.append((time.perf_counter(), kind, obj))
                    self._changed.set()

    def mark(self) -> int:
        return len(self.events)

    async def first(self, since: int, match: Callable[[str, Obj], bool], what: str,
                    check: Callable[[str, Obj], None] = lambda kind, obj: None,
                    failure: Callable[[], str] = lambda: "") -> tuple[float, Obj]:
        """Arrival time and object of the first event after ``since`` that ``match``es; ``check``
        raises on an event that means it never will; ``failure`` adds context to a timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self._task is not None and self._task.done():
                self._task.result()  # the watch's error
            for at, kind, obj in self.events[since:]:
                try:
                    check(kind, obj)
                except RuntimeError as error:
                    raise RuntimeError(f"{error}\n{failure()}") from None
                if match(kind, obj):
                    return at, obj
            since = len(self.events)
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {self.resource.kind} event for {what} within {self.timeout:g}s\n{failure()}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
