"""The policy server's HTTP front end in its own process: the link to the engine, and each side
going away. (Every test of test_trainer_bridge_server.py also runs against this front end.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

from .ctrl_c import as_in_a_terminal

MESSAGES = [{"role": "user", "content": "What is 37 + 45?"}]


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def long_request(handle, engine, outcome: dict) -> threading.Thread:
    """A request that decodes until the context is full, from a thread; its answer lands in ``outcome``."""

    def ask():
        try:
            response = httpx.post(f"{handle.base_url}/chat/completions", timeout=60, json={
                "model": engine.model_name, "messages": MESSAGES, "max_tokens": 900})
        except httpx.HTTPError as exc:  # the front end was killed under it
            outcome["error"] = exc
        else:
            outcome["status"], outcome["body"] = response.status_code, response.json()

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def forbid_eos(engine):
    """No token ends a sequence any more: a request runs to its max_tokens."""
    engine.eos_ids = set()


def test_the_api_process_does_not_import_torch():
    code = ("import sys, spanrl.trainer_bridge.torch_backend.server.api_process, "
            "spanrl.trainer_bridge.torch_backend.server.app, spanrl.trainer_bridge.torch_backend.engine.link; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_requests_version_pushes_and_stats_cross_the_link(engine):
    handle = serve_in_process(engine, "127.0.0.1", 0)
    try:
        api = openai.OpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
        reply = api.chat.completions.with_raw_response.create(model=engine.model_name, messages=MESSAGES,
                                                              max_tokens=4)
        assert reply.headers["x-spanrl-policy-version"] == "0"
        engine.swap_weights(engine.model.state_dict(), version=3)
        # the version reaches the front end with no request in between (pushed by the engine's side)
        wait_for(lambda: httpx.get(f"{handle.base_url}/models").headers["x-spanrl-policy-version"] == "3")
        policy = httpx.get(f"{handle.url}/spanrl/v1/policy").json()
        assert policy["version"] == 3 and policy["stats"] == engine.describe()["stats"]
        assert policy["stats"]["tokens_generated"] >= 1
    finally:
        handle.stop()
    assert handle.process.returncode == 0


def test_a_gone_engine_side_answers_503_and_the_front_end_exits(engine):
    forbid_eos(engine)
    handle = serve_in_process(engine, "127.0.0.1", 0)
    outcome: dict = {}
    try:
        asking = long_request(handle, engine, outcome)
        wait_for(lambda: engine.stats.tokens_generated > 5)  # decoding now
        handle.engine_host.channel.close()  # what the engine's process dying looks like from the child
        asking.join(30)
        assert outcome["status"] == 503, outcome
        assert "engine" in outcome["body"]["error"]["message"]
        assert handle.process.wait(20) == 0  # it shut its HTTP server down by itself
    finally:
        handle.stop()


def test_a_killed_front_end_cancels_its_requests_in_the_engine(engine):
    forbid_eos(engine)
    handle = serve_in_process(engine, "127.0.0.1", 0)
    outcome: dict = {}
    try:
        long_request(handle, engine, outcome)
        wait_for(lambda: engine.stats.tokens_generated > 5)
        os.kill(handle.process.pid, signal.SIGKILL)
        assert handle.engine_host.closed.wait(10)
        # the orphaned request stops decoding: the engine takes new work at once
        started = engine.stats.tokens_generated
        from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams

        result = engine.generate(engine.encode_chat(MESSAGES), SamplingParams(max_tokens=3), timeout=30)
        assert len(result.choices[0].token_ids) == 3
        assert engine.stats.tokens_generated - started < 100  # not the 900 tokens nobody reads
        assert not handle.engine_host._jobs
    finally:
        handle.stop()


def test_an_address_in_use_is_an_error_here_not_in_the_child(engine):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            serve_in_process(engine, "127.0.0.1", taken.getsockname()[1])


SIGINT_ON_ANOTHER_THREAD = """
import signal, subprocess, sys, threading, time
from spanrl.trainer_bridge.torch_backend.server.api_process import ProcessServerHandle

front_end = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
handle = ProcessServerHandle(url="", host="", port=0, process=front_end, engine_host=None, engine=None,
                             owns_engine=False)
parked = threading.Event()
worker = threading.Thread(target=parked.wait, daemon=True)
worker.start()
# Ctrl-C as CUDA processes get it: the signal lands on a thread other than the main one
threading.Timer(0.5, signal.pthread_kill, (worker.ident, signal.SIGINT)).start()
started = time.monotonic()
try:
    handle.wait()
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - started:.1f} s")
finally:
    front_end.kill()
"""


def test_waiting_for_the_front_end_ends_on_ctrl_c_delivered_to_another_thread():
    # `spanrl serve` waits on its front end in the main thread; on a GPU machine SIGINT went to a
    # CUDA driver thread, a blocking waitpid never returned and Ctrl-C did nothing.
    result = subprocess.run(as_in_a_terminal([sys.executable, "-c", SIGINT_ON_ANOTHER_THREAD]), capture_output=True,
                            text=True, timeout=25)
    assert "interrupted after" in result.stdout, result.stdout + result.stderr
    assert float(result.stdout.split()[2]) < 5
