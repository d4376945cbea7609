"""A real verl update on merged rows (``merge_trajectories``) on CPU: verl's FSDP2 worker trained
on one masked row per rollout makes the update the embedded trainer makes on the same calls one
row each (token-mean: same loss, same gradient norm, same weights after)."""

from __future__ import annotations

import dataclasses
import random
import socket

import pytest

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.trajectory_merge import merge_trajectories
from spanrl.trainer_bridge.verl_backend.config import VerlConfig


def multi_turn_samples(rollouts: int = 4, calls: int = 3, seed: int = 0, vocab: int = 300) -> list[TrainingSample]:
    """Each rollout's calls: prompt = previous prompt + response + a tool result; an advantage per call."""
    rng = random.Random(seed)
    samples = []
    for rollout in range(rollouts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 9))]
        for call in range(calls):
            response = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
            samples.append(TrainingSample(prompt_token_ids=list(prompt), response_token_ids=response,
                                          advantage=rng.uniform(-1, 1), group_id=f"g{rollout // 2}",
                                          rollout_id=f"r{rollout}", turn_index=call))
            prompt = prompt + response + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 4))]
    return samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(900)
def test_verl_update_on_merged_rows_equals_the_embedded_update_on_transitions(tiny_models, tmp_path):
    from spanrl.trainer_bridge.verl_backend.backend import start_backend

    model_dir = tiny_models["tied"]
    samples = multi_turn_samples()
    rows, stats = merge_trajectories(samples)
    assert stats.rows == 4 and stats.prefix_mismatches == 0
    settings = TrainSettings(tasks="unused.jsonl", model=model_dir, backend="verl", learning_rate=1e-3,
                             output_dir=str(tmp_path / "run"), policy_port=free_port(), policy_model_name="policy",
                             checkpoint_every=0, verl=VerlConfig(cpu_mode="on"))
    embedded = TorchTrainer(model_dir, dataclasses.replace(settings.trainer, device="cpu"))
    expected = embedded.grpo_step(samples)
    expected_after = embedded.sequence_logprobs(samples)

    backend = start_backend(settings.backend_run())
    try:
        before = backend.log_probs(samples)
        result = backend.update(rows)
        assert result.details["samples"] == 4
        assert abs(result.loss - expected["pg_loss"]) < 1e-5
        assert result.grad_norm == pytest.approx(expected["grad_norm"], rel=1e-4)
        after = backend.log_probs(samples)  # verl's forward on the calls one by one
        moved = max(abs(x - y) for a, b in zip(after, before, strict=True) for x, y in zip(a, b, strict=True))
        assert moved > 0.05
        difference = max(abs(x - y) for a, b in zip(after, expected_after, strict=True)
                         for x, y in zip(a, b, strict=True))
        assert difference < 1e-4
    finally:
        backend.close()
