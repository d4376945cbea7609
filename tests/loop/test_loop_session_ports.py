"""The task API's port is taken before the backend starts (minutes, for verl), so nothing the
backend starts (Ray, vLLM, their connections) can take it meanwhile: bound at once, refused to
runners until the backend is up, served from then on, and let go if the backend fails to start."""

from __future__ import annotations

import socket
import types
from contextlib import ExitStack

import httpx
import pytest

from spanrl.bridge_protocol import INFO_PATH
from spanrl.child_processes import free_port
from spanrl.trainer_bridge import session
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import TaskDispatcher
from spanrl.trainer_bridge.train_settings import TrainSettings
from tests.ports import port_is_free, port_is_released


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2.0).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_task_api_holds_its_port_from_the_start_and_serves_once_started():
    dispatcher = TaskDispatcher(rollout_timeout_s=1.0)
    api = BridgeAPI(dispatcher, None, lambda: 7, port=0)
    try:
        port = int(api.url.rsplit(":", 1)[1])
        assert not port_is_free(port) and refuses_connections(port)
        with pytest.raises(RuntimeError, match="needs the policy endpoint"):
            api.start()
        api.start(PolicyInfo("http://127.0.0.1:9/v1", "policy"))
        info = httpx.get(f"{api.url}{INFO_PATH}", timeout=10.0).json()
        assert info["policy_base_url"] == "http://127.0.0.1:9/v1" and info["policy_version"] == 7
    finally:
        dispatcher.close()
        api.stop()
    assert port_is_released(port)


class BackendStartWatch:
    """In front of ``make_backend``: records whether the task API's port could be taken while the
    backend starts, then fails that start (nothing is started)."""

    def __init__(self, port: int):
        self.port, self.port_was_free = port, None

    def __call__(self, *_args, **_kwargs):
        self.port_was_free = port_is_free(self.port)
        raise RuntimeError("the backend did not start")


def test_a_session_holds_the_task_api_port_while_the_backend_starts_and_lets_it_go_if_it_fails(monkeypatch,
                                                                                               tmp_path):
    port = free_port()
    watch = BackendStartWatch(port)
    monkeypatch.setattr(session, "make_backend", watch)
    settings = TrainSettings(tasks="unused.jsonl", model=str(tmp_path), output_dir=str(tmp_path / "run"),
                             bridge_port=port)
    loop = types.SimpleNamespace(dispatcher=TaskDispatcher(rollout_timeout_s=1.0))  # all start_session uses
    with ExitStack() as cleanup, pytest.raises(RuntimeError, match="did not start"):
        session.start_session(settings, loop, cleanup)
    assert watch.port_was_free is False
    assert port_is_released(port)
