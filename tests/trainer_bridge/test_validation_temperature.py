"""Greedy validation: ``val_temperature`` pins the temperature of validation rollouts' requests
(their ``x-spanrl-rollout-id`` names a validation round) on the embedded policy server, in its
API process as ``spanrl train`` runs it, and on the verl gateway; other rollouts keep the
agent's own temperature. Real servers, the real ``openai`` client."""

from __future__ import annotations

import os

import openai
import pytest

from spanrl.errors import SettingError
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
MESSAGES = [{"role": "user", "content": "What is 37 + 45?"}]
VALIDATION_ID = "v4-task0-a0-0a1b"  # as validation rounds name their rollouts
TRAINING_ID = "s4-task0-a0-0a1b"


def sampled_ids(base_url: str, model: str, rollout_id: str | None, temperature: float, seed: int) -> list[int]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    headers = {"x-spanrl-rollout-id": rollout_id} if rollout_id else {}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=temperature, seed=seed,
        extra_headers=headers, extra_body={"return_token_ids": True})
    return list(raw.parse().choices[0].model_extra["token_ids"])


def check_only_validation_is_greedy(base_url: str, model: str) -> None:
    greedy = sampled_ids(base_url, model, None, 0.0, seed=0)
    # validation rollouts asking for 1.5 get greedy samples, whatever their seed
    assert all(sampled_ids(base_url, model, VALIDATION_ID, 1.5, seed) == greedy for seed in (1, 2, 3))
    # training rollouts (and calls outside rollouts) keep the temperature they asked for
    training = [sampled_ids(base_url, model, TRAINING_ID, 1.5, seed) for seed in (1, 2, 3)]
    assert any(ids != greedy for ids in training), training


@pytest.fixture
def engine(tiny_model_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    return PolicyEngine.from_pretrained(tiny_model_dir, device=TEST_DEVICE, dtype="float32")


def test_the_policy_servers_api_process_samples_validation_rollouts_greedily(engine):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    server = serve_in_process(engine, validation_temperature=0.0)
    try:
        check_only_validation_is_greedy(server.base_url, engine.model_name)
    finally:
        server.stop()


def test_the_verl_gateway_samples_validation_rollouts_greedily(engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    upstream = serve_in_thread(engine)
    gateway = start_gateway(GatewayConfig(served_model_name="policy", validation_temperature=0.0), [upstream.url])
    try:
        check_only_validation_is_greedy(gateway.url, "policy")
    finally:
        gateway.stop()
        upstream.stop()


def test_val_temperature_is_a_checked_setting():
    assert TrainSettings(tasks="t.jsonl", model="m", val_temperature=0.0).val_temperature == 0.0
    with pytest.raises(SettingError, match="val_temperature"):
        TrainSettings(tasks="t.jsonl", model="m", val_temperature=-1.0)
