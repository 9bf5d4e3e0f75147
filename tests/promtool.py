"""Prometheus' promtool in tests: the binary hack/promtool-bin.sh builds, and the PromQL the shipped
monitoring objects hold (manifests/monitoring/: the PrometheusRule's alerts and the Grafana dashboard)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from cachedtool import REPO, tool_dir

MONITORING = REPO / "manifests" / "monitoring"
FIX = ("make promtool (builds Prometheus' promtool from the Go module proxy into ~/.cache/gpudra/promtool/<version>; "
       "then set GPUDRA_PROMTOOL_DIR to the directory it prints, as make test does)")
# Grafana's interval variables, and the value a PromQL parser needs in their place.
_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
_VARIABLE = re.compile(r"\$\{\w+(:\w+)?\}|\$\w+")
_METRIC = re.compile(r"\bgpudra_[A-Za-z0-9_]+\b")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$")


def promtool_binary() -> Path:
    """$GPUDRA_PROMTOOL_DIR/promtool (as make test sets it), else hack/promtool-bin.sh's cache."""
    directory, where = tool_dir("GPUDRA_PROMTOOL_DIR", "promtool-bin.sh", "PROMETHEUS_VERSION", "promtool")
    binary = directory / "promtool"
    if not os.access(binary, os.X_OK):
        raise AssertionError(f"{where} has no promtool binary: {FIX}")
    return binary


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool_binary()), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def rule_groups() -> list[dict[str, Any]]:
    """The PrometheusRule's groups: what a rule file (`groups:`) holds."""
    return list(yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"])


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return dict(json.loads((MONITORING / "grafana-dashboard.json").read_text()))


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_queries(board: dict[str, Any]) -> dict[str, str]:
    """Where -> PromQL, for every panel target and every query variable (label_values' selector)."""
    queries = {}
    for panel in panels(board):
        for target in panel.get("targets", []):
            queries[f"panel {panel['id']} ({panel['title']}) target {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = _LABEL_VALUES.match(query)
            assert match, f"variable {variable['name']}: {query!r} is not label_values(<selector>, <label>)"
            queries[f"variable {variable['name']}"] = match.group(1)
    return queries


def as_promql(expr: str) -> str:
    """A dashboard expression as Prometheus would get it: the interval variables a duration, the
    others (label matchers' values) "All"."""
    return _VARIABLE.sub(".*", _INTERVALS.sub("5m", expr))


def metric_names(expr: str) -> set[str]:
    """gpudra's metric names an expression reads."""
    return set(_METRIC.findall(expr))
