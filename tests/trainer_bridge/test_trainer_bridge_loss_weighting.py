"""``loss_weighting: rollout``: with the trainer's own loss, every rollout weighs the same.

The weights (``grpo_advantages.rollout_loss_weights``) are folded into the advantages by
``training_samples``; the torch trainer's dual-clip PPO loss under ``token-mean`` then equals
the mean over rollouts of each rollout's own token mean, whatever their calls and tokens.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from spanrl.errors import SettingError
from spanrl.schema.rollouts import Transition
from spanrl.schema.scored import ScoredRollout
from spanrl.trainer_bridge import advantages as grpo_advantages
from spanrl.trainer_bridge.samples import training_samples
from spanrl.trainer_bridge.task_dispatch import Attempt
from spanrl.trainer_bridge.torch_backend import losses
from spanrl.trainer_bridge.train_settings import TrainSettings


def random_rollout_batch(seed: int, rollouts: int = 4, samples: int = 11, length: int = 9):
    """Samples spread over rollouts (each has one at least), ragged lengths, logprobs far
    enough apart that the clip and the dual clip are both active."""
    generator = torch.Generator().manual_seed(seed)
    owners = list(range(rollouts)) + torch.randint(0, rollouts, (samples - rollouts,), generator=generator).tolist()
    lengths = torch.randint(1, length + 1, (samples,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -torch.rand(samples, length, generator=generator) * 4
    new = (old + torch.randn(samples, length, generator=generator) * 1.2).requires_grad_(True)
    advantage_of_rollout = torch.randn(rollouts, generator=generator) * 2
    advantages = advantage_of_rollout[owners]
    return owners, lengths.tolist(), mask, old, new, advantages


def dual_clip_loss(old, new, advantages, mask, **kwargs):
    return losses.policy_loss_dual_clip(old, new, advantages.unsqueeze(1).expand_as(mask), mask,
                                      clip_ratio_c=3.0, loss_agg_mode="token-mean", **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_token_mean_is_the_mean_of_per_rollout_token_means(seed):
    owners, lengths, mask, old, new, advantages = random_rollout_batch(seed)
    weights = torch.tensor(grpo_advantages.rollout_loss_weights(lengths, owners))
    weighted, metrics = dual_clip_loss(old, new, advantages * weights, mask)
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0  # both clips take part
    (weighted_grad,) = torch.autograd.grad(weighted, new)

    per_rollout = []
    for rollout in sorted(set(owners)):
        rows = [i for i, owner in enumerate(owners) if owner == rollout]
        loss, _ = dual_clip_loss(old[rows], new[rows], advantages[rows], mask[rows])
        per_rollout.append(loss)
    expected = torch.stack(per_rollout).mean()
    (expected_grad,) = torch.autograd.grad(expected, new)
    assert float(weighted.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    assert torch.allclose(weighted_grad, expected_grad, rtol=1e-5, atol=1e-8)
    unweighted, _ = dual_clip_loss(old, new, advantages, mask)
    assert abs(float(unweighted.detach()) - float(expected.detach())) > 1e-3  # the weighting changes the loss


def transition(rollout_id: str, index: int, response_length: int) -> Transition:
    return Transition(rollout_id=rollout_id, index=index, span_id=f"{rollout_id}-{index}", agent_name="solver",
                      prompt_token_ids=(1, 2, 3 + index), response_token_ids=tuple(range(10, 10 + response_length)),
                      response_logprobs=None, choice_index=0, policy_version=1, reward=0.0, return_=0.0,
                      retokenized=False)


def scored(rollout_id: str, attempt: int, score: float, response_lengths: list[int]) -> ScoredRollout:
    return ScoredRollout(Attempt(rollout_id, "task", attempt, {"id": "task"}, 0), score,
                         tuple(transition(rollout_id, i, n) for i, n in enumerate(response_lengths)))


def rollout_shares(samples) -> dict[str, float]:
    """Each rollout's part of the trainer's token-mean loss at ratio 1 (old = new logprobs)."""
    length = max(len(s.response_token_ids) for s in samples)
    mask = torch.tensor([[1.0] * len(s.response_token_ids) + [0.0] * (length - len(s.response_token_ids))
                         for s in samples])
    advantages = torch.tensor([s.advantage for s in samples])
    logprobs = torch.full_like(mask, -1.0)
    total = float(mask.sum())
    shares = {}
    for rollout in {s.rollout_id for s in samples}:
        only = mask * torch.tensor([[1.0] if s.rollout_id == rollout else [0.0] for s in samples])
        shares[rollout], _ = dual_clip_loss(logprobs, logprobs, advantages, only, batch_num_tokens=total)
    return {rollout: float(value) for rollout, value in shares.items()}


def test_a_rollout_of_three_calls_weighs_what_a_rollout_of_one_call_weighs():
    rollouts = [scored("long", 0, 1.0, [4, 6, 5]), scored("short", 1, 0.0, [3])]
    token, _ = training_samples(rollouts, "rollout", True)
    weighted, _ = training_samples(rollouts, "rollout", True, loss_weighting="rollout")
    assert [(s.rollout_id, s.turn_index, s.group_id, s.reward) for s in weighted] == [
        ("long", 0, "task", 1.0), ("long", 1, "task", 1.0), ("long", 2, "task", 1.0), ("short", 0, "task", 0.0)]
    group_advantage = 0.5 / (statistics.stdev([1.0, 0.0]) + grpo_advantages.GRPO_EPSILON)
    assert [s.group_advantage for s in weighted] == pytest.approx([group_advantage] * 3 + [-group_advantage])
    assert [s.loss_weight for s in token] == [None] * 4
    assert [s.loss_weight for s in weighted] == pytest.approx([18 / 30] * 3 + [18 / 6])  # N / (R * n_r)

    shares = rollout_shares(weighted)  # each rollout: -A_r / R
    assert shares["long"] == pytest.approx(-group_advantage / 2, rel=1e-6)
    assert shares["short"] == pytest.approx(group_advantage / 2, rel=1e-6)
    by_tokens = rollout_shares(token)  # token weighting: the 15-token rollout outweighs the 3-token one 5:1
    assert by_tokens["long"] == pytest.approx(-5 * by_tokens["short"], rel=1e-6)


def test_rollout_weighting_needs_token_mean_and_a_known_name(tmp_path):
    base = dict(tasks=str(tmp_path / "tasks.jsonl"), model="model")
    assert TrainSettings(**base, loss_weighting="rollout").loss_weighting == "rollout"
    assert TrainSettings(**base).loss_weighting == "token"
    with pytest.raises(SettingError, match="token-mean"):
        TrainSettings(**base, loss_weighting="rollout", loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(SettingError, match="loss_weighting"):
        TrainSettings(**base, loss_weighting="call")
    with pytest.raises(ValueError, match="loss_weighting"):
        training_samples([scored("a", 0, 1.0, [2]), scored("b", 1, 0.0, [2])], "rollout", True, loss_weighting="x")


def test_negative_advantages_are_scaled_and_positive_ones_kept(tmp_path):
    rollouts = [scored("win", 0, 1.0, [2]), scored("loss-a", 1, 0.0, [3]), scored("loss-b", 2, 0.0, [1, 2])]
    plain, _ = training_samples(rollouts, "rollout", True)
    quarter, _ = training_samples(rollouts, "rollout", True, negative_advantage_scale=0.25)
    only_better, _ = training_samples(rollouts, "rollout", True, negative_advantage_scale=0.0)
    advantages = {s.rollout_id: s.advantage for s in plain}
    assert advantages["win"] > 0 > advantages["loss-a"] == advantages["loss-b"]
    assert {s.rollout_id: s.advantage for s in quarter} == pytest.approx(
        {"win": advantages["win"], "loss-a": advantages["loss-a"] / 4, "loss-b": advantages["loss-b"] / 4})
    assert [(s.rollout_id, s.advantage) for s in only_better if s.advantage != 0] == [("win", advantages["win"])]
    weighted, _ = training_samples(rollouts, "rollout", True, loss_weighting="rollout", negative_advantage_scale=0.25)
    assert [s.group_advantage for s in weighted] == pytest.approx([s.advantage for s in quarter])

    base = dict(tasks=str(tmp_path / "tasks.jsonl"), model="model")
    assert TrainSettings(**base).negative_advantage_scale == 1.0
    for wrong in (-0.1, 1.5):
        with pytest.raises(SettingError, match="negative_advantage_scale must be from 0 to 1"):
            TrainSettings(**base, negative_advantage_scale=wrong)


def test_positive_advantages_are_scaled_and_negative_ones_kept(tmp_path):
    """W-REINFORCE's weighting (positive_advantage_scale 0.1): the failures' push down stays whole,
    the successes' push up is a tenth; 0 leaves only the failures' push."""
    rollouts = [scored("win", 0, 1.0, [2]), scored("loss-a", 1, 0.0, [3]), scored("loss-b", 2, 0.0, [1, 2])]
    plain = {s.rollout_id: s.advantage for s in training_samples(rollouts, "rollout", True)[0]}
    tenth, _ = training_samples(rollouts, "rollout", True, positive_advantage_scale=0.1)
    assert {s.rollout_id: s.advantage for s in tenth} == pytest.approx(
        {"win": plain["win"] / 10, "loss-a": plain["loss-a"], "loss-b": plain["loss-b"]})
    only_failures, _ = training_samples(rollouts, "rollout", True, positive_advantage_scale=0.0)
    assert sorted(s.rollout_id for s in only_failures if s.advantage != 0) == ["loss-a", "loss-b", "loss-b"]
    both, _ = training_samples(rollouts, "rollout", True, positive_advantage_scale=0.5, negative_advantage_scale=0.5)
    assert [s.advantage for s in both] == pytest.approx([plain[s.rollout_id] / 2 for s in both])

    base = dict(tasks=str(tmp_path / "tasks.jsonl"), model="model")
    assert TrainSettings(**base).positive_advantage_scale == 1.0
    for wrong in (-0.1, 1.5):
        with pytest.raises(SettingError, match="positive_advantage_scale must be from 0 to 1"):
            TrainSettings(**base, positive_advantage_scale=wrong)
    with pytest.raises(SettingError, match="both 0"):
        TrainSettings(**base, positive_advantage_scale=0.0, negative_advantage_scale=0.0)
