"""The agent's command line: what reaches file names is checked before the agent starts; the event loop
it runs on is the standard one unless told otherwise, and the loop it names is the one that runs."""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile

import pytest
import uvloop

from gpudra_driver import agent_cmd, eventloop


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


async def _running_loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_the_agent_runs_on_the_standard_loop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUDRA_EVENT_LOOP", raising=False)
    loop_type = eventloop.run(_running_loop_type(), parse().event_loop)
    assert not issubclass(loop_type, uvloop.Loop) and issubclass(loop_type, asyncio.BaseEventLoop)


def test_uvloop_is_one_flag_or_one_variable_away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUDRA_EVENT_LOOP", raising=False)
    assert eventloop.run(_running_loop_type(), parse("--event-loop", "uvloop").event_loop) is uvloop.Loop
    monkeypatch.setenv("GPUDRA_EVENT_LOOP", "uvloop")  # spec.agent.extraEnv
    assert eventloop.run(_running_loop_type(), parse().event_loop) is uvloop.Loop


def test_an_unknown_loop_is_refused_by_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--event-loop", "trio")
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        eventloop.loop_factory("trio")


@pytest.mark.parametrize("name", eventloop.LOOPS)
def test_each_loop_runs_what_the_agent_needs_of_it(name: str) -> None:
    """A signal handler (the agent's SIGTERM), a thread hand-off (the checkpoint stager) and a unix
    socket server (the gRPC and metrics sockets live on unix sockets too)."""

    async def main() -> tuple[bool, int, bytes]:
        loop = asyncio.get_running_loop()
        got_signal = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, got_signal.set)
        try:
            signal.raise_signal(signal.SIGUSR1)
            await asyncio.wait_for(got_signal.wait(), 10)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
        from_thread = await asyncio.to_thread(sum, [1, 2, 3])

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        with tempfile.TemporaryDirectory() as directory:
            server = await asyncio.start_unix_server(echo, path=f"{directory}/s.sock")
            async with server:
                reader, writer = await asyncio.open_unix_connection(f"{directory}/s.sock")
                writer.write(b"ping\n")
                answer = await asyncio.wait_for(reader.readline(), 10)
                writer.close()
        return got_signal.is_set(), from_thread, answer

    assert eventloop.run(main(), name) == (True, 6, b"ping\n")


def test_device_health_is_on_with_nvidias_informational_xids_and_the_list_is_checked(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse()
    assert args.device_health and args.informational_xids == {13, 31, 43, 45, 68, 109}
    assert args.health_taint_effect == "NoSchedule"
    assert parse("--informational-xids", "13, 79", "--no-device-health").informational_xids == {13, 79}
    assert not parse("--no-device-health").device_health
    with pytest.raises(SystemExit) as info:
        parse("--informational-xids", "13,x")
    assert info.value.code == 2 and "not a comma-separated list of XID numbers" in capsys.readouterr().err
