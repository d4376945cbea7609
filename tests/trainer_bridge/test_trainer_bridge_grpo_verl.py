"""spanrl's GRPO math equals verl's ``verl.trainer.ppo.core_algos`` on the same random inputs.

verl must be installed (CI installs it from .ci/requirements-ci*.txt); a missing verl fails
this file with the install command: skips are only for a missing GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spanrl.trainer_bridge import advantages as grpo_advantages
from spanrl.trainer_bridge.torch_backend import losses

try:
    import verl.trainer.ppo.core_algos as core_algos
except ImportError as exc:  # fail (not skip) with how to install it
    raise ImportError(
        "the GRPO comparison with verl needs verl installed: run "
        "`pip install -r .ci/requirements-ci.txt` then "
        "`pip install --no-deps -r .ci/requirements-ci-nodeps.txt`") from exc


class ActorSettings(dict):
    """What verl's ``compute_policy_loss_vanilla`` reads from its actor config."""

    __getattr__ = dict.__getitem__


def random_batch(seed: int, batch: int = 12, length: int = 9):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -torch.rand(batch, length, generator=generator) * 4
    new = old + torch.randn(batch, length, generator=generator) * 1.2
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, length).clone() * 2
    return old, new, advantages, mask


@pytest.mark.parametrize("norm", [True, False])
def test_group_advantages_equal_verl(norm):
    generator = torch.Generator().manual_seed(3)
    groups = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    scores = torch.randint(0, 2, (len(groups),), generator=generator).float() + \
        torch.rand(len(groups), generator=generator) * 0.1
    scores[3:5] = 1.0  # a group with zero variance
    mask = torch.ones(len(groups), 5)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        scores.unsqueeze(1) * torch.tensor([[0, 0, 0, 0, 1.0]]), mask, groups, norm_adv_by_std_in_grpo=norm)
    ours, keep = grpo_advantages.grpo_outcome_advantage(scores, groups.tolist(), norm_adv_by_std=norm)
    assert keep.all()
    torch.testing.assert_close(ours, verl_adv[:, 0], rtol=0, atol=1e-6)


def test_reinforce_plus_plus_equals_verl_with_one_token_per_response():
    """verl whitens over response tokens; with one token a response that is its samples' whitening."""
    generator = torch.Generator().manual_seed(7)
    groups = ["a", "a", "a", "b", "b", "c", "d", "d"]  # "b" all solved, "c" alone
    scores = torch.randint(0, 2, (len(groups),), generator=generator).float() + \
        torch.rand(len(groups), generator=generator) * 0.1
    scores[3:5] = 1.0
    config = core_algos.AlgoConfig(gamma=1.0)
    verl_adv, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        scores.unsqueeze(1), torch.ones(len(groups), 1), config=config)
    ours, keep = grpo_advantages.reinforce_plus_plus_outcome_advantage(scores, groups)
    assert keep.all()  # a group of one has the batch for a baseline
    torch.testing.assert_close(ours, verl_adv[:, 0], rtol=0, atol=1e-6)
    assert ours[3] == ours[4] > 0  # the all-solved group is pushed up, where GRPO gives it 0
    grpo, _ = grpo_advantages.grpo_outcome_advantage(scores, groups)
    assert grpo[3] == grpo[4] == 0


def test_reinforce_plus_plus_of_one_sample_or_equal_scores_is_zero():
    advantages, keep = grpo_advantages.reinforce_plus_plus_outcome_advantage(torch.tensor([1.0]), ["a"])
    assert advantages.tolist() == [0.0] and keep.tolist() == [False]
    advantages, keep = grpo_advantages.reinforce_plus_plus_outcome_advantage(torch.ones(4), ["a", "a", "b", "b"])
    assert advantages.tolist() == [0.0] * 4 and keep.all()
    with pytest.raises(ValueError, match="one group id each"):
        grpo_advantages.reinforce_plus_plus_outcome_advantage(torch.ones(3), ["a"])


def test_group_of_one_is_dropped_not_trained_on_raw_reward():
    advantages, keep = grpo_advantages.grpo_outcome_advantage(torch.tensor([1.0, 0.0, 1.0, 0.7]), ["a", "a", "a", "b"])
    assert keep.tolist() == [True, True, True, False]
    assert advantages[3] == 0.0


def test_rollout_level_advantage_is_shared_by_transitions():
    # rollout r1 has 3 transitions, r2 and r3 one each, all in task t; r4 is alone in task u
    returns = [1.0, 1.0, 1.0, 0.0, 0.5, 1.0]
    rollouts = ["r1", "r1", "r1", "r2", "r3", "r4"]
    tasks = ["t", "t", "t", "t", "t", "u"]
    advantages, keep = grpo_advantages.group_advantages(returns, tasks, rollouts, level="rollout")
    expected, _ = grpo_advantages.grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.5]), ["t", "t", "t"])
    assert advantages[:3] == pytest.approx([float(expected[0])] * 3)
    assert advantages[3:5] == pytest.approx(expected[1:].tolist())
    assert keep == [True] * 5 + [False]
    transition_level, _ = grpo_advantages.group_advantages(returns, tasks, rollouts, level="transition")
    per_transition, _ = grpo_advantages.grpo_outcome_advantage(torch.tensor(returns[:5]), tasks[:5])
    assert transition_level[:5] == pytest.approx(per_transition.tolist())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_modes_equal_verl(mode):
    old, new, advantages, mask = random_batch(5)
    loss_mat = (new - old) ** 2 * advantages
    torch.testing.assert_close(losses.agg_loss(loss_mat, mask, mode),
                               core_algos.agg_loss(loss_mat, mask, mode), rtol=1e-6, atol=1e-7)
    # micro-batches given the whole batch's totals add up to the batch's loss
    kwargs = {"batch_num_tokens": mask.sum(), "global_batch_size": float(mask.shape[0]),
              "loss_scale_factor": mask.shape[1]}
    parts = losses.agg_loss(loss_mat[:5], mask[:5], mode, **kwargs) + \
        losses.agg_loss(loss_mat[5:], mask[5:], mode, **kwargs)
    torch.testing.assert_close(parts, losses.agg_loss(loss_mat, mask, mode), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clips", [(0.2, 0.2, 3.0), (0.1, 0.28, 2.0)])
def test_dual_clip_policy_loss_equals_verl(mode, clips):
    low, high, dual = clips
    old, new, advantages, mask = random_batch(11)
    new = new.requires_grad_(True)
    ours, metrics = losses.policy_loss_dual_clip(old, new, advantages, mask, clip_ratio_low=low,
                                               clip_ratio_high=high, clip_ratio_c=dual, loss_agg_mode=mode)
    (our_grad,) = torch.autograd.grad(ours, new)
    settings = ActorSettings(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=dual,
                             global_batch_info={})
    theirs, their_metrics = core_algos.compute_policy_loss_vanilla(old, new, advantages, mask, mode, settings)
    (their_grad,) = torch.autograd.grad(theirs, new)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-7)
    assert metrics["pg_clipfrac"] == pytest.approx(their_metrics["actor/pg_clipfrac"])
    assert metrics["ppo_kl"] == pytest.approx(their_metrics["actor/ppo_kl"])
    assert metrics["pg_clipfrac_lower"] == pytest.approx(their_metrics["actor/pg_clipfrac_lower"])
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0  # both clips were exercised


@pytest.mark.parametrize("kind", ["kl", "k1", "low_var_kl", "k3", "mse", "abs", "k3+"])
def test_kl_estimators_equal_verl(kind):
    old, new, _, _ = random_batch(17)
    ref = old.clone()
    ref[0, 0] = new[0, 0] + 30.0  # large gaps exercise verl's clamps
    ref[1, 0] = new[1, 0] - 30.0
    new = new.requires_grad_(True)
    ours = losses.kl_penalty(new, ref, kind)
    theirs = core_algos.kl_penalty(new, ref, kind)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), new)[0],
                               torch.autograd.grad(theirs.sum(), new)[0], rtol=1e-6, atol=1e-6)
