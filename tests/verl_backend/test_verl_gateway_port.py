"""The verl backend takes the gateway's port before it starts Ray and vLLM: a port already taken
fails at once, clearly, with no worker started; a free one is held through the workers' start (so
none of their processes can take it meanwhile) and let go if that start fails."""

from __future__ import annotations

import socket

import pytest

from spanrl.child_processes import free_port
from spanrl.errors import UserError
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.verl_backend import workers as verl_workers
from spanrl.trainer_bridge.verl_backend.config import VerlConfig
from tests.ports import port_is_free, port_is_released


class StoppedBeforeWorkers(Exception):
    pass


class WorkersStartWatch:
    """Stands in front of the real ``start_verl_workers``: records whether the gateway's port was
    free when the workers were asked to start, then stops the start there (nothing is started)."""

    def __init__(self, port: int):
        self.port, self.calls, self.port_was_free = port, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.port_was_free = port_is_free(self.port)
        raise StoppedBeforeWorkers



def settings_on(port: int, model: str, tmp_path) -> TrainSettings:
    return TrainSettings(tasks="unused.jsonl", model=model, backend="verl", output_dir=str(tmp_path / "run"),
                         policy_port=port, checkpoint_every=0, verl=VerlConfig(cpu_mode="on"))



def test_a_taken_gateway_port_fails_before_any_worker_starts(tiny_models, tmp_path, monkeypatch):
    from spanrl.trainer_bridge.verl_backend.backend import start_backend

    watch = WorkersStartWatch(0)
    monkeypatch.setattr(verl_workers, "start_verl_workers", watch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"the gateway cannot listen on 127.0.0.1:{port} .Address already in use"):
            start_backend(settings_on(port, tiny_models["tied"], tmp_path).backend_run())
    assert watch.calls == 0


def test_the_gateway_port_is_held_while_the_workers_start_and_let_go_if_they_fail(tiny_models, tmp_path,
                                                                                  monkeypatch):
    from spanrl.trainer_bridge.verl_backend.backend import start_backend

    port = free_port()
    watch = WorkersStartWatch(port)
    monkeypatch.setattr(verl_workers, "start_verl_workers", watch)
    with pytest.raises(StoppedBeforeWorkers):
        start_backend(settings_on(port, tiny_models["tied"], tmp_path).backend_run())
    assert watch.calls == 1 and watch.port_was_free is False
    assert port_is_released(port)
