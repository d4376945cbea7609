"""``from_traffic``: one training step on served traffic, end to end through the real parts.

The real ``openai`` client sends requests to the torch backend's policy endpoint (tiny model),
one conversation id per request (``x-spanrl-rollout-id``); the endpoint's own spans go over
OTLP to an in-process receiver, which assembles them; feedback arrives afterwards over HTTP by
the response id the endpoint returned; ``TrafficLoop.run_step`` trains on the judged rollouts:
the two answers to the same prompt as a group, the others against their agent's running mean.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.schema import metrics as keys
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.traffic_loop import TrafficLoop
from spanrl.trainer_bridge.train_settings import TrainSettings

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


def post(port: int, path: str, body: dict | None = None) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status in (200, 202)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A receiver, and the torch backend whose endpoint exports its spans to it."""
    import torch

    from spanrl.trainer_bridge.torch_backend.backend import start_backend
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    receiver = ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.1,
                                               poll_s=0.05, idle_timeout_s=0)).start()
    monkeypatch.setenv(SPANS_ENDPOINT_ENV, f"http://127.0.0.1:{receiver.grpc_port}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    settings = TrainSettings(from_traffic=True, model=str(model_dir), store=str(tmp_path / "spanrl.db"),
                             device=TEST_DEVICE, output_dir=str(tmp_path / "run"), policy_port=0, checkpoint_every=0,
                             learning_rate=1e-3, tasks_per_step=4, group_size=2, traffic_wait_s=60)
    backend = start_backend(settings.backend_run())
    try:
        yield receiver, backend, settings
    finally:
        backend.close()
        receiver.stop()
        torch.set_num_threads(threads)


def test_a_step_trains_on_served_requests_once_their_feedback_arrived(served):
    import openai

    receiver, backend, settings = served
    client = openai.OpenAI(base_url=backend.endpoint_url, api_key="unused", timeout=60)
    prompts = ["add 2 and 3", "add 2 and 3", "name a colour", "count to two"]
    answers = []
    for index, prompt in enumerate(prompts):
        answers.append(client.chat.completions.create(
            model=settings.policy_model_name, messages=[{"role": "user", "content": prompt}], max_tokens=4,
            temperature=1.0, extra_headers={"x-spanrl-rollout-id": f"conversation-{index}"}))
        post(receiver.http_port, f"/spanrl/v1/rollouts/conversation-{index}/complete")
    loop = TrafficLoop(settings)
    try:
        # the service's users judge the answers later, by the id the endpoint returned
        for answer, value in zip(answers, (1.0, 0.0, 0.3, 0.9), strict=True):
            post(receiver.http_port, "/spanrl/v1/feedback",
                 {"response_id": answer.id, "value": value, "idempotency_key": answer.id})
        before = backend.policy_version
        started = time.monotonic()
        row = loop.run_step(0, backend)
        assert time.monotonic() - started < 60, "the step waited for its traffic_wait_s: the rollouts never judged"
    finally:
        loop.close()
    assert row[keys.ROLLOUTS] == 4 and row[keys.TRAFFIC_GROUPED] == 2 and row[keys.TRAFFIC_BY_AGENT_BASELINE] == 2
    assert row[keys.REWARD_MEAN] == pytest.approx((1.0 + 0.0 + 0.3 + 0.9) / 4)
    # every call is trained: the group's two (GRPO), and the two alone, against their agent's running
    # mean (decay 0.9: 1.0 and 0.0 from the group leave 0.9): 0.3 - 0.9, then 0.9 - 0.84
    assert row[keys.TRANSITIONS] == 4
    assert backend.policy_version == before + 1
