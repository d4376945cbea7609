"""The torch backend's GRPO losses: dual-clip PPO policy loss, loss aggregation, KL estimators,
truncated importance-sampling weights.

Pure functions over tensors, each with its formula and shapes, read the same way as verl's
``verl/trainer/ppo/core_algos.py`` and numerically equal to it (``tests/trainer_bridge`` checks
that against verl itself). Called by ``trainer.TorchTrainer.grpo_step`` on samples whose
advantages the loop computed (``trainer_bridge/advantages.py``). The names a config may pick
(``LOSS_AGG_MODES``, the KL estimators) are the loop's ``algorithm.py``; this module implements
every one of them.

Shapes: ``B`` sequences (transitions), ``T`` response tokens (right padded); masks are 1.0 on
real response tokens and 0.0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spanrl.trainer_bridge.algorithm import KL_ESTIMATOR_NAMES, LOSS_AGG_MODES

# verl's constants, kept identical so results match bit for bit.
MASKED_MEAN_EPSILON = 1e-8
SEQ_MEAN_EPSILON = 1e-8
LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


# ----------------------------------------------------------------------------- helpers


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)`` with values outside the mask (even NaN) ignored; a scalar."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / (sum(mask) + 1e-8)``; a scalar."""
    return masked_sum(values, mask) / (mask.sum() + MASKED_MEAN_EPSILON)


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


assert set(KL_ESTIMATORS) == set(KL_ESTIMATOR_NAMES), "algorithm.py names every KL estimator"
