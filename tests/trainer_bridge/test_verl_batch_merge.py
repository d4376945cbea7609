"""Merged rows in verl's batch layout: a rollout's calls as one prompt + one response whose
in-between tokens have ``response_mask`` 0 (verl's multi-turn agent-loop layout) give the same
``token-mean`` policy loss as one row per call, computed on each layout with a real model's
forward pass; a prompt that does not extend the row starts another row.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend import losses
from spanrl.trainer_bridge.trajectory_merge import merge_trajectories
from spanrl.trainer_bridge.verl_backend.batch import build_verl_batch, to_worker_tensordict

MAX_PROMPT, MAX_RESPONSE = 48, 48
VOCAB = (20, 200)


def multi_turn_rollout(rng: random.Random, rollout_id: str, calls: int) -> list[TrainingSample]:
    """A multi-turn agent's calls: prompt = previous prompt + response + a tool result."""
    prompt = [rng.randint(*VOCAB) for _ in range(rng.randint(4, 8))]
    samples = []
    for call in range(calls):
        response = [rng.randint(*VOCAB) for _ in range(rng.randint(2, 5))]
        samples.append(TrainingSample(
            prompt_token_ids=list(prompt), response_token_ids=response, advantage=rng.uniform(-1.5, 1.5),
            old_logprobs=[-rng.uniform(3.0, 6.0) for _ in response], group_id="task", rollout_id=rollout_id,
            turn_index=call, reward=float(call)))
        prompt = prompt + response + [rng.randint(*VOCAB) for _ in range(rng.randint(1, 3))]
    return samples


def batch_of(samples: list[TrainingSample]):
    return build_verl_batch(samples, pad_token_id=0, max_prompt_length=MAX_PROMPT,
                            max_response_length=MAX_RESPONSE, temperature=1.0)


def verl_layout_loss(model, data) -> torch.Tensor:
    """The token-mean dual-clip loss of a verl batch: the model's logprob of each response
    token from verl's input_ids / attention_mask / position_ids, old = rollout_log_probs."""
    batch = data.batch
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()
    responses = batch["responses"]
    predicting = logits[:, MAX_PROMPT - 1: MAX_PROMPT - 1 + responses.shape[1]]
    logprobs = torch.log_softmax(predicting, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()
    loss, _ = losses.policy_loss_dual_clip(batch["rollout_log_probs"], logprobs, batch["advantages"], mask,
                                         loss_agg_mode="token-mean")
    return loss


def test_a_merged_row_is_prompt_plus_one_response_with_the_in_between_tokens_masked():
    calls = multi_turn_rollout(random.Random(0), "r0", calls=3)
    rows, _ = merge_trajectories(calls)
    batch = batch_of(rows).data.batch
    response_length = len(rows[0].response_token_ids)
    mask = batch["response_mask"][0, :response_length].tolist()
    assert mask == rows[0].loss_mask and 0 in mask
    assert batch["attention_mask"][0, MAX_PROMPT:MAX_PROMPT + response_length].tolist() == [1] * response_length
    assert batch["attention_mask"][0, MAX_PROMPT + response_length:].sum() == 0
    trained = [t for t, m in enumerate(mask) if m]
    assert batch["advantages"][0, trained].tolist() == pytest.approx(
        [c.advantage for c in calls for _ in c.response_token_ids])
    assert batch["advantages"][0][batch["response_mask"][0] == 0].abs().sum() == 0
    assert batch["rollout_log_probs"][0, trained].tolist() == pytest.approx(
        [v for c in calls for v in c.old_logprobs])
    assert batch["token_level_scores"][0].nonzero().flatten().tolist() == [trained[-1]]
    # the worker's loss mask is this response_mask
    worker = to_worker_tensordict(batch_of(rows))
    assert worker["loss_mask"][0, :response_length].tolist() == mask


def test_merged_rows_give_the_per_transition_loss_on_verls_layout(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    samples = [s for r in range(3) for s in multi_turn_rollout(rng, f"r{r}", calls=3)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # old logprobs near the model's own, so that the clip takes part
    per_call = batch_of(samples)
    with torch.no_grad():
        batch = per_call.data.batch
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()
        predicting = logits[:, MAX_PROMPT - 1: MAX_PROMPT - 1 + batch["responses"].shape[1]]
        current = torch.log_softmax(predicting, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    samples = [dataclasses.replace(s, old_logprobs=[float(v) + rng.uniform(-0.3, 0.3)
                                                    for v in current[i, : len(s.response_token_ids)]])
               for i, s in enumerate(samples)]
    rows, stats = merge_trajectories(samples)
    assert stats.rows == 3
    merged_loss = verl_layout_loss(model, batch_of(rows).data)
    per_call_loss = verl_layout_loss(model, batch_of(samples).data)
    assert float(merged_loss) == pytest.approx(float(per_call_loss), rel=1e-4, abs=1e-6)
    # a different advantage on one call changes it: the check can fail
    changed = [dataclasses.replace(s, advantage=s.advantage + 1.0) if s.turn_index == 1 else s for s in samples]
    assert abs(float(verl_layout_loss(model, batch_of(merge_trajectories(changed)[0]).data))
               - float(merged_loss)) > 1e-3


def test_a_prompt_that_does_not_extend_the_row_is_a_second_row_of_the_batch():
    first, second = multi_turn_rollout(random.Random(2), "r0", calls=2)
    rewritten = dataclasses.replace(second, prompt_token_ids=[5] + list(second.prompt_token_ids[1:]))
    rows, stats = merge_trajectories([first, rewritten])
    assert stats.prefix_mismatches == 1
    data = batch_of(rows).data
    assert data.batch["responses"].shape[0] == 2
    assert data.batch["response_mask"].sum() == len(first.response_token_ids) + len(second.response_token_ids)
    assert list(data.non_tensor_batch["turn_index"]) == [0, 1]
