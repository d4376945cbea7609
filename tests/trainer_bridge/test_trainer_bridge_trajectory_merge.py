"""Trajectory merging on the torch backend: a rollout's calls as one masked row train exactly as
the calls one by one (under ``token-mean``), and a prompt that does not extend the row splits it.

Also the truncated importance-sampling correction of asynchronous training: with the engine's
logprobs below the trainer's, every token weighs ``is_truncation`` and the loss scales by it.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from spanrl.trainer_bridge import advantages as grpo_advantages
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend import losses
from spanrl.trainer_bridge.torch_backend.batching import loss_token_values
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer, TrainerConfig
from spanrl.trainer_bridge.trajectory_merge import merge_trajectories

from .conftest import TEST_DEVICE

VOCAB = (20, 200)  # token ids drawn from the tiny model's vocabulary


def multi_turn_rollout(rng: random.Random, rollout_id: str, calls: int) -> list[TrainingSample]:
    """The calls of one multi-turn agent run: each prompt is the previous prompt + response +
    a tool result, each call with its own advantage (transition-level returns)."""
    prompt = [rng.randint(*VOCAB) for _ in range(rng.randint(5, 9))]
    samples = []
    for call in range(calls):
        response = [rng.randint(*VOCAB) for _ in range(rng.randint(2, 6))]
        samples.append(TrainingSample(
            prompt_token_ids=list(prompt), response_token_ids=response, advantage=rng.uniform(-1.5, 1.5),
            group_id="task", rollout_id=rollout_id, turn_index=call, reward=rng.random(), policy_version=call))
        prompt = prompt + response + [rng.randint(*VOCAB) for _ in range(rng.randint(1, 4))]
    return samples


def transitions(seed: int = 0) -> list[TrainingSample]:
    rng = random.Random(seed)
    return [s for r in range(4) for s in multi_turn_rollout(rng, f"r{r}", calls=3)]


def trainer(model_dir, **overrides) -> TorchTrainer:
    return TorchTrainer(model_dir, TrainerConfig(device=TEST_DEVICE, learning_rate=1e-3, seed=0, **overrides))


def record_gradients(model_trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """The gradient each parameter has when the backward passes are done (filled then)."""
    grads: dict[str, torch.Tensor] = {}
    for name, parameter in model_trainer.model.named_parameters():
        parameter.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    return grads


def test_consecutive_calls_become_one_row_with_the_in_between_tokens_masked():
    samples = transitions()
    rows, stats = merge_trajectories(samples)
    assert len(rows) == 4 and stats.rows == 4 and stats.transitions == 12 and stats.prefix_mismatches == 0
    for row in rows:
        calls = [s for s in samples if s.rollout_id == row.rollout_id]
        last = calls[-1]
        assert list(row.prompt_token_ids) == list(calls[0].prompt_token_ids)
        # the row is the last call's whole sequence
        assert list(row.prompt_token_ids) + list(row.response_token_ids) == \
            list(last.prompt_token_ids) + list(last.response_token_ids)
        assert row.loss_token_count == sum(len(c.response_token_ids) for c in calls)
        assert loss_token_values(row, row.response_advantages) == pytest.approx(
            [c.advantage for c in calls for _ in c.response_token_ids])
        assert row.policy_version == 0  # the oldest call's
    assert stats.tokens_merged < stats.tokens_per_transition


def test_a_prompt_that_does_not_extend_the_row_starts_a_new_one_and_is_counted():
    first, second, third = multi_turn_rollout(random.Random(1), "r0", calls=3)
    prompt = list(second.prompt_token_ids)
    prompt[2] = prompt[2] + 1  # the agent rewrote its history
    edited = dataclasses.replace(second, prompt_token_ids=prompt)
    continued = dataclasses.replace(third, prompt_token_ids=prompt + list(second.response_token_ids) + [7])
    other_rollout = dataclasses.replace(first, rollout_id="r1")
    rows, stats = merge_trajectories([first, edited, continued, other_rollout])
    assert stats.prefix_mismatches == 1
    assert [r.rollout_id for r in rows] == ["r0", "r0", "r1"]
    assert rows[0] is first and rows[2] is other_rollout  # rows of one call stay those calls
    assert list(rows[1].prompt_token_ids) == prompt
    assert rows[1].loss_mask == [1] * len(second.response_token_ids) + [0] + [1] * len(third.response_token_ids)


def test_merged_rows_train_exactly_as_the_transitions_under_token_mean(tiny_model_dir):
    samples = transitions()
    per_transition = trainer(tiny_model_dir)
    # engine-like old logprobs: near the current ones, so the clip and the ratio both matter
    rng = random.Random(3)
    current = per_transition.sequence_logprobs(samples)
    samples = [dataclasses.replace(s, old_logprobs=[v + rng.uniform(-0.3, 0.3) for v in values])
               for s, values in zip(samples, current, strict=True)]
    rows, _ = merge_trajectories(samples)
    merged = trainer(tiny_model_dir)
    assert merged.sequence_logprobs(rows)[0] == pytest.approx(
        [v for s in samples if s.rollout_id == "r0" for v in current[samples.index(s)]], abs=1e-5)

    expected_grads, got_grads = record_gradients(per_transition), record_gradients(merged)
    expected = per_transition.grpo_step(samples)
    got = merged.grpo_step(rows)
    assert got["samples"] == 4 and expected["samples"] == 12
    assert got["response_tokens"] == expected["response_tokens"]
    assert got["tokens"] < expected["tokens"]
    for key in ("pg_loss", "ppo_kl", "pg_clipfrac", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    assert expected["pg_clipfrac"] > 0
    # the gradients (Adam's first step is about lr * sign(g): compared before it)
    assert got_grads.keys() == expected_grads.keys() and got_grads
    scale = max(float(g.abs().max()) for g in expected_grads.values())
    for name, grad in got_grads.items():
        assert torch.allclose(grad, expected_grads[name], rtol=1e-3, atol=1e-5 * scale), name


def test_rollout_loss_weights_of_merged_rows_equal_the_transitions():
    samples = transitions()
    weighted = grpo_advantages.weigh_rollouts_equally(samples)
    rows, _ = merge_trajectories(samples)
    weighted_rows = grpo_advantages.weigh_rollouts_equally(rows)
    for row in weighted_rows:
        calls = [s for s in weighted if s.rollout_id == row.rollout_id]
        assert loss_token_values(row, row.response_advantages) == pytest.approx(
            [c.advantage for c in calls for _ in c.response_token_ids])


def test_truncated_importance_weights_cap_the_ratio_of_trainer_to_engine_logprobs():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.0, -1.5, -9.0]])
    weights, metrics = losses.truncated_is_weights(old, engine, torch.tensor([[1.0, 1.0, 0.0]]), cap=1.5)
    assert weights.tolist()[0] == pytest.approx([1.0, 1.5, 0.0])  # exp(0.5) = 1.65 is capped; padding 0
    assert metrics["rollout_is_truncated"] == pytest.approx(0.5)


def test_importance_correction_weighs_tokens_by_the_capped_ratio(tiny_model_dir):
    samples = transitions()[:6]
    plain = trainer(tiny_model_dir)
    current = plain.sequence_logprobs(samples)
    on_policy = [dataclasses.replace(s, old_logprobs=v) for s, v in zip(samples, current, strict=True)]
    stale = [dataclasses.replace(s, old_logprobs=[x - 5.0 for x in v]) for s, v in zip(samples, current, strict=True)]
    expected = plain.grpo_step(on_policy)
    corrected = trainer(tiny_model_dir, rollout_is_cap=2.0).grpo_step(stale)
    # ratio to the trainer's old logprobs is 1 (no clip); every engine ratio exp(5) is capped at 2
    assert corrected["rollout_is_truncated"] == pytest.approx(1.0)
    assert corrected["rollout_is_mean"] == pytest.approx(2.0)
    assert corrected["pg_loss"] == pytest.approx(2.0 * expected["pg_loss"], rel=1e-4, abs=1e-6)
    uncorrected = trainer(tiny_model_dir).grpo_step(stale)  # engine logprobs as old: clipped instead
    assert uncorrected["pg_clipfrac"] + uncorrected["pg_clipfrac_lower"] > 0.9
