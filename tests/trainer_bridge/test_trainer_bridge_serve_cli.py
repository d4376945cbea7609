"""`spanrl serve` settings: flags, then OTEL_SPANRL_SERVE_* variables, then defaults."""

from __future__ import annotations

import argparse

import pytest

from spanrl.child_processes import free_port
from spanrl.env_settings import SettingError
from spanrl.trainer_bridge.torch_backend import serve_cli

from .ctrl_c import as_in_a_terminal


def parse(argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return serve_cli.SETTINGS.from_args(parser.parse_args(["serve", *argv]))


def test_flags_beat_environment_beats_defaults(monkeypatch):
    monkeypatch.delenv("OTEL_SPANRL_SERVE_PORT", raising=False)
    assert parse(["m"]).port == 8000 and parse(["m"]).host == "127.0.0.1"
    monkeypatch.setenv("OTEL_SPANRL_SERVE_PORT", "9100")
    monkeypatch.setenv("OTEL_SPANRL_SERVE_TOKEN", "from-env")
    settings = parse(["m"])
    assert settings.port == 9100 and settings.token == "from-env"
    assert "from-env" not in serve_cli.SETTINGS.describe(settings)
    assert parse(["m", "--port", "9200", "--max-batch-size", "8"]).port == 9200
    monkeypatch.setenv("OTEL_SPANRL_SERVE_PORT", "eighty")
    with pytest.raises(SettingError, match="OTEL_SPANRL_SERVE_PORT"):
        parse(["m"])


def test_single_process_is_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("OTEL_SPANRL_SERVE_SINGLE_PROCESS", raising=False)
    assert parse(["m"]).single_process is False
    assert parse(["m", "--single-process"]).single_process is True
    monkeypatch.setenv("OTEL_SPANRL_SERVE_SINGLE_PROCESS", "yes")
    assert parse(["m"]).single_process is True
    monkeypatch.setenv("OTEL_SPANRL_SERVE_SINGLE_PROCESS", "sometimes")
    with pytest.raises(SettingError, match="OTEL_SPANRL_SERVE_SINGLE_PROCESS"):
        parse(["m"])


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" not in status.read()  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("interrupted", ["engine process", "both (Ctrl-C in a terminal)"])
def test_spanrl_serve_answers_and_sigint_stops_both_processes(tiny_model_dir, interrupted):
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import openai

    port = free_port()
    server = subprocess.Popen(as_in_a_terminal([sys.executable, "-m", "spanrl", "serve", str(tiny_model_dir), "--port",
                                                str(port), "--threads", "1", "--served-model-name", "tiny"]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "spanrl serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with open(f"/proc/{server.pid}/task/{server.pid}/children") as children:
            (front_end,) = [int(pid) for pid in children.read().split()]  # the HTTP front end
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage.completion_tokens >= 1
        os.kill(server.pid, signal.SIGINT)
        if interrupted.startswith("both"):
            os.kill(front_end, signal.SIGINT)
        assert server.wait(30) == 0, server.stdout.read()
        deadline = time.monotonic() + 10
        while process_alive(front_end):
            assert time.monotonic() < deadline, "the HTTP front end outlived spanrl serve"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_spanrl_serve_on_a_taken_port_says_so_and_exits_1(tiny_model_dir):
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "spanrl", "serve", str(tiny_model_dir), "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2  # a taken port is a setting to change: one line, exit 2
    assert f"spanrl serve: cannot serve on 127.0.0.1:{port}" in result.stderr
    assert "Address already in use" in result.stderr
    assert "Traceback" not in result.stderr
