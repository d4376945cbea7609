"""GRPO math: group advantages, per-rollout loss weights, the dual-clip PPO policy loss, loss
aggregation, KL estimators.

Pure functions over tensors, each with its formula and shapes, read the same way as verl's
``verl/trainer/ppo/core_algos.py`` and numerically equal to it (``tests/trainer_bridge`` checks
that against verl itself). Called by ``torch_trainer.TorchTrainer`` and by the bridge loop,
which computes advantages per GRPO group before handing samples to a backend.

Shapes: ``B`` sequences (transitions), ``T`` response tokens (right padded); masks are 1.0 on
real response tokens and 0.0 on padding.

Two spanrl choices differ from verl on purpose, both documented where they apply:
- a group of one is *dropped* (its ``keep`` flag is False); verl would train on its raw reward.
- advantages are rollout-level by default: all transitions of one rollout share the advantage
  of that rollout's return within its group, so a long rollout does not outweigh a short one
  in sign or size of advantage; ``weigh_rollouts_equally`` (``loss_weighting: rollout``) also
  evens out their share of the ``token-mean`` loss, whatever their number of calls and tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .backend import TrainingSample

# verl's constants, kept identical so results match bit for bit.
GRPO_EPSILON = 1e-6
MASKED_MEAN_EPSILON = 1e-8
SEQ_MEAN_EPSILON = 1e-8
LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- helpers


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)`` with values outside the mask (even NaN) ignored; a scalar."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / (sum(mask) + 1e-8)``; a scalar."""
    return masked_sum(values, mask) / (mask.sum() + MASKED_MEAN_EPSILON)


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


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo": grpo_outcome_advantage,
    "drgrpo": dr_grpo_outcome_advantage,
}


def group_advantages(
    returns: Sequence[float],
    group_ids: Sequence[Hashable],
    rollout_ids: Sequence[Hashable] | None = None,
    level: str = "rollout",
    estimator: str = "grpo",
    epsilon: float = GRPO_EPSILON,
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
        estimator: a name in ``ADVANTAGE_ESTIMATORS`` (``grpo`` or ``drgrpo``).

    Returns:
        ``(advantages, keep)`` lists with one entry per transition; ``keep`` is False for
        transitions of a group with a single sample (dropped, not trained on raw reward).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; "
                         f"choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if len(returns) != len(group_ids):
        raise ValueError("returns and group_ids must have one entry per transition")
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    if level == "transition":
        adv, keep = estimate(torch.tensor(list(returns), dtype=torch.float32), list(group_ids),
                             epsilon=epsilon)
        return adv.tolist(), keep.tolist()
    if level != "rollout":
        raise ValueError(f"level must be 'rollout' or 'transition', got {level!r}")
    if rollout_ids is None or len(rollout_ids) != len(returns):
        raise ValueError("level='rollout' needs one rollout id per transition")
    first_of_rollout: dict[Hashable, int] = {}
    for position, rollout in enumerate(rollout_ids):
        first_of_rollout.setdefault(rollout, position)
    rollouts = list(first_of_rollout)
    scores = torch.tensor([float(returns[first_of_rollout[r]]) for r in rollouts])
    groups = [group_ids[first_of_rollout[r]] for r in rollouts]
    adv, keep = estimate(scores, groups, epsilon=epsilon)
    by_rollout = {r: (float(a), bool(k)) for r, a, k in zip(rollouts, adv.tolist(), keep.tolist(), strict=True)}
    return ([by_rollout[r][0] for r in rollout_ids], [by_rollout[r][1] for r in rollout_ids])


# ----------------------------------------------------------------------------- rollout weighting


LOSS_WEIGHTINGS = ("token", "rollout")


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


# ----------------------------------------------------------------------------- loss aggregation


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a ``[B, T]`` per-token loss into a scalar.

    - ``token-mean``: ``sum(L * M) / N_tokens`` — every token of the batch weighs the same.
    - ``seq-mean-token-mean``: ``mean_b( sum_t(L*M)_b / (sum_t M_b + 1e-8) )`` over sequences
      with at least one token — every sequence weighs the same.
    - ``seq-mean-token-sum-norm``: ``mean_b( sum_t(L*M)_b ) / loss_scale_factor`` (default
      ``T``) — Dr.GRPO's length-unbiased form.

    ``batch_num_tokens`` / ``global_batch_size`` give the totals of the whole batch when
    ``loss_mat`` is one micro-batch of it, so micro-batch losses sum to the batch's loss
    (defaults: this tensor's own totals, as verl with one data-parallel rank).
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size
        return loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
    if loss_agg_mode == "seq-mean-token-mean":
        token_counts = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (token_counts + SEQ_MEAN_EPSILON)
        seq_mask = (token_counts > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")


# ----------------------------------------------------------------------------- policy loss


def policy_loss_dual_clip(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with dual clip (Ye et al. 2019), as verl's ``vanilla`` loss.

    With ``r = exp(clamp(logp - logp_old, -20, 20))`` per token ``[B, T]``::

        L1 = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L  = min(L1, -A * clip_ratio_c)   where A < 0,   L1 elsewhere

    then multiplied by ``token_weights`` (``[B, T]``, e.g. ``truncated_is_weights``; verl's
    ``rollout_is_weights``) when given and aggregated by ``agg_loss(L, response_mask,
    loss_agg_mode, **agg_kwargs)``.

    Args: ``old_logprobs``, ``logprobs``, ``advantages``, ``response_mask``: ``[B, T]``;
    ``clip_ratio_c > 1``.

    Returns: ``(loss scalar, metrics)`` with ``pg_clipfrac``, ``ppo_kl`` (mean of
    ``logp_old - logp``) and ``pg_clipfrac_lower`` (share of negative-advantage tokens the
    dual clip bounded).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_ratio_c}")
    negative_approx_kl = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)

    dual_bound = -advantages * clip_ratio_c
    dual_clip_loss = torch.min(dual_bound, clip_loss)
    clipfrac_lower = masked_mean(
        torch.gt(clip_loss, dual_bound) * (advantages < 0).float(), response_mask
    )
    token_losses = torch.where(advantages < 0, dual_clip_loss, clip_loss)
    if token_weights is not None:
        token_losses = token_losses * token_weights
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "pg_clipfrac": float(clipfrac.detach()),
        "ppo_kl": float(ppo_kl.detach()),
        "pg_clipfrac_lower": float(clipfrac_lower.detach()),
    }
    return loss, metrics


def truncated_is_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights of off-policy tokens (verl's token-level
    ``rollout_is``): per token ``w = min(exp(logp_old - logp_engine), cap)``, where
    ``logp_old`` is the trainer's log-prob before the update and ``logp_engine`` the serving
    engine's when it sampled the token (an older policy in asynchronous training).

    Args: ``[B, T]`` tensors and ``cap > 0``. Returns ``(weights [B, T]`` (0 off the mask,
    no gradient), ``metrics)`` with ``rollout_is_mean`` and ``rollout_is_truncated`` (share
    of tokens the cap bounded).
    """
    if cap <= 0:
        raise ValueError(f"the importance-sampling cap must be positive, got {cap}")
    log_ratio = torch.clamp(old_logprobs.detach() - engine_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weights = torch.clamp(ratio, max=cap) * response_mask
    metrics = {
        "rollout_is_mean": float(masked_mean(weights, response_mask)),
        "rollout_is_truncated": float(masked_mean((ratio > cap).float(), response_mask)),
    }
    return weights.detach(), metrics


# ----------------------------------------------------------------------------- KL estimators


def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 (``kl``): ``logp - logp_ref`` per token, ``[B, T]``. Unbiased, high variance."""
    return logprob - ref_logprob


def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``|logp - logp_ref|`` per token, ``[B, T]``."""
    return (logprob - ref_logprob).abs()


def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 (``mse``): ``0.5 * (logp - logp_ref)^2`` per token, ``[B, T]``."""
    return 0.5 * (logprob - ref_logprob).square()


def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 (``low_var_kl``, Schulman 2020) per token, ``[B, T]``::

        d = clamp(logp_ref - logp, -20, 20);   k3 = clamp(exp(d) - d - 1, -10, 10)
    """
    log_ratio = torch.clamp(ref_logprob - logprob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    estimate = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
    return torch.clamp(estimate, min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": kl_k1, "k1": kl_k1,
    "abs": kl_abs,
    "mse": kl_k2, "k2": kl_k2,
    "low_var_kl": kl_k3, "k3": kl_k3,
}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` by name (``KL_ESTIMATORS``).

    A trailing ``+`` (``k3+``) keeps the named estimator's value but takes the gradient of k2
    (straight-through), which is the unbiased KL gradient — as verl.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    value = KL_ESTIMATORS[base](logprob, ref_logprob)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2_value = kl_k2(logprob, ref_logprob)
    return k2_value - k2_value.detach() + value.detach()
