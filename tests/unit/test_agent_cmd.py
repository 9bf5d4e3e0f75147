"""The agent's command line: what reaches file names is checked before the agent starts."""

from __future__ import annotations

import argparse

import pytest

from gpudra_driver import agent_cmd


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpudra")
    agent_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["agent", *argv])


def test_a_pod_uid_names_the_plugin_sockets_as_given() -> None:
    assert parse("--pod-uid", "0c1d2e3f-0000-4000-8000-00000000000a").pod_uid == "0c1d2e3f-0000-4000-8000-00000000000a"


@pytest.mark.parametrize("value", ["../../x", "a/b", "uid\n", "", "x" * 65])
def test_a_pod_uid_that_could_escape_the_socket_directory_is_refused(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--pod-uid", value)
    assert info.value.code == 2 and "is not a pod UID" in capsys.readouterr().err


def test_the_pod_uid_from_the_environment_is_checked_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("POD_UID", "../etc")
    with pytest.raises(SystemExit):
        parse()
    assert "is not a pod UID" in capsys.readouterr().err
