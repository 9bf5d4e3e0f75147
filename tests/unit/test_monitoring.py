"""The monitoring kit (manifests/monitoring/) against the real promtool: the alerts parse and pass
their unit tests (tests/monitoring/), every alert has a case that fires and one that does not, the
dashboard's PromQL parses, and every gpudra metric the alerts and the dashboard read is one the
components export. promtool: hack/promtool-bin.sh (make test builds it)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from promtool import (MONITORING, REPO, alerts, as_promql, dashboard, dashboard_queries, metric_names, panels,
                      promtool, rule_groups)

TESTS = REPO / "tests" / "monitoring"
TEST_FILES = sorted(TESTS.glob("*.test.yaml"))
CHART_FILES = REPO / "manifests" / "helm" / "gpudra" / "files"
DOCS = REPO / "docs" / "metrics.md"
RULES_FILE = "gpudra-rules.yaml"  # what the test files' rule_files name


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    """The PrometheusRule's groups as a plain rule file, beside copies of the promtool test files."""
    (tmp_path / RULES_FILE).write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    for test in TEST_FILES:
        shutil.copy(test, tmp_path)
    return tmp_path


def test_promtool_checks_the_rules(rules_dir: Path) -> None:
    result = promtool("check", "rules", rules_dir / RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


@pytest.mark.parametrize("test_file", [t.name for t in TEST_FILES])
def test_promtool_unit_tests_pass(rules_dir: Path, test_file: str) -> None:
    result = promtool("test", "rules", test_file, cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_wrong_expectation_fails_the_unit_tests(rules_dir: Path) -> None:
    """The unit tests can fail: one expected alert's label changed makes promtool report it."""
    test = rules_dir / "alerts.test.yaml"
    text = test.read_text()
    assert "severity: critical, job: gpudra-agent, pod: gpudra-agent-a" in text
    test.write_text(text.replace("severity: critical, job: gpudra-agent, pod: gpudra-agent-a",
                                 "severity: warning, job: gpudra-agent, pod: gpudra-agent-a", 1))
    result = promtool("test", "rules", test.name, cwd=rules_dir)
    assert result.returncode != 0 and "GpudraPrepareErrors" in result.stdout + result.stderr


def alert_cases() -> tuple[set[str], set[str]]:
    """(alerts with a case where they fire, alerts with a case where they do not), over every test file."""
    fires, quiet = set(), set()
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    return fires, quiet


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    names = {a["alert"] for a in alerts()}
    fires, quiet = alert_cases()
    assert not names - fires, f"alerts no test in {TESTS} sees firing: {sorted(names - fires)}"
    assert not names - quiet, f"alerts no test in {TESTS} sees quiet: {sorted(names - quiet)}"
    assert not (fires | quiet) - names, f"tests of alerts that do not exist: {sorted((fires | quiet) - names)}"


def test_every_alert_tells_a_person_what_to_do() -> None:
    documented = DOCS.read_text()
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        annotations = alert["annotations"]
        assert {"summary", "description", "runbook_url"} <= annotations.keys(), name
        assert annotations["runbook_url"].endswith("/docs/metrics.md#alerts"), name
        assert f"| `{name}` |" in documented, f"{name} is not in docs/metrics.md's table of alerts"
    assert "\n## Alerts\n" in documented  # the runbook's anchor


def test_the_dashboards_promql_parses(tmp_path: Path) -> None:
    """Every panel's and variable's query, as Prometheus gets it from Grafana, in a recording rule
    that promtool checks (it parses the expression as Prometheus does)."""
    queries = dashboard_queries(dashboard())
    rules = [{"record": f"gpudra_dashboard:query_{i}", "expr": as_promql(expr)} for i, expr in enumerate(queries.values())]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", "--lint=none", path)
    assert result.returncode == 0, result.stdout + result.stderr + "\n" + "\n".join(queries)
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def exported_metric_names() -> set[str]:
    """Every series name the operator and the agent export, from their real prometheus_client
    collectors in the default registry, after importing both metrics modules (the agent's per-pod
    claim series included). A counter counts as its _total, a histogram as its _bucket, _sum and
    _count, an info as its _info."""
    import importlib

    from prometheus_client import REGISTRY

    for module in ("gpudra_driver.metrics", "gpudra_operator.metrics"):  # importing registers them
        importlib.import_module(module)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""),
                "info": ("_info",)}
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def used_metric_names() -> dict[str, set[str]]:
    """gpudra metric name -> where the alerts or the dashboard read it."""
    used: dict[str, set[str]] = {}
    for alert in alerts():
        for name in metric_names(alert["expr"]):
            used.setdefault(name, set()).add(f"alert {alert['alert']}")
    for where, expr in dashboard_queries(dashboard()).items():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(f"dashboard {where}")
    return used


def test_every_metric_the_alerts_and_the_dashboard_read_is_exported() -> None:
    exported = exported_metric_names()
    assert {"gpudra_agent_node_prepare_duration_seconds_bucket", "gpudra_reconcile_total",
            "gpudra_agent_build_info", "gpudra_agent_claim_device_info"} <= exported  # the collection works
    used = used_metric_names()
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not missing, f"read but exported by no component: {missing}"


def test_the_dashboard_covers_the_components() -> None:
    """Panels for what issue 36 asks: slices and devices per node, devices by health, prepare and
    unprepare latency (p50/p99 from the buckets) and errors, prepared claims, MPS daemons, the GC,
    reconciles and errors, agents ready vs desired, the leader, and GPUs per pod."""
    used = set(used_metric_names())
    for name in ("gpudra_agent_published_resourceslices", "gpudra_agent_published_devices", "gpudra_agent_devices",
                 "gpudra_agent_node_prepare_duration_seconds_bucket", "gpudra_agent_node_unprepare_duration_seconds_bucket",
                 "gpudra_agent_node_prepare_errors_total", "gpudra_agent_node_unprepare_errors_total",
                 "gpudra_agent_prepared_claims", "gpudra_agent_mps_daemons", "gpudra_resourceslices_stale_found_total",
                 "gpudra_resourceslices_stale_deleted_total", "gpudra_reconcile_total", "gpudra_reconcile_errors_total",
                 "gpudra_agents_ready", "gpudra_agents_desired", "gpudra_leader_election_master_status",
                 "gpudra_agent_claim_device_info"):
        assert name in used, name
    queries = dashboard_queries(dashboard()).values()
    for op in ("prepare", "unprepare"):
        for quantile in ("0.5", "0.99"):
            assert any(f"histogram_quantile({quantile}, sum by (le) (rate(gpudra_agent_node_{op}_duration_seconds_bucket"
                       in q for q in queries), (op, quantile)
    assert any("DCGM_FI_DEV_GPU_UTIL" in q for q in queries) and any("DCGM_FI_DEV_FB_USED" in q for q in queries)


def test_the_dashboard_is_importable_as_it_is() -> None:
    """Current schema, the data source a variable of type prometheus that every panel and query
    uses, unique panel ids, no two panels on the same cell."""
    board = dashboard()
    assert board["schemaVersion"] >= 41 and board["uid"] == "gpudra"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"node", "config", "namespace"} <= variables.keys()
    ids, cells = set(), set()
    for panel in panels(board):
        assert panel["id"] not in ids, panel["id"]
        ids.add(panel["id"])
        pos = panel["gridPos"]
        occupied = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert pos["x"] + pos["w"] <= 24 and not occupied & cells, panel["title"]
        cells |= occupied
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, variable["name"]


def test_the_per_pod_queries_are_the_tested_ones() -> None:
    """The dashboard's per-pod GPU queries (variables at "All") and the docs' example queries are
    expressions tests/monitoring/per-pod-gpus.test.yaml evaluates against dcgm-exporter-shaped series."""
    tested = {case["expr"] for test in yaml.safe_load((TESTS / "per-pod-gpus.test.yaml").read_text())["tests"]
              for case in test.get("promql_expr_test", [])}
    table = next(p for p in panels(dashboard()) if p["title"] == "GPUs per pod")
    for target in table["targets"]:
        assert as_promql(target["expr"]) in tested, target["expr"]
    section = DOCS.read_text().split("\n## Per-pod GPU metrics\n", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"```promql\n(.*?)\n```", section, re.S)
    assert len(documented) >= 2
    for query in documented:
        assert query.strip() in tested, query


@pytest.mark.parametrize("name", ["prometheusrule.yaml", "grafana-dashboard.json"])
def test_the_chart_ships_the_monitoring_files_byte_for_byte(name: str) -> None:
    assert (CHART_FILES / name).read_bytes() == (MONITORING / name).read_bytes(), \
        f"cp manifests/monitoring/{name} manifests/helm/gpudra/files/"


def test_the_agents_podmonitor_honors_the_claim_series_labels() -> None:
    """gpudra_agent_claim_device_info's own namespace and pod labels must win over the target's."""
    monitors: dict[str, Any] = {o["kind"]: o for o in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text())}
    (endpoint,) = monitors["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    for kind in ("PodMonitor", "ServiceMonitor"):  # job="gpudra-agent" / "gpudra-operator", as the alerts expect
        assert monitors[kind]["spec"]["jobLabel"] == "app.kubernetes.io/name"
    jobs = set(re.findall(r'job="([^"]+)"', "\n".join(a["expr"] for a in alerts())))
    assert jobs == {"gpudra-agent"} and monitors["PodMonitor"]["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "gpudra-agent"}
