"""List, then watch, one kind of object, as an informer does: the operator's watch-fed state (the
slices it counts, the claims whose devices are allocated) and the agent's view of its own
GpuDraConfig keep themselves current with this.

A list is paged and one snapshot (every page at the first page's resourceVersion); the watch
resumes from it. A clean end of the watch (the server's timeout) resumes from the last version
seen; ``410 Gone`` (an ``ERROR`` event) lists again; a failure is retried with backoff."""

from __future__ import annotations

import logging
from typing import Protocol

from tenacity import AsyncRetrying, RetryCallState, wait_exponential

from gpudra_core.kubeapi import Kube, Obj, ResourceType

log = logging.getLogger(__name__)

RETRY_INITIAL = 0.5  # seconds before the first retry of a failed list or watch
RETRY_MAX = 30.0


class ListWatchState(Protocol):
    """What a list-then-watch feeds: a fresh list page by page, then each change."""

    def list_started(self) -> None: ...

    async def list_page(self, items: list[Obj]) -> None: ...

    async def list_done(self) -> None: ...

    def changed(self, obj: Obj) -> None: ...

    def deleted(self, obj: Obj) -> None: ...


class ListThenWatch:
    def __init__(self, kube: Kube, rtype: ResourceType, what: str, *, field_selector: str | None = None,
                 page_size: int = 500) -> None:
        self.kube, self.rtype, self.what = kube, rtype, what
        self.field_selector, self.page_size = field_selector, page_size
        self.version: str | None = None  # where the watch resumes; None: list again

    async def run(self, state: ListWatchState) -> None:
        while True:
            await AsyncRetrying(wait=wait_exponential(multiplier=RETRY_INITIAL, max=RETRY_MAX),
                                before_sleep=self._log_retry)(self._sync, state)

    def _log_retry(self, retry: RetryCallState) -> None:
        error = retry.outcome.exception() if retry.outcome else None
        delay = retry.next_action.sleep if retry.next_action else 0.0
        log.warning("watching %s failed (%r); retrying in %.1fs", self.what, error, delay)

    async def _sync(self, state: ListWatchState) -> None:
        if self.version is None:
            await self._list(state)
        async for kind, obj in self.kube.watch(self.rtype, field_selector=self.field_selector,
                                               resource_version=self.version):
            if kind == "ERROR":  # 410 Gone: the version is too old to resume from
                self.version = None
                return
            self.version = obj["metadata"].get("resourceVersion") or self.version
            if kind == "DELETED":
                state.deleted(obj)
            elif kind != "BOOKMARK":
                state.changed(obj)

    async def _list(self, state: ListWatchState) -> None:
        state.list_started()
        token: str | None = None
        while True:
            page = await self.kube.request("GET", self.rtype.path(), query={
                "fieldSelector": self.field_selector, "limit": self.page_size, "continue": token})
            await state.list_page(page.get("items") or [])
            token = page["metadata"].get("continue")
            if not token:
                break
        self.version = str(page["metadata"]["resourceVersion"])
        await state.list_done()
