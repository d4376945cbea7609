"""Late rollouts on the verl backend: verl's own truncated importance sampling, not dropped.

With ``async_training`` and ``off_policy_rollouts: correct`` (``rollout_is_cap`` > 0 in the
neutral algorithm config) ``config.py`` turns on verl's rollout correction in its decoupled,
token-level form (``algorithm.rollout_correction``: ``rollout_is: token``,
``rollout_is_threshold``: the cap, ``bypass_mode: false``), the same correction the embedded
trainer applies (``torch_backend/losses.truncated_is_weights``). ``VerlBackend`` then, as verl's
``RayPPOTrainer`` does in decoupled mode:

1. recomputes the old log-probs with the current weights (verl's ``compute_log_prob``);
2. calls ``correct_off_policy`` here: verl's ``compute_rollout_correction_and_add_to_batch``
   puts ``rollout_is_weights = min(exp(old_log_probs - rollout_log_probs), cap)`` into the
   batch (``rollout_log_probs``: the engine's logprobs of the tokens it sampled, carried by
   ``batch.py`` from each transition), which verl's ``ppo_loss`` multiplies into each token's
   policy-gradient loss.

A row whose sample carried no engine logprobs has NaN there (``batch.py``); such a sample is
on-policy (late ones without logprobs were dropped when the batch was built), so its engine
logprobs are taken as the recomputed ones: weight 1. Imports verl and torch; only the verl
backend imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

# verl's names of the IS statistics -> spanrl's (the embedded trainer reports the same two)
RENAMED = {"rollout_corr/rollout_is_mean": "rollout_is_mean",
           "rollout_corr/rollout_is_ratio_fraction_high": "rollout_is_truncated"}


def correct_off_policy(data: DataProto, rollout_correction: Any) -> tuple[DataProto, dict[str, float]]:
    """``data`` (with ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``) with verl's
    ``rollout_is_weights`` added, and the statistics: ``rollout_is_mean`` (the mean weight over
    trained tokens), ``rollout_is_truncated`` (the share of trained tokens whose ratio the cap
    bounded), ``rollout_is_rows_without_logprobs`` and verl's other ``rollout_corr/`` metrics
    (max, min, effective sample size, the KL and perplexity of the engine vs the trainer)."""
    rollout = data.batch["rollout_log_probs"]
    missing = torch.isnan(rollout)
    trained = data.batch["response_mask"].sum(dim=1) > 0  # not the filler rows of pad_to_multiple
    rows_missing = int((missing.any(dim=1) & trained).sum())
    data.batch["rollout_log_probs"] = torch.where(missing, data.batch["old_log_probs"].to(rollout.dtype), rollout)
    data, metrics = compute_rollout_correction_and_add_to_batch(data, rollout_correction)
    renamed = {RENAMED.get(key, key): float(value) for key, value in metrics.items()}
    renamed["rollout_is_rows_without_logprobs"] = float(rows_missing)
    return data, renamed
