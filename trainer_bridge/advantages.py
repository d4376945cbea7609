"""GRPO group advantages and per-rollout loss weights: what the loop computes before any backend.

Pure functions, each with its formula, read the same way as verl's
``verl/trainer/ppo/core_algos.py`` and numerically equal to it (``tests/trainer_bridge`` checks
that against verl itself). Called by the loop's sample builder (``samples.training_samples``)
and by the verl backend (``weigh_rollouts_equally`` again on the samples it keeps), so every
backend trains on the same numbers. The losses the torch backend takes of them are
``torch_backend/losses.py``; the names a config may pick are ``algorithm.py``'s.

Two spanrl choices differ from verl on purpose, both documented where they apply:
- a group of one is *dropped* (its ``keep`` flag is False); verl would train on its raw reward.
- advantages are rollout-level by default: all transitions of one rollout share the advantage
  of that rollout's return within its group, so a long rollout does not outweigh a short one
  in sign or size of advantage; ``weigh_rollouts_equally`` (``loss_weighting: rollout``) also
  evens out their share of the ``token-mean`` loss, whatever their number of calls and tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence

import torch

from .algorithm import ADVANTAGE_ESTIMATOR_NAMES, ADVANTAGE_LEVELS
from .backend import TrainingSample

# verl's constants, kept identical so results match bit for bit.
GRPO_EPSILON = 1e-6  # added to a group's std (compute_grpo_outcome_advantage)
WHITEN_EPSILON = 1e-8  # added to the batch's variance (verl_F.masked_whiten)


# ----------------------------------------------------------------------------- advantages


def grpo_outcome_advantage(
    scores: torch.Tensor,
    group_ids: Sequence[Hashable],
    norm_adv_by_std: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage of one scalar score per sample.

    For sample ``i`` in group ``g`` with scores ``s_g`` (``n_g >= 2`` of them)::

        A_i = (s_i - mean(s_g)) / (std(s_g) + epsilon)    # GRPO (std is unbiased, as torch.std)
        A_i =  s_i - mean(s_g)                            # Dr.GRPO (norm_adv_by_std=False)

    Args:
        scores: ``[B]`` float, one score (return) per sample.
        group_ids: ``B`` hashable group keys (the task id of a GRPO group).
        norm_adv_by_std: divide by the group's std (GRPO) or not (Dr.GRPO).
        epsilon: added to the std, as verl (``1e-6``).

    Returns:
        ``(advantages [B], keep [B] bool)``. A group with a single sample has no baseline:
        its sample gets advantage 0 and ``keep=False`` so the caller drops it (verl instead
        would use mean 0, std 1 and train on the raw score).
    """
    if scores.dim() != 1 or scores.shape[0] != len(group_ids):
        raise ValueError(f"scores must be [B] with one group id each; got {tuple(scores.shape)} "
                         f"and {len(group_ids)} group ids")
    scores = scores.detach().to(torch.float32)
    members: dict[Hashable, list[int]] = {}
    for position, key in enumerate(group_ids):
        members.setdefault(key, []).append(position)
    advantages = torch.zeros_like(scores)
    keep = torch.zeros(scores.shape[0], dtype=torch.bool)
    for positions in members.values():
        if len(positions) < 2:
            continue
        index = torch.tensor(positions)
        group = scores[index]
        centred = group - group.mean()
        advantages[index] = centred / (group.std() + epsilon) if norm_adv_by_std else centred
        keep[index] = True
    return advantages, keep


def dr_grpo_outcome_advantage(
    scores: torch.Tensor, group_ids: Sequence[Hashable], epsilon: float = GRPO_EPSILON
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``A_i = s_i - mean(s_g)`` (no std normalisation). Shapes as ``grpo_outcome_advantage``."""
    return grpo_outcome_advantage(scores, group_ids, norm_adv_by_std=False, epsilon=epsilon)


def reinforce_plus_plus_outcome_advantage(
    scores: torch.Tensor, group_ids: Sequence[Hashable], epsilon: float = WHITEN_EPSILON
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025; verl's ``reinforce_plus_plus``): the batch is the baseline.

    Over all ``B`` samples of the batch, whatever their group::

        A_i = (s_i - mean(s)) / sqrt(var(s) + epsilon)      # var unbiased, as verl's masked_whiten

    Unlike GRPO, a group whose rollouts all scored the same still gets a push: up when it did
    better than the batch (a task the policy solves is kept solved), down when it did worse.
    verl whitens over the batch's response *tokens* (a long response weighs more in the mean);
    spanrl over its samples (rollouts, or transitions at ``level="transition"``), as its GRPO is
    rollout-level; the two are equal when every sample has one response token.

    Args: ``scores`` ``[B]``; ``group_ids``: ``B`` keys, not used for the baseline (kept for the
    estimators' common signature); ``epsilon``: added to the variance (verl's ``1e-8``).

    Returns: ``(advantages [B], keep [B] bool)``; every sample is kept when ``B >= 2`` (a group
    of one has the batch for a baseline), none when the batch is a single sample.
    """
    if scores.dim() != 1 or scores.shape[0] != len(group_ids):
        raise ValueError(f"scores must be [B] with one group id each; got {tuple(scores.shape)} "
                         f"and {len(group_ids)} group ids")
    scores = scores.detach().to(torch.float32)
    if scores.shape[0] < 2:
        return torch.zeros_like(scores), torch.zeros(scores.shape[0], dtype=torch.bool)
    centred = scores - scores.mean()
    advantages = centred * torch.rsqrt(scores.var() + epsilon)
    return advantages, torch.ones(scores.shape[0], dtype=torch.bool)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo": grpo_outcome_advantage,
    "drgrpo": dr_grpo_outcome_advantage,
    "reinforce_plus_plus": reinforce_plus_plus_outcome_advantage,
}


def group_advantages(
    returns: Sequence[float],
    group_ids: Sequence[Hashable],
    rollout_ids: Sequence[Hashable] | None = None,
    level: str = "rollout",
    estimator: str = "grpo",
    epsilon: float | None = None,
) -> tuple[list[float], list[bool]]:
    """Advantage of every transition, from per-transition returns grouped by task.

    Args:
        returns: one return per transition (with ``identical`` credit assignment every
            transition of a rollout carries the rollout's return).
        group_ids: the GRPO group (task) of each transition.
        rollout_ids: the rollout of each transition; required for ``level="rollout"``.
        level: ``"rollout"`` (default): each rollout is one sample of its group, scored by the
            return of its first transition, and all its transitions share the advantage, so a
            rollout with many calls does not outweigh a short one. ``"transition"``: every
            transition is one sample of its group, scored by its own return.
        estimator: a name in ``ADVANTAGE_ESTIMATORS`` (``grpo``, ``drgrpo``, ``reinforce_plus_plus``).
        epsilon: the estimator's epsilon (None: its own default, verl's).

    Returns:
        ``(advantages, keep)`` lists with one entry per transition; ``keep`` is False for
        transitions of a group with a single sample (dropped, not trained on raw reward).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; "
                         f"choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if len(returns) != len(group_ids):
        raise ValueError("returns and group_ids must have one entry per transition")
    estimate = functools.partial(ADVANTAGE_ESTIMATORS[estimator], **({} if epsilon is None else {"epsilon": epsilon}))
    if level == "transition":
        adv, keep = estimate(torch.tensor(list(returns), dtype=torch.float32), list(group_ids))
        return adv.tolist(), keep.tolist()
    if level not in ADVANTAGE_LEVELS:
        raise ValueError(f"level must be 'rollout' or 'transition', got {level!r}")
    if rollout_ids is None or len(rollout_ids) != len(returns):
        raise ValueError("level='rollout' needs one rollout id per transition")
    first_of_rollout: dict[Hashable, int] = {}
    for position, rollout in enumerate(rollout_ids):
        first_of_rollout.setdefault(rollout, position)
    rollouts = list(first_of_rollout)
    scores = torch.tensor([float(returns[first_of_rollout[r]]) for r in rollouts])
    groups = [group_ids[first_of_rollout[r]] for r in rollouts]
    adv, keep = estimate(scores, groups)
    by_rollout = {r: (float(a), bool(k)) for r, a, k in zip(rollouts, adv.tolist(), keep.tolist(), strict=True)}
    return ([by_rollout[r][0] for r in rollout_ids], [by_rollout[r][1] for r in rollout_ids])


# ----------------------------------------------------------------------------- rollout weighting


def rollout_loss_weights(response_lengths: Sequence[int], rollout_ids: Sequence[Hashable]) -> list[float]:
    """Per-sample factors that make every rollout weigh the same under ``token-mean``.

    With ``N`` response tokens in the batch, ``R`` rollouts and ``n_r`` response tokens of
    rollout ``r``, sample ``i`` of rollout ``r`` gets ``w_i = N / (R * n_r)``. Multiplying each
    sample's advantage by ``w_i`` turns the ``token-mean`` loss ``sum_i,t L_it / N`` into
    ``(1/R) * sum_r mean_{t in r} L_t``: a rollout of three calls weighs what a rollout of one
    call weighs. Exact because the clipped PPO objective (dual clip included) is linear in a
    positive per-token scale of the advantage; the KL term carries no advantage and stays
    token-weighted.

    Args: ``response_lengths``: response tokens per sample (each ``> 0``); ``rollout_ids``:
    the rollout of each sample.

    Returns: ``w_i`` per sample (all ``1.0`` when every rollout has the same token count).
    """
    if len(response_lengths) != len(rollout_ids):
        raise ValueError("response_lengths and rollout_ids must have one entry per sample")
    if any(length <= 0 for length in response_lengths):
        raise ValueError("every sample needs at least one response token to be weighted")
    tokens_of: dict[Hashable, int] = {}
    for length, rollout in zip(response_lengths, rollout_ids, strict=True):
        tokens_of[rollout] = tokens_of.get(rollout, 0) + int(length)
    total = sum(tokens_of.values())
    return [total / (len(tokens_of) * tokens_of[rollout]) for rollout in rollout_ids]


def weigh_rollouts_equally(samples: Sequence[TrainingSample]) -> list[TrainingSample]:
    """``samples`` with ``rollout_loss_weights`` folded into their advantages.

    Weights already folded in are taken out first (``TrainingSample.group_advantage``), so a
    backend that drops some samples (over-long ones) calls this again on what it keeps and the
    weights stay exact for the samples actually trained on.
    """
    weights = rollout_loss_weights([s.loss_token_count for s in samples], [s.rollout_id for s in samples])
    return [_reweighed(s, w) for s, w in zip(samples, weights, strict=True)]


def _reweighed(sample: TrainingSample, weight: float) -> TrainingSample:
    """``sample`` with its loss weight replaced by ``weight`` (per-token advantages of merged
    rows scaled alike)."""
    factor = weight if sample.loss_weight is None else weight / sample.loss_weight
    token_advantages = (None if sample.token_advantages is None
                        else [float(a) * factor for a in sample.token_advantages])
    return dataclasses.replace(sample, advantage=sample.group_advantage * weight, loss_weight=weight,
                               token_advantages=token_advantages)


assert set(ADVANTAGE_ESTIMATORS) == set(ADVANTAGE_ESTIMATOR_NAMES), "algorithm.py names every estimator"
