"""`gpudra explain`'s failures that need no cluster: each is one line on stderr and exit 1, never a
traceback, or a usage error (exit 2) for a malformed option (the cluster-backed ones, an unknown
feature gate and a missing gpudra-allocator among them, are in tests/integration/test_explain_cmd.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpudra.cli import kubectl_plugin, main
from gpudra_operator.explain_cmd import feature_gates


def closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    return path


@pytest.mark.parametrize("case", ["no-file", "not-yaml", "unreachable", "bad-ref"])
def test_bad_input_is_one_line_and_exit_1(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, config = "team/trainer", tmp_path / "missing"
    if case == "not-yaml":
        config.write_text("clusters: [")
    elif case == "unreachable":
        config = kubeconfig(tmp_path, f"https://127.0.0.1:{closed_port()}")
    elif case == "bad-ref":
        ref, config = "a/b/c", kubeconfig(tmp_path, "https://127.0.0.1:1")
    assert main(["explain", "pod", ref, "--kubeconfig", str(config)]) == 1
    out, err = capsys.readouterr()
    expected = {"no-file": f"gpudra explain: kubeconfig {config}: no such file",
                "not-yaml": "gpudra explain: no usable kubeconfig: ",
                "unreachable": "gpudra explain: cannot reach the API server: ",
                "bad-ref": "gpudra explain: 'a/b/c' is not NAMESPACE/NAME"}[case]
    assert err.startswith(expected) and len(err.splitlines()) == 1 and out == ""


def test_the_kubectl_plugin_offers_only_what_reads_or_removes_on_a_users_behalf(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        kubectl_plugin(["operator"])
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'operator' (choose from " in err
    offered = {c.strip(" '") for c in err.split("(choose from ", 1)[1].split(")", 1)[0].split(",")}
    assert {"explain", "uninstall"} <= offered and not {"operator", "agent", "render"} & offered


def test_feature_gates_read_as_kube_scheduler_reads_them() -> None:
    assert feature_gates("DRAConsumableCapacity=false, DRADeviceTaints=TRUE,DRAAdminAccess=1,") == {
        "DRAConsumableCapacity": False, "DRADeviceTaints": True, "DRAAdminAccess": True}
    assert feature_gates("") == {}


@pytest.mark.parametrize("plugin", [False, True])
def test_a_malformed_feature_gate_is_a_usage_error(plugin: bool, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        (kubectl_plugin if plugin else main)(["explain", "pod", "team/trainer", "--feature-gates", "DRAAdminAccess"])
    assert usage.value.code == 2
    assert "argument --feature-gates: 'DRAAdminAccess' is not Name=true or Name=false" in capsys.readouterr().err
