"""A Kube adapter that records every request it makes (method, path), for tests that assert how
many requests of which kind a piece of the operator costs against the real API server."""

from __future__ import annotations

from typing import Any

from gpudra_core.kubeapi import Kube, Obj


class CountingKube(Kube):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[tuple[str, str]] = []

    @property
    def methods(self) -> list[str]:
        return [method for method, _ in self.requests]

    async def request(self, method: str, path: str, **kwargs: Any) -> Obj:  # type: ignore[override]
        self.requests.append((method, path))
        return await super().request(method, path, **kwargs)
