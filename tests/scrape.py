"""Reading a component's Prometheus /metrics in tests."""

from __future__ import annotations

import urllib.request


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample_value(text: str, name: str, labels: str = "") -> float | None:
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None
